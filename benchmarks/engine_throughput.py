"""Engine throughput: prefill and decode tokens/s of disagg's engine and of transformers' generate().

    python benchmarks/engine_throughput.py [--batch-sizes 1,8,32] [--prompt-len 128]
        [--decode-tokens 32] [--repeats 3] [--threads N] [--device cpu|cuda]
        [--dtype float32|bfloat16] [--model DIR_OR_GGUF] [--json PATH]

Same model (default: the embedded SmolLM2-135M-Instruct), same device, dtype and thread
count, in one process. Each repeat draws B fresh prompts of `--prompt-len` random token ids
and runs both engines on them, one after the other (the order alternates between repeats);
the reported number is the median over repeats.

- prefill tok/s = B * prompt_len / TTFT, where TTFT is the time from handing the batch to the
  engine until every one of the B sequences has its first token (the whole batch is one
  prefill step: max_num_batched_tokens is raised to B * prompt_len).
- decode tok/s = B * (N - 1) / (time from that point until the N-th token of every sequence),
  each sequence generating exactly N = `--decode-tokens` tokens (ignore_eos for disagg,
  min_new_tokens = max_new_tokens for transformers). Both are greedy.

disagg is driven through `llm.engine.add_request` / `step()`; transformers' step times come
from a logits processor that stamps the clock each time generate() has a new row of logits
(the first stamp ends the prefill forward).

`matmuls` (in --engines by default) times only the matrix products of the same passes:
every nn.Linear of the model on random inputs of the batch's shape, lm_head on one row a
sequence. Both engines run exactly these products with the same torch kernels, so
transformers' time over this floor bounds how far any engine change can beat it at equal
dtype.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import torch

from disagg import LLM, SamplingParams
from disagg.engine.loader import resolve_model

ENGINES = ("disagg", "transformers", "matmuls")


@dataclass
class Run:
    engine: str
    batch: int
    ttft_s: float
    decode_s: float
    prefill_tps: float
    decode_tps: float
    load_before: float  # 1-minute load average when the run started


@dataclass
class Row:
    engine: str
    batch: int
    prefill_tps: float  # median over repeats
    decode_tps: float
    ttft_s: float
    decode_s: float
    runs: list[Run]


def read_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DisaggBench:
    def __init__(self, model_dir: str, device: str, dtype: str, max_batch: int, prompt_len: int,
                 decode_tokens: int, **llm_kwargs):
        """llm_kwargs: more LLM(...) arguments (enforce_eager, attention_backend, max_model_len, ...)."""
        mc = read_config(model_dir)
        block_size = 16
        blocks_per_seq = (prompt_len + decode_tokens) // block_size + 2
        block_bytes = (mc["num_hidden_layers"] * 2 * block_size * mc["num_key_value_heads"]
                       * (mc.get("head_dim") or mc["hidden_size"] // mc["num_attention_heads"])
                       * torch.empty((), dtype=getattr(torch, dtype)).element_size())
        llm_kwargs.setdefault("max_num_batched_tokens", max(2048, max_batch * prompt_len))
        self.llm = LLM(model=model_dir, device=device, dtype=dtype, block_size=block_size,
                       max_num_seqs=max_batch, kv_cache_memory=(max_batch * blocks_per_seq + 4) * block_bytes,
                       enable_prefix_caching=False, **llm_kwargs)
        self.engine = self.llm.engine
        self.device = self.engine.device
        self._ids = 0

    def run(self, prompts: list[list[int]], decode_tokens: int) -> tuple[float, float]:
        """(TTFT of the whole batch, decode time of the remaining decode_tokens - 1 tokens)."""
        params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
        engine = self.engine
        ids = []
        sync(self.device)
        t0 = time.perf_counter()
        for prompt in prompts:
            self._ids += 1
            ids.append(f"bench-{self._ids}")
            engine.add_request(ids[-1], prompt, params)
        started: set[str] = set()
        t_first = None
        finished = 0
        while finished < len(ids):
            for out in engine.step():
                started.add(out.request_id)
                finished += out.finished
                if len(out.token_ids) > decode_tokens or (out.finished and len(out.token_ids) != decode_tokens):
                    raise RuntimeError(f"{out.request_id} generated {len(out.token_ids)} tokens, "
                                       f"expected {decode_tokens}")
            if t_first is None and len(started) == len(ids):
                t_first = time.perf_counter()
        t_end = time.perf_counter()
        return t_first - t0, t_end - t_first


class _Stamp:
    """A logits processor that records when each new row of logits exists."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores


class TransformersBench:
    def __init__(self, model_dir: str, device: str, dtype: str):
        from transformers import AutoModelForCausalLM
        torch_dtype = getattr(torch, dtype)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
        except TypeError:  # transformers < 4.56 calls it torch_dtype
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch_dtype)
        self.device = torch.device(device)
        self.model.to(self.device).eval()
        self.pad = self.model.config.eos_token_id
        if isinstance(self.pad, list):
            self.pad = self.pad[0]

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], decode_tokens: int) -> tuple[float, float]:
        from transformers import LogitsProcessorList
        input_ids = torch.tensor(prompts, dtype=torch.int64, device=self.device)
        stamp = _Stamp(self.device)
        sync(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=decode_tokens,
            min_new_tokens=decode_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
            pad_token_id=self.pad, logits_processor=LogitsProcessorList([stamp]))
        sync(self.device)
        if out.shape[1] != input_ids.shape[1] + decode_tokens or len(stamp.times) != decode_tokens:
            raise RuntimeError(f"transformers generated {out.shape[1] - input_ids.shape[1]} tokens "
                               f"({len(stamp.times)} steps), expected {decode_tokens}")
        return stamp.times[0] - t0, stamp.times[-1] - stamp.times[0]


