"""Decode steps after a batch's prompts, by how many steps since: is a decode sample taken soon after the prompts
(`disagg plan profile`'s: DECODE_WARMUP steps after them) what a long generation's steps take?

    python benchmarks/decode_warmup.py --tokenizer-dir DIR [--batches 1,8,16,32] [--steps 400] [--repeats 2]
        [--kv-cache-memory-gib 48 --max-num-batched-tokens 8192 --max-model-len 8300 --enable-prefix-caching]

gpu_e2e.py's random-weight 8B shape on one GPU (bfloat16, --async-scheduling, the profile's engine flags):
for each batch, that many prompts of 1,024 tokens, then --steps decode steps timed one by one; prints the
median step of each window of steps since the prompts (their context grows a token a step)."""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_e2e import write_model

from disagg.engine.config import EngineConfig
from disagg.engine.engine import LLMEngine
from disagg.engine.sampling_params import SamplingParams

WINDOWS = ((2, 18), (18, 50), (50, 100), (100, 200), (200, 400))  # [start, end) steps after the prompts
PROMPT = 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer-dir", required=True, help="a tokenizer.json's directory")
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--work", default="/tmp/decode_warmup")
    # The engine's sizes: the profile's by default; a served node's differ (24GiB, 2048, 8192, prefix caching)
    ap.add_argument("--kv-cache-memory-gib", type=int, default=48)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=8300)
    ap.add_argument("--enable-prefix-caching", action="store_true")
    args = ap.parse_args()
    model = write_model("8b", Path(args.work) / "llama-8b", Path(args.tokenizer_dir), "cuda")
    engine = LLMEngine(EngineConfig(model=str(model), device="cuda", dtype="bfloat16",
                                    enable_prefix_caching=args.enable_prefix_caching, max_num_seqs=64,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    max_model_len=args.max_model_len,
                                    kv_cache_memory=args.kv_cache_memory_gib << 30, async_scheduling=True))
    rng = random.Random(0)
    for rep in range(args.repeats):
        for b in (int(x) for x in args.batches.split(",")):
            params = SamplingParams(temperature=0.0, max_tokens=args.steps + 20, ignore_eos=True)
            ids = [f"r{rep}-{b}-{i}" for i in range(b)]
            for request_id in ids:
                engine.add_request(request_id, [rng.randrange(1000, 49000) for _ in range(PROMPT)], params)
            started: set[str] = set()
            while len(started) < b:  # the prompts, in as many steps as the budget needs
                started |= {out.request_id for out in engine.step()}
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                times.append(1e3 * (time.perf_counter() - start))
            for request_id in ids:
                engine.abort_request(request_id)
            medians = "  ".join(f"{a}-{z} {statistics.median(times[a:z]):.3f}" for a, z in WINDOWS if z <= len(times))
            print(f"repeat {rep} batch {b}: median ms of steps {medians}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
