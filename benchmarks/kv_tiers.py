"""KV tiers on a GPU: returning multi-turn conversations with tiers on vs off, in one run.

    python benchmarks/kv_tiers.py --shape 8b --device cuda --device-pool-gib 12 --host-gib 56 \\
        --disk-gib 20 --tokenizer-dir DIR --out benchmarks/results/kv_tiers_h200.json
    python benchmarks/kv_tiers.py --shape tiny --device cpu --out /tmp/kv_tiers.json   # tries it

The model is gpu_e2e.py's: the 8B (or tiny) Llama shape with random weights, bfloat16 on CUDA.
`--conversations` prefixes of `--prefix-tokens` random token ids (48 x 8,192 tokens of the 8B shape
are 48 GiB of KV) are prefilled once (turn 1): more than the device pool holds, so a conversation
that returns (its prefix + a new question) finds its prefix evicted from the device cache. Each
engine runs alone on the device, one after the other:

- `off`: no tiers; a returning turn computes its whole prefix again.
- `on`: host tier (`--host-gib`, pinned) and disk tier (`--disk-gib` under `--disk-path`); a returning
  turn loads its prefix from the host tier. Then a fresh engine on the same directory (empty host
  tier) serves the last `--disk-conversations` returning turns from disk.

Reported (JSON at `--out`):
- `ttft_ratio_host`, `ttft_ratio_disk`: TTFT p50 of returning turns (one at a time), tiers / off.
- `load_bw_ratio`: bytes of one conversation's prefix loaded host -> device by the tier (lookup to
  last block arrived) over time, against a plain pinned `copy_` of the same bytes in this run.
- `decode_slowdown`: decode tokens/s of `--decode-batch` running requests while new prefixes are
  prefilled beside them, off / on - 1 (the cost of eager offload to a concurrent decode batch).
"""

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_e2e import write_model

from disagg.engine.config import EngineConfig
from disagg.engine.engine import LLMEngine
from disagg.engine.loader import resolve_model
from disagg.engine.sampling_params import SamplingParams

# Defaults per shape: conversations, prefix tokens, device pool / host / disk GiB.
PRESETS = {"8b": dict(conversations=48, prefix_tokens=8192, device_pool_gib=12.0, host_gib=56.0, disk_gib=20.0,
                      returning=16, disk_conversations=12, decode_batch=32, dtype="bfloat16"),
           "tiny": dict(conversations=8, prefix_tokens=512, device_pool_gib=0.001, host_gib=0.01, disk_gib=0.01,
                        returning=6, disk_conversations=4, decode_batch=4, dtype="float32")}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def run_until_done(engine: LLMEngine, ids: list[str]) -> None:
    left = set(ids)
    while left:
        left -= {o.request_id for o in engine.step() if o.finished}