class MatmulFloorBench:
    """Only the matrix products of the same forward passes (every nn.Linear of the model,
    lm_head on the last row of each prompt), on random inputs: a floor under both engines'
    time, since both run exactly these float products with the same torch kernels."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self.body = [m.weight for m in linears if m is not model.lm_head]
        self.head = model.lm_head.weight
        self.device = device

    def _inputs(self, rows: int, last_rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input, weight) for every product of one pass; random inputs, made before the clock starts."""
        made: dict[tuple[int, int], torch.Tensor] = {}
        pairs = []
        for w in [*self.body, self.head]:
            shape = (last_rows if w is self.head else rows, w.shape[1])
            if shape not in made:
                made[shape] = torch.randn(shape, dtype=w.dtype, device=self.device)
            pairs.append((made[shape], w))
        return pairs

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], decode_tokens: int) -> tuple[float, float]:
        b = len(prompts)
        prefill, decode = self._inputs(sum(len(p) for p in prompts), b), self._inputs(b, b)
        sync(self.device)
        t0 = time.perf_counter()
        for x, w in prefill:
            torch.nn.functional.linear(x, w)
        sync(self.device)
        t1 = time.perf_counter()
        for _ in range(decode_tokens - 1):
            for x, w in decode:
                torch.nn.functional.linear(x, w)
        sync(self.device)
        return t1 - t0, time.perf_counter() - t1


def machine_info(device: torch.device) -> dict:
    info = {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,8,32")
    # Defaults keep a 2-core CPU run near 6 minutes; on a GPU use --prompt-len 256 --decode-tokens 64.
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded SmolLM2-135M)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every run and the medians here")
    args = ap.parse_args(argv)
    if args.decode_tokens < 2:
        ap.error("--decode-tokens must be at least 2 (decode time is measured after the first token)")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engines = [e for e in args.engines.split(",") if e]
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model_dir = str(resolve_model(args.model))
    info = machine_info(device)
    print(f"# {info['date_utc']}  device={args.device} dtype={args.dtype} threads={info['torch_threads']} "
          f"cpus={info['cpu_count']} load={os.getloadavg()[0]:.2f}  model={model_dir}", flush=True)

    benches = {}
    if "disagg" in engines:
        benches["disagg"] = DisaggBench(model_dir, args.device, args.dtype, max(batches), args.prompt_len,
                                        args.decode_tokens)
    if "transformers" in engines:
        benches["transformers"] = TransformersBench(model_dir, args.device, args.dtype)
    if "matmuls" in engines:
        if "disagg" not in benches:
            ap.error("--engines matmuls needs disagg too (it borrows its weights)")
        benches["matmuls"] = MatmulFloorBench(benches["disagg"].engine.runner.model, benches["disagg"].device)
    vocab = read_config(model_dir)["vocab_size"]
    gen = torch.Generator().manual_seed(args.seed)

    def prompts(b: int, n: int) -> list[list[int]]:
        # Ids from 10 on: skip the special tokens at the start of the vocabulary.
        return torch.randint(10, vocab, (b, n), generator=gen).tolist()

    for bench in benches.values():  # warm-up: allocator, kernels, lazy imports
        bench.run(prompts(2, 32), 4)

    runs: list[Run] = []
    for r in range(args.repeats):
        for b in batches:
            batch = prompts(b, args.prompt_len)
            order = list(benches) if r % 2 == 0 else list(reversed(benches))
            for name in order:
                load = os.getloadavg()[0]
                ttft, dec = benches[name].run(batch, args.decode_tokens)
                run = Run(name, b, ttft, dec, b * args.prompt_len / ttft, b * (args.decode_tokens - 1) / dec, load)
                runs.append(run)
                print(f"  repeat {r} batch {b:3d} {name:12s} ttft {ttft:7.3f}s prefill {run.prefill_tps:9.1f} tok/s"
                      f"  decode {dec:7.3f}s {run.decode_tps:8.1f} tok/s  load {load:.2f}", flush=True)

    rows: list[Row] = []
    for b in batches:
        for name in benches:
            mine = [x for x in runs if x.engine == name and x.batch == b]
            rows.append(Row(name, b, statistics.median(x.prefill_tps for x in mine),
                            statistics.median(x.decode_tps for x in mine),
                            statistics.median(x.ttft_s for x in mine),
                            statistics.median(x.decode_s for x in mine), mine))
    info["load_after"] = os.getloadavg()[0]

    print(f"\nprompt {args.prompt_len} tokens, {args.decode_tokens} generated, {args.repeats} repeats (median), "
          f"{args.device} {args.dtype}, torch threads {info['torch_threads']}, load after {info['load_after']:.2f}")
    print(f"{'batch':>5}  {'engine':12s} {'prefill tok/s':>14} {'decode tok/s':>13}  {'disagg/transformers':>20}")
    for b in batches:
        by = {row.engine: row for row in rows if row.batch == b}
        for name, row in by.items():
            ratio = ""
            if name != "transformers" and "transformers" in by:
                hf = by["transformers"]
                ratio = f"prefill {row.prefill_tps / hf.prefill_tps:.2f}x decode {row.decode_tps / hf.decode_tps:.2f}x"
            print(f"{b:>5}  {name:12s} {row.prefill_tps:14.1f} {row.decode_tps:13.1f}  {ratio}")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": info, "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
