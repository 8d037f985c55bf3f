"""KV tiers on a GPU: returning multi-turn conversations with tiers on vs off, in one run.

    python benchmarks/kv_tiers.py --shape 8b --device cuda --device-pool-gib 12 --host-gib 56 \\
        --disk-gib 20 --tokenizer-dir DIR --out benchmarks/results/kv_tiers_h200.json
    python benchmarks/kv_tiers.py --shape tiny --device cpu --out /tmp/kv_tiers.json   # tries it

The model is gpu_e2e.py's: the 8B (or tiny) Llama shape with random weights, bfloat16 on CUDA,
written once to `--model-dir` and reused from there. `--conversations` prefixes of
`--prefix-tokens` random token ids (48 x 8,192 tokens of the 8B shape are 48 GiB of KV) are
prefilled once (turn 1) with tiers on: more than the device pool holds, so a conversation that
returns (its prefix + a new question) finds its prefix evicted from the device cache (and the
benchmark empties the device cache before returning turns, whatever the shape). Each engine runs
alone on the device, one after the other, in this order:

- `on`: host tier (`--host-gib`, pinned) and, if phase `disk` is asked, disk tier (`--disk-gib`
  under `--disk-path`); turn 1, then phases `load_bw`, `host` (returning turns load their prefix
  from the host tier), `decode`.
- `off`: no tiers; phases `off` (a returning turn computes its whole prefix again: turn 1 would be
  evicted anyway, so it is not run) and `decode`.
- `disk`: a fresh engine on the same disk directory (empty host tier) serves the last
  `--disk-conversations` returning turns from disk (phase `disk`).

`--phases` runs a subset (turn 1 runs for all conversations only if `host` or `disk` is asked;
`load_bw` alone prefills one). Every step prints a progress line with the seconds since the start,
and the JSON at `--out` is rewritten after each, so a run cut off keeps what it measured.

Reported (JSON at `--out`; ratios appear once both sides are measured):
- `ttft_ratio_host`, `ttft_ratio_disk`: TTFT p50 of returning turns (one at a time), tiers / off.
- `load_bw_ratio`: bytes of one conversation's prefix loaded host -> device by the tier (lookup to
  last block arrived) over time, against a plain pinned `copy_` of the same size in this run
  (`plain_copy_gb_s`). Where a gap lies: `host_tier_copy_gb_s` copies the prefix's own host-tier
  bytes to one device buffer (the tier's memory, no scatter into blocks); `copy_blocks_gb_s` is the
  tier's copy_blocks alone in load-sized copies (staging copies and scatter, without lookup,
  bookkeeping or polling).
- `decode_slowdown`: decode tokens/s of `--decode-batch` running requests while new prefixes are
  prefilled beside them, off / on - 1 (the cost of eager offload to a concurrent decode batch).
- `seconds`: how long each step took; `steps_done`: the steps finished, in order.

Cost of the 8B defaults on one H200, estimated from the code and the last full run's numbers
(`seconds` in the JSON has the real ones):
- model: writing the 15 GB random model ~25 s (randn on the GPU, copied out, serialized, written);
  none when `--model-dir` holds it.
- engine starts (3: on, off, disk): ~10-20 s each for the weights; the first warm-up also compiles
  the Triton kernels; `on` and `disk` pin a 56 GiB host tier (torch's pinned allocator rounds it
  up to 64 GiB; `disk` reuses the cached one).
- on: turn 1, 48 x 8,192 = 393k prompt tokens in 2,048-token steps of ~60 ms: ~13 s. Then the
  disk writes of every host block (48 GiB: one writer thread, CRC-32 and a 2 MiB file a block,
  ~1-2 GB/s, slower once the disk's writeback is the limit) finish: ~25 s past turn 1, or more.
- load_bw ~1 s; returning turns 8 x 0.26 s off, 8 x 0.05 s host, 6 x 0.3 s disk; decode ~3 s a
  measurement (32 x 128 tokens beside 4 x 8k prefixes), 4 with warm-ups.
About 150-200 s in all, most of it fixed costs; without `disk`, no disk writes are waited for.
"""

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_e2e import write_model