def prefill_all(engine: LLMEngine, prompts: list[list[int]], tag: str) -> None:
    """Turn 1 of every conversation: one token each, all queued at once."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    run_until_done(engine, ids)


def ttft(engine: LLMEngine, prompt: list[int], request_id: str, device: str) -> float:
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    run_until_done(engine, [request_id])
    sync(device)
    return time.perf_counter() - start


def evict_device_cache(engine: LLMEngine) -> None:
    """Every free block taken and given back: no prefix is left in the device cache, whatever the
    shape (a returning turn must find its prefix below the device, or nowhere)."""
    bm = engine.block_manager
    for block_id in [bm.take_free() for _ in range(bm.num_free_blocks)]:
        bm.release(block_id)


def returning_ttfts(engine: LLMEngine, turns: list[list[int]], tag: str, device: str) -> list[float]:
    evict_device_cache(engine)
    return [ttft(engine, turn, f"{tag}-{i}", device) for i, turn in enumerate(turns)]


def tier_load_bandwidth(engine: LLMEngine, prompt: list[int], device: str, repeats: int = 3) -> tuple[float, int]:
    """Bytes/s of one prefix loaded host -> device, lookup to the last block arrived (median)."""
    offload, rates = engine.offload, []
    for _ in range(repeats):
        evict_device_cache(engine)
        engine.add_request("bw", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        sync(device)
        start = time.perf_counter()
        offload.start_loads()
        while "bw" in engine.scheduler.loading:
            offload.poll()
        seconds = time.perf_counter() - start
        loaded = engine.requests["bw"].seq.num_cached_tokens // engine.config.block_size * offload.host.block_bytes
        engine.abort_request("bw")
        offload.drain()
        assert loaded > 0, "the prefix was not in the host tier"
        rates.append(loaded / seconds)
    return statistics.median(rates), loaded


def plain_copy_bandwidth(nbytes: int, device: str, repeats: int = 5) -> float:
    """Bytes/s of one pinned host -> device copy_ of nbytes (median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # warm-up
    rates = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        rates.append(nbytes / (time.perf_counter() - start))
    return statistics.median(rates)


def decode_tps(engine: LLMEngine, rng: random.Random, batch: int, new_prefixes: list[list[int]], tag: str) -> float:
    """Decode tokens/s of `batch` running requests while `new_prefixes` are prefilled beside them."""
    params = SamplingParams(temperature=0.0, max_tokens=129, ignore_eos=True)
    ids = [f"{tag}-dec-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, random_ids(rng, 64), params)
    while any(not engine.requests[i].seq.output_token_ids for i in ids):  # prompts in: decoding from here
        engine.step()
    for i, prefix in enumerate(new_prefixes):
        engine.add_request(f"{tag}-new-{i}", prefix, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    start, tokens, left = time.perf_counter(), 0, set(ids)
    while left:
        for out in engine.step():
            if out.request_id in left:
                tokens += len(out.new_token_ids)
                if out.finished:
                    left.discard(out.request_id)
    return tokens / (time.perf_counter() - start)


def make_engine(args, model_dir: Path, **tiers) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device=args.device, dtype=args.dtype,
                                  kv_cache_memory=int(args.device_pool_gib * 2**30),
                                  max_model_len=args.prefix_tokens + 256, **tiers))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(PRESETS), default="8b")
    ap.add_argument("--device", default="cuda")
    for name, value in PRESETS["8b"].items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None,
                        help=f"default {value} (8b), {PRESETS['tiny'][name]} (tiny)")
    ap.add_argument("--model-dir", default=None, help="where the random-weight model is written (kept)")
    ap.add_argument("--tokenizer-dir", default=None, help="a directory with tokenizer.json (default: the embedded model's)")
    ap.add_argument("--disk-path", default=None, help="disk tier directory (default: a temporary one)")
    ap.add_argument("--out", required=True, help="JSON results")
    args = ap.parse_args()
    for name, value in PRESETS[args.shape].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny shapes: threads only wait on each other (and on other processes)
    model_dir = Path(args.model_dir or Path(tempfile.gettempdir()) / f"disagg-kv-tiers-{args.shape}")
    tokenizer_dir = Path(args.tokenizer_dir) if args.tokenizer_dir else resolve_model(None)
    write_model(args.shape, model_dir, tokenizer_dir, args.device)
    rng = random.Random(0)
    prefixes = [random_ids(rng, args.prefix_tokens) for _ in range(args.conversations)]
    returning = [p + random_ids(rng, 32) for p in prefixes[:args.returning]]
    disk_turns = [p + random_ids(rng, 32) for p in prefixes[-args.disk_conversations:]]
    fresh = [random_ids(rng, args.prefix_tokens) for _ in range(4)]
    fresh_warm = [random_ids(rng, args.prefix_tokens) for _ in range(4)]  # the mixed steps' kernels compiled
    warm = [random_ids(rng, args.prefix_tokens)]
    results = {"args": vars(args)}

    off = make_engine(args, model_dir)
    prefill_all(off, warm, "warm")  # kernels compiled before anything is timed
    prefill_all(off, prefixes, "t1")
    off_ttft = returning_ttfts(off, returning, "ret", args.device)
    decode_tps(off, rng, args.decode_batch, fresh_warm, "off-warm")
    off_tps = decode_tps(off, rng, args.decode_batch, fresh, "off")
    del off
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    disk_path = args.disk_path or tempfile.mkdtemp(prefix="disagg-kv-disk-")
    tiers = dict(kv_offloading_size=args.host_gib, kv_disk_path=disk_path, kv_disk_size=args.disk_gib)
    on = make_engine(args, model_dir, **tiers)
    prefill_all(on, warm, "warm")
    prefill_all(on, prefixes, "t1")
    on.offload.drain()
    host_ttft = returning_ttfts(on, returning, "ret", args.device)
    tier_bw, nbytes = tier_load_bandwidth(on, prefixes[0] + [1], args.device)
    plain_bw = plain_copy_bandwidth(nbytes, args.device)
    decode_tps(on, rng, args.decode_batch, fresh_warm, "on-warm")
    on_tps = decode_tps(on, rng, args.decode_batch, fresh, "on")
    on.close()
    del on
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    restarted = make_engine(args, model_dir, **tiers)  # an empty host tier: prefixes come from disk
    prefill_all(restarted, warm, "warm")
    disk_ttft = returning_ttfts(restarted, disk_turns, "disk", args.device)
    disk_hits = restarted.offload.disk.stats.hits
    restarted.close()

    off_p50 = statistics.median(off_ttft)
    results.update({
        "ttft_off_p50_s": off_p50, "ttft_host_p50_s": statistics.median(host_ttft),
        "ttft_disk_p50_s": statistics.median(disk_ttft),
        "ttft_ratio_host": statistics.median(host_ttft) / off_p50,
        "ttft_ratio_disk": statistics.median(disk_ttft) / off_p50,
        "tier_load_gb_s": tier_bw / 1e9, "plain_copy_gb_s": plain_bw / 1e9, "load_bw_ratio": tier_bw / plain_bw,
        "load_bytes": nbytes, "disk_block_hits": disk_hits,
        "decode_tok_s_off": off_tps, "decode_tok_s_on": on_tps, "decode_slowdown": off_tps / on_tps - 1,
    })
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    for key in ("ttft_ratio_host", "ttft_ratio_disk", "load_bw_ratio", "decode_slowdown"):
        print(f"{key}: {results[key]:.3f}")


if __name__ == "__main__":
    main()
