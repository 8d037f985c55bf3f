"""Decode attention over a batch whose sequences hold different contexts, against one of equal contexts
holding the same tokens.

    python benchmarks/decode_mixed.py [--baseline OLD/triton_kernels.py] [--json out.json]

With one split count for every sequence (the kernel before db62618), a long sequence's slices are long
and a short one's short; with every program resident at once, a step lasts as long as the longest
slice. Now a step's slices are shared out by length (`_slices`). At the 8B shape's attention
(32 query heads, 8 KV heads, head_dim 128, bfloat16, a shuffled paged cache), for each batch size,
milliseconds of one layer's decode attention (the kernel and its merge, in a CUDA graph) for: `equal`,
every sequence at the mean context; `lognormal`, contexts drawn lognormal (sigma 0.8, as a chat
workload's prompts and answers spread) scaled to the same total; `one_long`, one sequence at 4x the
mean and the rest sharing what is left (nothing up to 4 sequences: empty rows, as a graph's padding).
`--baseline` times another version's triton_kernels.py beside this one's, case by case.
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attention_kernels import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, Paged, ints, median_ms

from disagg.engine.layers import triton_kernels
from disagg.engine.layers.triton_attention import split_count

BATCHES = [2, 4, 8, 10, 12, 16, 24, 32, 48, 64]
KINDS = ("equal", "lognormal", "one_long")


def contexts(kind: str, batch: int, mean: int, rng: np.random.Generator) -> list[int]:
    total = batch * mean
    if kind == "equal":
        return [mean] * batch
    if kind == "one_long":  # up to 4 sequences nothing is left: the long one alone beside empty rows
        rest = max(0, (total - 4 * mean) // (batch - 1))
        return [4 * mean] + [rest] * (batch - 1)
    drawn = rng.lognormal(0.0, 0.8, batch)
    return [max(16, int(c)) for c in drawn / drawn.sum() * total]


def load_kernels(path: str):
    spec = importlib.util.spec_from_file_location("baseline_triton_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def layer_ms(versions: dict, ctx: list[int], num_sms: int) -> dict[str, float]:
    """Each version's time of one layer's decode attention over the same cache and queries."""
    batch = len(ctx)
    paged = Paged(batch, max(ctx))
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    positions = ints([c - 1 for c in ctx])
    splits = split_count(batch, KV_HEADS, num_sms)
    return {f"{name}_ms": median_ms(lambda k=kernels: k.decode_attention(
        q, out, paged.k_cache, paged.v_cache, paged.table, paged.rows, positions, BLOCK_SIZE, splits))
        for name, kernels in versions.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mean-context", type=int, default=1536)
    ap.add_argument("--baseline", help="another version's disagg/engine/layers/triton_kernels.py, timed beside")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    versions = {"head": triton_kernels} | ({"baseline": load_kernels(args.baseline)} if args.baseline else {})
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rng = np.random.default_rng(0)
    rows = []
    for batch in BATCHES:
        row = {"batch": batch, "splits": split_count(batch, KV_HEADS, num_sms)}
        for kind in KINDS:
            ctx = contexts(kind, batch, args.mean_context, rng)
            row[kind] = {"longest": max(ctx)} | layer_ms(versions, ctx, num_sms)
        rows.append(row)
        print(f"batch {batch:3d} ({row['splits']:2d} slices), ms: " + ", ".join(
            f"{k} " + " / ".join(f"{row[k][f'{name}_ms']:.4f}" for name in versions) for k in KINDS), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "mean_context":
                                               args.mean_context, "versions": list(versions), "cases": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