from disagg.engine.config import EngineConfig
from disagg.engine.engine import LLMEngine
from disagg.engine.kv_tiers.offload import LOAD_COPY_BYTES, copy_blocks, slot_runs
from disagg.engine.loader import resolve_model
from disagg.engine.sampling_params import SamplingParams

# Defaults per shape: conversations, prefix tokens, device pool / host / disk GiB.
PRESETS = {"8b": dict(conversations=48, prefix_tokens=8192, device_pool_gib=12.0, host_gib=56.0, disk_gib=20.0,
                      returning=8, disk_conversations=6, decode_batch=32, dtype="bfloat16"),
           "tiny": dict(conversations=8, prefix_tokens=512, device_pool_gib=0.001, host_gib=0.01, disk_gib=0.01,
                        returning=6, disk_conversations=4, decode_batch=4, dtype="float32")}
PHASES = ("load_bw", "host", "decode", "off", "disk")


class Results:
    """What is measured so far: one progress line as each step starts and ends, and the JSON
    rewritten after each step (atomically: a run killed while writing keeps the previous one)."""

    def __init__(self, out: Path, args: argparse.Namespace):
        self.out = out
        self.start = time.perf_counter()
        self.data: dict = {"args": vars(args), "steps_done": [], "seconds": {}}

    def log(self, line: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f} s] {line}", flush=True)

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        self.log(f"{name} ...")
        start = time.perf_counter()
        try:
            yield
        except BaseException as e:
            self.data["failed_step"] = f"{name}: {type(e).__name__}: {e}"
            self.save()
            raise
        seconds = time.perf_counter() - start
        self.data["seconds"][name] = round(seconds, 3)
        self.data["steps_done"].append(name)
        self.save()
        self.log(f"{name} done in {seconds:.1f} s")

    def save(self) -> None:
        d = self.data
        if "ttft_off_p50_s" in d:
            for tier in ("host", "disk"):
                if f"ttft_{tier}_p50_s" in d:
                    d[f"ttft_ratio_{tier}"] = d[f"ttft_{tier}_p50_s"] / d["ttft_off_p50_s"]
        if "decode_tok_s_off" in d and "decode_tok_s_on" in d:
            d["decode_slowdown"] = d["decode_tok_s_off"] / d["decode_tok_s_on"] - 1
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text(json.dumps(d, indent=1))
        tmp.replace(self.out)


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


def tier_load_bandwidth(engine: LLMEngine, prompt: list[int], device: str,
                        repeats: int = 3) -> tuple[float, int, list[int]]:
    """Bytes/s of one prefix loaded host -> device, lookup to the last block arrived (median); the
    bytes, and the host slots the prefix's blocks are in."""
    offload, rates = engine.offload, []
    for _ in range(repeats):
        evict_device_cache(engine)
        seq = engine.add_request("bw", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        sync(device)
        start = time.perf_counter()
        assert engine.scheduler.admit(seq)  # its blocks, and the tiers start loading its prefix
        while offload.pending(seq):
            offload.poll()
        seconds = time.perf_counter() - start
        num_blocks = seq.num_cached_tokens // engine.config.block_size
        slots = [offload.host.blocks[h].slot for h, _ in seq.block_keys[:num_blocks]]
        engine.abort_request("bw")
        offload.drain()
        assert num_blocks > 0, "the prefix was not in the host tier"
        rates.append(num_blocks * offload.host.block_bytes / seconds)
    return statistics.median(rates), num_blocks * offload.host.block_bytes, slots


def timed_rate(copy: Callable[[], None], nbytes: int, device: str, repeats: int = 5) -> float:
    """Bytes/s of `copy` (median), after one untimed call."""
    copy()
    rates = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        copy()
        sync(device)
        rates.append(nbytes / (time.perf_counter() - start))
    return statistics.median(rates)


def plain_copy_bandwidth(nbytes: int, device: str) -> float:
    """One pinned host -> device copy_ of nbytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return timed_rate(lambda: dst.copy_(src, non_blocking=True), nbytes, device)


def host_tier_copy_bandwidth(engine: LLMEngine, slots: list[int], device: str) -> float:
    """The prefix's own host-tier bytes copied to one contiguous device buffer (a copy_ per run of
    consecutive slots): the tier's memory, without the scatter into device blocks."""
    host = engine.offload.host
    dst = torch.empty((len(slots), *host.kv.shape[1:]), dtype=host.kv.dtype, device=device)

    def copy() -> None:
        for i, j, slot in slot_runs(slots):
            dst[i:j].copy_(host.kv[slot:slot + j - i], non_blocking=True)

    return timed_rate(copy, len(slots) * host.block_bytes, device)


