"""What a first token costs outside the model, and the decode step, on one GPU (8B shape, bf16).

    python benchmarks/engine_overhead.py --tokenizer-dir DIR --label NAME --json out.json

- `prefill_ms_512`: the engine alone (in process, no HTTP), one 512-token prompt from add_request
  to its first token (median of 9 prompts, no prefix cache).
- `ttft_ms_512`: a colocated `disagg serve` node, a streamed one-token completion of a 512-token
  prompt, from the request to its first event (median of 9, after 3 to warm up).
- `ttft_fixed_ms_512` = ttft - prefill: the HTTP, validation, tokenizer-free request path, the hop
  into the engine thread and back, and the first SSE event.
- `decode_step_ms_b32`: 32 prompts of 512 tokens decoding together, the time per step over 63
  steps (median of 3 runs).

Run it once per code version with PYTHONPATH naming that version's tree, in one call, so that the
numbers compare on one machine.
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import DisaggBench
from gpu_e2e import write_model
from kv_handoff import ttft_of


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


def server_phase(model_dir: Path, log: Path) -> dict:
    port = 18123
    argv = [sys.executable, "-m", "disagg.cli", "serve", str(model_dir), "--device", "cuda", "--dtype", "bfloat16",
            "--port", str(port), "--kv-cache-memory", "16GiB", "--max-model-len", "4096", "--log-level", "WARNING"]
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the node exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the node did not start")
            time.sleep(1)
        for prompt in random_prompts(3, 512, 3):
            ttft_of(url, prompt)
        ttft = [ttft_of(url, prompt) for prompt in random_prompts(9, 512, 4)]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"ttft_ms_512": statistics.median(ttft) * 1e3, "ttft_samples_ms": [s * 1e3 for s in ttft]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--model-dir", default="/tmp/disagg-overhead-8b")
    ap.add_argument("--label", required=True, help="names this code version in the JSON")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    model_dir = write_model("8b", Path(args.model_dir), Path(args.tokenizer_dir), "cuda")
    result = engine_phase(model_dir) | server_phase(model_dir, Path(args.json).with_suffix(".log"))
    result["ttft_fixed_ms_512"] = result["ttft_ms_512"] - result["prefill_ms_512"]
    result["gpu"] = torch.cuda.get_device_name()
    print(f"[{args.label}] prefill {result['prefill_ms_512']:.1f} ms, TTFT {result['ttft_ms_512']:.1f} ms, "
          f"fixed {result['ttft_fixed_ms_512']:.1f} ms, decode step b32 {result['decode_step_ms_b32']:.2f} ms",
          flush=True)
    Path(args.json).write_text(json.dumps({args.label: result}, indent=1))


if __name__ == "__main__":
    main()
