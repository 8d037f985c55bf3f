"""The engine against the GPU's limits: decode step time over the memory roofline, prefill as
model FLOPs utilisation, with transformers' generate() and the engine's eager SDPA path beside it.

    python benchmarks/engine_roofline.py --tokenizer-dir DIR [--shape 8b] [--repeats 3]
        [--engines disagg,sdpa,transformers] [--json benchmarks/results/engine_h200.json]

One process, one GPU, bfloat16, a random-weight Llama of `--shape` (gpu_e2e.py's write_model).
Measured first, in the same run: HBM read bandwidth (a sum over a 4 GiB tensor) and the bf16
matmul peak (an 8192^3 product), both medians of timed repeats.

- decode step at batch B, context c: the median over repeats of (time from every sequence's
  first token to its last) / (steps - 1), each of B prompts of c random tokens; its roofline is
  (weight bytes + KV bytes read at the mean context) / HBM read bandwidth.
- prefill: B prompts of n tokens in one step, time to every first token; MFU = model FLOPs
  (2 x layer parameters x tokens + lm_head on one row a prompt + causal attention) / time / peak.
- `disagg` is the default engine (Triton attention, CUDA graphs); `sdpa` the same engine with
  attention_backend="sdpa" and enforce_eager (the path before the fast path), at batch 1 and 32
  and the 4k prefill only.
"""

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import DisaggBench, TransformersBench, machine_info, read_config
from gpu_e2e import write_model

DECODE_CASES = {"b1": (1, 512), "b32": (32, 512), "b128": (128, 512), "b1_32k": (1, 32768)}
PREFILL_CASES = {"1x4096": (1, 4096), "16x512": (16, 512)}
SDPA_CASES = ("b1", "b32", "1x4096")


