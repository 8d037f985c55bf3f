"""Steps with prompt tokens through the prefill graphs against the same steps run eagerly, in one engine.

    python benchmarks/prefill_graphs.py --tokenizer-dir DIR [--repeats 9] [--json out.json]

One engine of the random-weight 8B shape (bfloat16, `gpu_e2e.py`'s `write_model`) on one GPU. For each
case, the wall time of one `ModelRunner.run` (the step's inputs made and copied, the forward, the sampled
rows' logits) to its end on the GPU, with the engine's PrefillGraphs and with them set aside (the eager
forward every step with prompt tokens ran before), alternating which goes first, medians of the repeats;
and `gpu_ms`, the graphs' step timed by CUDA events around it (what the GPU takes when the host is ahead).
Cases: one prompt of n tokens (`prompt_n`), and `mixed_d_n`: d sequences decoding beside a chunk of n.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_e2e import write_model

from disagg import LLM, SamplingParams
from disagg.engine.scheduler import ScheduledSeq
from disagg.engine.sequence import Sequence

CASES = [(0, n) for n in (16, 64, 128, 256, 384, 512, 768, 1024)] + [(16, 128), (32, 512)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


def make_batch(llm: LLM, decodes: int, n: int, gen: torch.Generator, tag: str) -> list[ScheduledSeq]:
    """Fresh sequences with their blocks: `decodes` of 256 computed tokens each, one to decode, and a
    prompt of n tokens."""
    vocab = llm.engine.runner.model.config.vocab_size
    bm = llm.engine.block_manager
    batch = []
    for i in range(decodes):
        seq = Sequence(f"{tag}-d{i}", torch.randint(10, vocab, (257,), generator=gen).tolist(), PARAMS)
        bm.allocate(seq)
        seq.num_computed_tokens = 256
        batch.append(ScheduledSeq(seq, 1))
    prompt = Sequence(f"{tag}-p", torch.randint(10, vocab, (n,), generator=gen).tolist(), PARAMS)
    bm.allocate(prompt)
    return batch + [ScheduledSeq(prompt, n)]


def free(llm: LLM, batch: list[ScheduledSeq]) -> None:
    for item in batch:
        llm.engine.block_manager.free(item.seq)


def timed(llm: LLM, batch: list[ScheduledSeq]) -> tuple[float, float]:
    """(wall seconds of the step to its end on the GPU, GPU seconds between events around it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    llm.engine.runner.run(batch)
    end.record()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, start.elapsed_time(end) / 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--model-dir", default="/tmp/disagg-roofline-model")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model_dir = str(write_model(args.shape, Path(args.model_dir), Path(args.tokenizer_dir), "cuda"))
    start = time.perf_counter()
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", kv_cache_memory=16 * 2**30, max_num_seqs=64)
    runner = llm.engine.runner
    graphs = runner.prefill_graphs
    print(f"engine start {time.perf_counter() - start:.1f} s; buckets {graphs.buckets}", flush=True)
    gen = torch.Generator().manual_seed(0)
    results = []
    for decodes, n in CASES:
        samples: dict[str, list[float]] = {"graphs": [], "eager": [], "gpu": []}
        for r in range(args.repeats + 1):  # the first repeat warms up (kernels for new shapes), not counted
            order = ["graphs", "eager"] if r % 2 else ["eager", "graphs"]
            for path in order:
                runner.prefill_graphs = graphs if path == "graphs" else None
                batch = make_batch(llm, decodes, n, gen, f"{path}{r}")
                wall, gpu = timed(llm, batch)
                free(llm, batch)
                if r:
                    samples[path].append(wall)
                    if path == "graphs":
                        samples["gpu"].append(gpu)
        runner.prefill_graphs = graphs
        row = {"case": f"prompt_{n}" if not decodes else f"mixed_{decodes}_{n}", "tokens": decodes + n}
        row |= {f"{path}_ms": statistics.median(v) * 1e3 for path, v in samples.items()}
        row["eager_over_graphs"] = row["eager_ms"] / row["graphs_ms"]
        row["samples_ms"] = {path: [round(x * 1e3, 3) for x in v] for path, v in samples.items()}
        results.append(row)
        print(f"{row['case']:14s} graphs {row['graphs_ms']:7.2f} ms  eager {row['eager_ms']:7.2f} ms  "
              f"gpu {row['gpu_ms']:7.2f} ms  eager/graphs {row['eager_over_graphs']:.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "repeats": args.repeats,
                                               "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
