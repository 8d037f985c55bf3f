"""What a first token costs outside the model, and the decode step, on one GPU (8B shape, bf16).

    python benchmarks/engine_overhead.py --tokenizer-dir DIR --versions base=OLD_TREE,new=. --json out.json

- `prefill_ms_512`: the engine alone (in process, no HTTP), one 512-token prompt from add_request
  to its first token (median of 9 prompts, no prefix cache).
- `ttft_ms_512`: a colocated `disagg serve` node, a streamed one-token completion of a 512-token
  prompt, from the request to its first event (median of 9, after 3 to warm up).
- `ttft_fixed_ms_512` = ttft - prefill: the HTTP, validation, tokenizer-free request path, the hop
  into the engine thread and back, and the first SSE event.
- `decode_step_ms_b32`: 32 prompts of 512 tokens decoding together, the time per step over 63
  steps (median of 3 runs).

`--versions` starts one node per code version (a tree on its PYTHONPATH), all at once, and takes
their requests in turn: the versions compare side by side on one machine. The engine phase runs
in this process, on whatever `disagg` it imports.
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import DisaggBench
from gpu_e2e import write_model
from kv_handoff import ttft_of

from disagg.launch import wait_healthy


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 32000, (length,), generator=g).tolist() for _ in range(n)]


def engine_phase(model_dir: Path) -> dict:
    bench = DisaggBench(str(model_dir), "cuda", "bfloat16", max_batch=32, prompt_len=512, decode_tokens=64)
    bench.run(random_prompts(2, 512, 1), 4)  # warm-up: kernels and graphs
    prefill = [bench.run([p], 1)[0] for p in random_prompts(9, 512, 2)]
    steps = []
    for seed in range(3):
        _, decode_s = bench.run(random_prompts(32, 512, 10 + seed), 64)
        steps.append(decode_s / 63)
    del bench
    gc.collect()
    torch.cuda.empty_cache()
    return {"prefill_ms_512": statistics.median(prefill) * 1e3, "prefill_samples_ms": [s * 1e3 for s in prefill],
            "decode_step_ms_b32": statistics.median(steps) * 1e3, "decode_step_samples_ms": [s * 1e3 for s in steps]}


def metric_sum_count(url: str, name: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith(name)}
    return values[f"{name}_sum"], values[f"{name}_count"]


def server_phase(model_dir: Path, versions: dict[str, str], log_dir: Path, repeats: int) -> dict:
    """One colocated node per code version (its PYTHONPATH), all up at once on the GPU, their requests
    taken in turn, so that every version sees the same machine state."""
    procs, urls = {}, {}
    for i, (label, path) in enumerate(versions.items()):
        port = 18123 + i
        argv = [sys.executable, "-m", "disagg.cli", "serve", str(model_dir), "--device", "cuda", "--dtype", "bfloat16",
                "--port", str(port), "--kv-cache-memory", "16GiB", "--max-model-len", "4096", "--log-level", "WARNING"]
        env = {**os.environ, "PYTHONPATH": path}
        procs[label] = subprocess.Popen(argv, stdout=(log_dir / f"server_{label}.log").open("w"),
                                        stderr=subprocess.STDOUT, env=env)
        urls[label] = f"http://127.0.0.1:{port}"
    try:
        for label, url in urls.items():
            wait_healthy(url, procs[label], 300)  # a node that exits says why in its log in log_dir
        for url in urls.values():
            for prompt in random_prompts(3, 512, 3):
                ttft_of(url, prompt)
        before = {label: metric_sum_count(url, "disagg_time_to_first_token_seconds") for label, url in urls.items()}
        ttft: dict[str, list[float]] = {label: [] for label in urls}
        for prompt in random_prompts(repeats, 512, 4):
            for label, url in urls.items():
                ttft[label].append(ttft_of(url, prompt))
        out = {}
        for label, url in urls.items():
            total, count = metric_sum_count(url, "disagg_time_to_first_token_seconds")
            server_mean = (total - before[label][0]) / (count - before[label][1])
            out[label] = {"ttft_ms_512": statistics.median(ttft[label]) * 1e3,
                          "ttft_mean_ms_512": statistics.mean(ttft[label]) * 1e3,
                          "server_ttft_mean_ms_512": server_mean * 1e3,  # the API's own: request parsed -> first token
                          "ttft_samples_ms": [s * 1e3 for s in ttft[label]]}
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=60)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--model-dir", default="/tmp/disagg-overhead-8b")
    ap.add_argument("--versions", required=True,
                    help="LABEL=PYTHONPATH[,LABEL=PYTHONPATH...]: the code versions compared; the engine phase "
                         "runs in this process, so give it the PYTHONPATH of the first")
    ap.add_argument("--phases", default="engine,server", help="engine and/or server")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    versions = dict(v.split("=", 1) for v in args.versions.split(","))
    model_dir = write_model("8b", Path(args.model_dir), Path(args.tokenizer_dir), "cuda")
    result: dict = {"gpu": torch.cuda.get_device_name(), "versions": versions}
    if "engine" in args.phases:
        result["engine"] = engine_phase(model_dir)
        print(f"engine ({next(iter(versions))}): prefill {result['engine']['prefill_ms_512']:.2f} ms, decode step "
              f"b32 {result['engine']['decode_step_ms_b32']:.2f} ms", flush=True)
    if "server" in args.phases:
        result["server"] = server_phase(model_dir, versions, Path(args.json).parent, args.repeats)
        for label, r in result["server"].items():
            print(f"{label}: TTFT median {r['ttft_ms_512']:.2f} ms, mean {r['ttft_mean_ms_512']:.2f}, "
                  f"server-side mean {r['server_ttft_mean_ms_512']:.2f}", flush=True)
    Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