def copy_blocks_bandwidth(engine: LLMEngine, slots: list[int], device: str) -> float:
    """The tier's copy_blocks alone, host slots -> free device blocks in copies of a load's size, on
    the tier's copy stream: no lookup, bookkeeping or polling."""
    offload, bm = engine.offload, engine.block_manager
    blocks = [bm.take_free() for _ in slots]  # taken out of the prefix cache, so free to overwrite
    per_copy = max(1, LOAD_COPY_BYTES // offload.host.block_bytes)

    def copy() -> None:
        with torch.cuda.stream(offload.stream) if offload.stream is not None else nullcontext():
            for first in range(0, len(slots), per_copy):
                copy_blocks(engine.kv_cache, offload.host, blocks[first:first + per_copy],
                            slots[first:first + per_copy], to_host=False)

    rate = timed_rate(copy, len(slots) * offload.host.block_bytes, device)
    for block_id in blocks:
        bm.release(block_id)
    return rate


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


def make_engine(args: argparse.Namespace, model_dir: Path, **tiers) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device=args.device, dtype=args.dtype,
                                  kv_cache_memory=int(args.device_pool_gib * 2**30),
                                  max_model_len=args.prefix_tokens + 256, **tiers))


def empty_cache(device: str) -> None:
    """The memory of an engine just deleted goes back, for the next engine. Collected, not left to
    reference counts: were the engine in a reference cycle, its 64 GiB of pinned host tier would
    still be held when the next one pins as much, on a 128 GiB machine."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(PRESETS), default="8b")
    ap.add_argument("--device", default="cuda")
    for name, value in PRESETS["8b"].items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=None,
                        help=f"default {value} (8b), {PRESETS['tiny'][name]} (tiny)")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)} (default: all)")
    ap.add_argument("--model-dir", default=None,
                    help="the random-weight model: reused if it holds one, else written there (default: under /tmp)")
    ap.add_argument("--tokenizer-dir", default=None,
                    help="a directory with tokenizer.json (default: the embedded model's)")
    ap.add_argument("--disk-path", default=None, help="disk tier directory (default: a temporary one)")
    ap.add_argument("--out", required=True, help="JSON results, rewritten after every step")
    args = ap.parse_args()
    for name, value in PRESETS[args.shape].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(args.phases) - set(PHASES)
    if unknown:
        ap.error(f"unknown phases {sorted(unknown)}; choose from {', '.join(PHASES)}")
    return args


def main() -> None:
    args = parse_args()
    phases = set(args.phases)
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny shapes: threads only wait on each other (and on other processes)
    results = Results(Path(args.out), args)
    data = results.data
    model_dir = Path(args.model_dir or Path(tempfile.gettempdir()) / f"disagg-kv-tiers-{args.shape}")
    with results.step("model"):
        reused = (model_dir / "model.safetensors").exists()
        tokenizer_dir = Path(args.tokenizer_dir) if args.tokenizer_dir else resolve_model(None)
        write_model(args.shape, model_dir, tokenizer_dir, args.device)
        data["model_reused"] = reused
        results.log(f"model {'reused' if reused else 'written'} in {model_dir}")
    rng = random.Random(0)
    prefixes = [random_ids(rng, args.prefix_tokens) for _ in range(args.conversations)]
    returning = [p + random_ids(rng, 32) for p in prefixes[:args.returning]]
    disk_turns = [p + random_ids(rng, 32) for p in prefixes[-args.disk_conversations:]]
    fresh = [random_ids(rng, args.prefix_tokens) for _ in range(4)]
    fresh_warm = [random_ids(rng, args.prefix_tokens) for _ in range(4)]  # the mixed steps' kernels compiled
    warm = [random_ids(rng, args.prefix_tokens)]
    tiers = dict(kv_offloading_size=args.host_gib)
    if "disk" in phases:  # else no disk tier: turn 1 need not wait for tens of GiB of disk writes
        tiers.update(kv_disk_path=args.disk_path or tempfile.mkdtemp(prefix="disagg-kv-disk-"),
                     kv_disk_size=args.disk_gib)

    if phases & {"load_bw", "host", "decode", "disk"}:
        with results.step("on: engine start"):
            on = make_engine(args, model_dir, **tiers)
        with results.step("on: warm-up"):
            prefill_all(on, warm, "warm")  # kernels compiled before anything is timed
        # The disk phase needs every prefix written below; load_bw alone needs one in the host tier.
        turn1 = prefixes if phases & {"host", "disk"} else prefixes[:1] if "load_bw" in phases else []
        if turn1:
            with results.step(f"on: turn 1 ({len(turn1)} x {args.prefix_tokens} tokens)"):
                prefill_all(on, turn1, "t1")
            with results.step("on: copies and disk writes drained"):
                on.offload.drain()  # nothing in flight while the tiers are timed
        if "load_bw" in phases:
            with results.step("load_bw"):
                tier_bw, nbytes, slots = tier_load_bandwidth(on, prefixes[0] + [1], args.device)
                data.update(tier_load_gb_s=tier_bw / 1e9, load_bytes=nbytes)
                data["plain_copy_gb_s"] = plain_copy_bandwidth(nbytes, args.device) / 1e9
                data["load_bw_ratio"] = data["tier_load_gb_s"] / data["plain_copy_gb_s"]
                data["host_tier_copy_gb_s"] = host_tier_copy_bandwidth(on, slots, args.device) / 1e9
                data["copy_blocks_gb_s"] = copy_blocks_bandwidth(on, slots, args.device) / 1e9
                data["load_slot_runs"] = len(slot_runs(slots))
        if "host" in phases:
            with results.step(f"host: {len(returning)} returning turns"):
                data["ttft_host_p50_s"] = statistics.median(returning_ttfts(on, returning, "ret", args.device))
        if "decode" in phases:
            with results.step("decode on (warm-up, then timed)"):
                decode_tps(on, rng, args.decode_batch, fresh_warm, "on-warm")
                data["decode_tok_s_on"] = decode_tps(on, rng, args.decode_batch, fresh, "on")
        with results.step("on: close"):
            on.close()  # copies and disk writes in flight finish
            del on
            empty_cache(args.device)

    if phases & {"off", "decode"}:
        with results.step("off: engine start"):
            off = make_engine(args, model_dir)
        with results.step("off: warm-up"):
            prefill_all(off, warm, "warm")
        if "off" in phases:
            with results.step(f"off: {len(returning)} returning turns"):
                data["ttft_off_p50_s"] = statistics.median(returning_ttfts(off, returning, "ret", args.device))
        if "decode" in phases:
            with results.step("decode off (warm-up, then timed)"):
                decode_tps(off, rng, args.decode_batch, fresh_warm, "off-warm")
                data["decode_tok_s_off"] = decode_tps(off, rng, args.decode_batch, fresh, "off")
        del off
        empty_cache(args.device)

    if "disk" in phases:
        with results.step("disk: engine start"):
            # An empty host tier, so prefixes come from disk; it need only hold what their hits promote
            # (pinning the full size again would cost seconds and measure nothing).
            restarted = make_engine(args, model_dir, **tiers | dict(kv_offloading_size=min(args.host_gib, 8.0)))
        with results.step("disk: warm-up"):
            prefill_all(restarted, warm, "warm")
        with results.step(f"disk: {len(disk_turns)} returning turns"):
            data["ttft_disk_p50_s"] = statistics.median(returning_ttfts(restarted, disk_turns, "disk", args.device))
            data["disk_block_hits"] = restarted.offload.disk.stats.hits
        restarted.close()

    results.log("done")
    for key in ("ttft_ratio_host", "ttft_ratio_disk", "load_bw_ratio", "decode_slowdown"):
        if key in data:
            print(f"{key}: {data[key]:.3f}", flush=True)


if __name__ == "__main__":
    main()
