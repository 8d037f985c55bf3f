"""The decode attention kernel's split count, swept, at the batch sizes of CUDA graph buckets.

    python benchmarks/decode_splits.py [--json out.json]

A decode step runs in the CUDA graph of its batch's bucket, padded with sequences that attend to
nothing, and the graph fixes the kernel's split count. For `real` sequences of `ctx` tokens, at the
8B shape's attention (32 query heads, 8 KV heads, head_dim 128, bfloat16, a shuffled paged cache),
milliseconds of every split count, and of two ways to run it in a graph:
- `before`: the buckets 1, 2, 4, 8, 16, 32, 64, each graph with enough slices to fill the GPU twice
  at its bucket's size;
- `now`: DecodeGraphs' buckets, those and the last batch size of each split count, each graph with
  TritonAttention's split_count of its bucket.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_kernels import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, Paged, ints, median_ms

from disagg.engine.cuda_graphs import buckets
from disagg.engine.layers import triton_kernels
from disagg.engine.layers.triton_attention import MAX_SPLITS, split_count

BATCHES = [1, 4, 8, 9, 12, 16, 17, 24, 32, 33, 48, 64]
MAX_BATCH = 64


def fill_twice(batch: int, num_sms: int) -> int:
    want = -(-2 * num_sms // (batch * KV_HEADS))
    return min(MAX_SPLITS, 1 << max(0, want - 1).bit_length())


def case(real: int, ctx: int, num_sms: int) -> dict:
    def bucket_of(sizes: list[int]) -> int:
        return next(b for b in sizes if b >= real)

    before_bucket = bucket_of([1, 2, 4, 8, 16, 32, 64])
    now_bucket = bucket_of(buckets(MAX_BATCH, lambda n: split_count(n, KV_HEADS, num_sms)))
    paged = Paged(MAX_BATCH, ctx)
    q = torch.randn(MAX_BATCH, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)

    def ms(bucket: int, splits: int) -> float:
        positions = ints([ctx - 1] * real + [-1] * (bucket - real))
        return median_ms(lambda: triton_kernels.decode_attention(
            q[:bucket], out[:bucket], paged.k_cache, paged.v_cache, paged.table, paged.rows[:bucket], positions,
            BLOCK_SIZE, splits))

    static = {s: ms(real, s) for s in (1 << i for i in range(MAX_SPLITS.bit_length()))}
    before = (before_bucket, fill_twice(before_bucket, num_sms))
    now = (now_bucket, split_count(now_bucket, KV_HEADS, num_sms))
    kv_bytes = 2 * real * ctx * KV_HEADS * HEAD_DIM * 2
    r = {"real": real, "ctx": ctx, "static_ms": static, "before_bucket": before[0], "before_splits": before[1],
         "before_ms": ms(*before), "now_bucket": now[0], "now_splits": now[1], "now_ms": ms(*now)}
    return r | {"before_gbps": kv_bytes / r["before_ms"] / 1e6, "now_gbps": kv_bytes / r["now_ms"] / 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for ctx in map(int, args.contexts.split(",")):
        for real in BATCHES:
            r = case(real, ctx, num_sms)
            rows.append(r)
            print(f"ctx {ctx:6d} batch {real:3d}: before {r['before_splits']:2d} slices in {r['before_bucket']:2d} "
                  f"{r['before_ms']:.4f} ms ({r['before_gbps']:.0f} GB/s), now {r['now_splits']:2d} in "
                  f"{r['now_bucket']:2d} {r['now_ms']:.4f} ms ({r['now_gbps']:.0f} GB/s) | unpadded: "
                  + " ".join(f"{s}:{t:.4f}" for s, t in r["static_ms"].items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
