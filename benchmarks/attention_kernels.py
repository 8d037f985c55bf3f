"""Our Triton attention kernels against the attention kernels torch ships, on one GPU, at the 8B
shape's attention (32 query heads, 8 KV heads, head_dim 128, bfloat16).

    python benchmarks/attention_kernels.py [--json benchmarks/results/attention_kernels_h200.json]

- prefill, causal, one 4,096-token prompt and 16 x 512: ours reads K/V from the paged cache
  through a shuffled block table; torch's SDPA (its flash backend) and FlexAttention (compiled,
  a causal block mask) get contiguous K/V, which an engine with a paged cache would first have
  to gather (SDPA's flash kernel with each KV head already repeated for its query heads).
  Reported as TFLOP/s of causal attention (4 x heads x head_dim x n(n+1)/2 a prompt).
- decode, one token a sequence: batch 1, 32, 128 at context 512 and batch 1 at 32k. Ours is the
  split-K paged kernel (+ its merge); SDPA gets contiguous K/V again. Reported as GB/s of K/V read.

Each kernel timed inside a CUDA graph of 20 calls (as the engine runs decode), median of 20 replays.
FlashInfer is not in the comparison: its wheel (62 MB) and its CUTLASS DSL dependency are over
what the GPU machine can be sent.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from disagg.engine.layers import triton_kernels
from disagg.engine.layers.triton_attention import split_count

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
GROUP = HEADS // KV_HEADS
BLOCK_M = 128  # TritonAttention's tile height at this group size
PREFILL = {"1x4096": (1, 4096), "16x512": (16, 512)}
DECODE = {"b1": (1, 512), "b32": (32, 512), "b128": (128, 512), "b1_32k": (1, 32768)}


def median_ms(fn, calls: int = 20, repeats: int = 20) -> float:
    """GPU time of one call: `calls` calls captured in a CUDA graph, so small kernels are not
    timed as Python launch overhead; the median over replays."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


class Paged:
    """`batch` sequences of `ctx` tokens in a paged cache, blocks in shuffled order."""

    def __init__(self, batch: int, ctx: int):
        blocks = -(-ctx // BLOCK_SIZE)
        order = torch.randperm(batch * blocks, device="cuda").to(torch.int32)
        self.table = order.view(batch, blocks)
        self.rows = torch.arange(batch, dtype=torch.int32, device="cuda")
        shape = (batch * blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.k_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        self.v_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        # The same K/V laid out contiguously per sequence, [batch, kv_heads, ctx, head_dim].
        slots = (self.table.long()[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device="cuda")).flatten(1)
        self.k = self.k_cache[slots[:, :ctx]].transpose(1, 2).contiguous()
        self.v = self.v_cache[slots[:, :ctx]].transpose(1, 2).contiguous()
        # And with each KV head repeated for its query heads, the layout SDPA's flash kernel takes.
        self.k_full = self.k.repeat_interleave(GROUP, dim=1)
        self.v_full = self.v.repeat_interleave(GROUP, dim=1)


def ints(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32, device="cuda")


def prefill_case(batch: int, n: int) -> dict[str, float]:
    paged = Paged(batch, n)
    q = torch.randn(batch * n, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    per_tile = BLOCK_M // GROUP
    tiles = [(i, first) for i in range(batch) for first in range(0, n, per_tile)]
    meta = (paged.rows, ints([i * n for i in range(batch + 1)]), ints([n] * batch),
            ints([i for i, _ in tiles]), ints([f for _, f in tiles]))
    ours = lambda: triton_kernels.prefill_attention(q, out, paged.k_cache, paged.v_cache,  # noqa: E731
                                                    paged.table, *meta, BLOCK_SIZE, BLOCK_M)
    qc = q.view(batch, n, HEADS, HEAD_DIM).transpose(1, 2).contiguous()

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(qc, paged.k_full, paged.v_full, is_causal=True)

    mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, n, n, device="cuda")
    flex = torch.compile(flex_attention)
    flops = batch * 4 * HEADS * HEAD_DIM * n * (n + 1) / 2
    ms = {"ours": median_ms(ours), "torch_sdpa_flash": median_ms(sdpa),
          "flex_attention": median_ms(lambda: flex(qc, paged.k, paged.v, block_mask=mask, enable_gqa=True))}
    return {name: flops / (t / 1e3) / 1e12 for name, t in ms.items()} | {f"{k}_ms": v for k, v in ms.items()}


def decode_case(batch: int, ctx: int, num_sms: int) -> dict[str, float]:
    paged = Paged(batch, ctx)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    positions = ints([ctx - 1] * batch)
    splits = split_count(batch, KV_HEADS, num_sms)
    ours = lambda: triton_kernels.decode_attention(q, out, paged.k_cache, paged.v_cache, paged.table,  # noqa: E731
                                                   paged.rows, positions, BLOCK_SIZE, splits)
    qc = q[:, :, None, :]

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(qc, paged.k_full, paged.v_full)

    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
    ms = {"ours": median_ms(ours), "torch_sdpa_flash": median_ms(sdpa)}
    return {name: kv_bytes / (t / 1e3) / 1e9 for name, t in ms.items()} | {f"{k}_ms": v for k, v in ms.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "prefill_tflops": {case: prefill_case(*shape) for case, shape in PREFILL.items()},
              "decode_kv_gb_per_s": {case: decode_case(*shape, num_sms) for case, shape in DECODE.items()}}
    print(f"{'prefill':10s} {'ours':>10s} {'sdpa flash':>11s} {'flex':>10s}  TFLOP/s")
    for case, r in result["prefill_tflops"].items():
        print(f"{case:10s} {r['ours']:10.0f} {r['torch_sdpa_flash']:11.0f} {r['flex_attention']:10.0f}")
    print(f"{'decode':10s} {'ours':>10s} {'sdpa flash':>11s}  GB/s of K/V read (ms)")
    for case, r in result["decode_kv_gb_per_s"].items():
        print(f"{case:10s} {r['ours']:10.0f} {r['torch_sdpa_flash']:11.0f}"
              f"  ({r['ours_ms']:.3f} / {r['torch_sdpa_flash_ms']:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