def median_ms(fn, repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def hbm_read_bandwidth() -> float:
    x = torch.randn(2**31, dtype=torch.bfloat16, device="cuda")
    ms = median_ms(lambda: x.sum(dtype=torch.float32))
    return 2**32 / (ms / 1e3)


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = median_ms(lambda: a @ b)
    return 2 * 8192**3 / (ms / 1e3)


class Shape:
    def __init__(self, config: dict, model: torch.nn.Module):
        self.layers = config["num_hidden_layers"]
        self.heads = config["num_attention_heads"]
        self.head_dim = config.get("head_dim") or config["hidden_size"] // self.heads
        self.kv_bytes_per_token = self.layers * 2 * config["num_key_value_heads"] * self.head_dim * 2
        params = {name: p.numel() for name, p in model.named_parameters()}
        self.embed = params["model.embed_tokens.weight"]
        self.head = config["vocab_size"] * config["hidden_size"]
        self.layer_params = sum(n for name, n in params.items() if name.startswith("model.layers."))
        # A decode step reads every weight once: the layers, the final norm and lm_head (tied or not).
        self.weight_bytes = 2 * (sum(params.values()) - (0 if config["tie_word_embeddings"] else self.embed))

    def decode_roofline_s(self, batch: int, context: float, bandwidth: float) -> float:
        return (self.weight_bytes + batch * context * self.kv_bytes_per_token) / bandwidth

    def prefill_flops(self, batch: int, n: int) -> float:
        attention = 4 * self.layers * self.heads * self.head_dim * n * (n + 1) / 2
        return batch * (2 * self.layer_params * n + 2 * self.head + attention)


def graph_replay_s(bench: DisaggBench, batch: int, context: int) -> float:
    """The captured decode step alone (no host work): rows 0..batch-1 of the block table at `context`."""
    graphs = bench.engine.runner.graphs
    graphs.positions[:batch] = context
    graphs.rows[:batch] = torch.arange(batch, dtype=torch.int32)
    graphs.input_ids[:batch] = torch.randint(10, 1000, (batch,), dtype=torch.int32)
    return median_ms(lambda: replay_graph(bench, batch), 50) / 1e3


def matmul_floor_s(model: torch.nn.Module, batch: int) -> float:
    """Every linear layer of a decode step (layers + lm_head) at `batch` rows, captured in one
    CUDA graph: the step's time if everything but the matmuls were free."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {n: torch.randn(batch, n, dtype=torch.bfloat16, device="cuda") for n in {m.in_features for m in linears}}
    for m in linears:  # warm cuBLAS outside the capture
        m(inputs[m.in_features])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for m in linears:
            m(inputs[m.in_features])
    return median_ms(graph.replay, 50) / 1e3


def kernel_profile(bench: DisaggBench, batch: int, context: int, path: Path) -> str:
    """The GPU time of one decode-graph replay by kernel (CUPTI sees the graph's kernels)."""
    graph_replay_s(bench, batch, context)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            replay_graph(bench, batch)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    with path.open("a") as f:
        f.write(f"decode graph replay, batch {batch}, context {context}, 10 replays\n{table}\n")
    return table


def replay_graph(bench: DisaggBench, batch: int) -> None:
    graphs = bench.engine.runner.graphs
    graphs.graphs[next(size for size in graphs.buckets if size >= batch)].replay()


def host_profile(bench: DisaggBench, batch: list[list[int]], steps: int, path: Path | None) -> str:
    """Where a decode loop's wall time goes on the host (cProfile, by own time)."""
    profile = cProfile.Profile()
    profile.enable()
    bench.run(batch, steps)
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(18)
    if path:
        path.write_text(out.getvalue())
    return out.getvalue()


def prompts(vocab: int, batch: int, n: int, gen: torch.Generator) -> list[list[int]]:
    return torch.randint(10, vocab, (batch, n), generator=gen).tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--model-dir", default="/tmp/disagg-roofline-model")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--engines", default="disagg,sdpa,transformers")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, help="write a host profile of a batch-128 decode loop here")
    ap.add_argument("--kernel-profile", default=None, help="write the decode graph's kernel times here")
    args = ap.parse_args()
    engines = args.engines.split(",")
    model_dir = str(write_model(args.shape, Path(args.model_dir), Path(args.tokenizer_dir), "cuda"))
    config = read_config(model_dir)
    bandwidth, peak = hbm_read_bandwidth(), matmul_peak()
    print(f"HBM read {bandwidth / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s", flush=True)

    max_len = 32768 + 2 * args.decode_steps
    common = dict(device="cuda", dtype="bfloat16", max_batch=128, prompt_len=512, decode_tokens=args.decode_steps,
                  max_model_len=max_len, max_num_batched_tokens=8192)
    benches = {}
    start = time.perf_counter()
    benches["disagg"] = DisaggBench(model_dir, **common)
    start_s = time.perf_counter() - start
    print(f"engine start (load + graph capture) {start_s:.1f} s", flush=True)
    if "sdpa" in engines:
        benches["sdpa"] = DisaggBench(model_dir, attention_backend="sdpa", enforce_eager=True, **common)
    if "transformers" in engines:
        benches["transformers"] = TransformersBench(model_dir, "cuda", "bfloat16")
    shape = Shape(config, benches["disagg"].engine.runner.model)
    gen = torch.Generator().manual_seed(0)
    vocab = config["vocab_size"]
    for bench in benches.values():
        bench.run(prompts(vocab, 2, 64, gen), 4)

    step_s: dict[str, dict[str, list[float]]] = {name: {} for name in benches}
    prefill_s: dict[str, dict[str, list[float]]] = {name: {} for name in benches}
    for r in range(args.repeats):
        order = list(benches) if r % 2 == 0 else list(reversed(benches))
        for case, (b, n) in {**DECODE_CASES, **PREFILL_CASES}.items():
            batch = prompts(vocab, b, n, gen)
            for name in order:
                if name != "disagg" and (case not in SDPA_CASES or (name == "transformers" and case == "b1_32k")):
                    continue
                ttft, decode = benches[name].run(batch, args.decode_steps if case in DECODE_CASES else 2)
                if case in DECODE_CASES:
                    step_s[name].setdefault(case, []).append(decode / (args.decode_steps - 1))
                else:
                    prefill_s[name].setdefault(case, []).append(ttft)
                print(f"  repeat {r} {case:7s} {name:12s} ttft {ttft * 1e3:8.1f} ms  decode {decode * 1e3:8.1f} ms",
                      flush=True)
        gc.collect()

    replay = {str(b): graph_replay_s(benches["disagg"], b, n + args.decode_steps // 2)
              for b, n in (DECODE_CASES["b1"], DECODE_CASES["b32"], DECODE_CASES["b128"])}
    model = benches["disagg"].engine.runner.model
    floor = {str(b): matmul_floor_s(model, b) for b in (1, 32, 128)}
    if args.kernel_profile:
        Path(args.kernel_profile).write_text("")
        for b, n in (DECODE_CASES["b1"], DECODE_CASES["b32"]):
            print(kernel_profile(benches["disagg"], b, n + args.decode_steps // 2, Path(args.kernel_profile)))
    if args.profile:
        host_profile(benches["disagg"], prompts(vocab, 128, 512, gen), args.decode_steps, Path(args.profile))

    result = {"machine": machine_info(torch.device("cuda")), "shape": args.shape, "weight_bytes": shape.weight_bytes,
              "hbm_read_bytes_per_s": bandwidth, "matmul_flops_per_s": peak, "engine_start_s": start_s,
              "decode_step_s": {}, "prefill_s": {}, "decode_roofline_ratio": {}, "prefill_mfu": {},
              "decode_graph_replay_s": replay, "decode_matmul_floor_s": floor}
    for name in benches:
        result["decode_step_s"][name] = {c: statistics.median(v) for c, v in step_s[name].items()}
        result["prefill_s"][name] = {c: statistics.median(v) for c, v in prefill_s[name].items()}
    print(f"\n{'case':8s} {'engine':12s} {'time':>10s} {'roofline':>10s} {'ratio/MFU':>10s}")
    for case, (b, n) in DECODE_CASES.items():
        roof = shape.decode_roofline_s(b, n + args.decode_steps / 2, bandwidth)
        for name in benches:
            t = result["decode_step_s"][name].get(case)
            if t is not None:
                ratio = t / roof
                if name == "disagg":
                    key = "decode_32k_roofline_ratio" if case == "b1_32k" else None
                    if key:
                        result[key] = ratio
                    else:
                        result["decode_roofline_ratio"][str(b)] = ratio
                print(f"{case:8s} {name:12s} {t * 1e3:8.2f}ms {roof * 1e3:8.2f}ms {ratio:9.2f}x")
        if case in ("b1", "b32", "b128"):
            t = replay[str(b)]
            print(f"{case:8s} {'graph alone':12s} {t * 1e3:8.2f}ms {roof * 1e3:8.2f}ms {t / roof:9.2f}x")
            t = floor[str(b)]
            print(f"{case:8s} {'matmuls only':12s} {t * 1e3:8.2f}ms {roof * 1e3:8.2f}ms {t / roof:9.2f}x")
    for case, (b, n) in PREFILL_CASES.items():
        for name in benches:
            t = result["prefill_s"][name].get(case)
            if t is not None:
                mfu = shape.prefill_flops(b, n) / t / peak
                if name == "disagg":
                    result["prefill_mfu"][case] = mfu
                print(f"{case:8s} {name:12s} {t * 1e3:8.1f}ms {'':>10s} {mfu * 100:8.1f}%  {b * n / t:8.0f} tok/s")
    if "transformers" in benches:
        result["vs_transformers_decode_b32"] = (result["decode_step_s"]["transformers"]["b32"]
                                                / result["decode_step_s"]["disagg"]["b32"])
        print(f"decode b32: disagg {result['vs_transformers_decode_b32']:.2f}x transformers' tokens/s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
