"""A decode step's matrix products on one GPU: cuBLAS (torch.mm, what the engine runs) against a Triton
candidate, at the 8B shape's per-rank shapes under TP=1 and TP=2.

    python benchmarks/gemv_shapes.py [--json out.json]
    python benchmarks/gemv_shapes.py --device cpu     # the candidate's arithmetic, under TRITON_INTERPRET

Why: at TP=2 a decode step's GEMMs read their weights at 2.5-3.9 TB/s where TP=1's reach 3.1-4.2 (the
H200 reads 4.49): half the rows each, the same fixed cost a kernel, and cuBLAS splits K for some shapes
and adds a reduction kernel (BENCHMARKS.md, tensor parallelism). The candidate splits N only: a program a
block of BLOCK_N outputs walks all of K, so no second kernel; at 1 token it multiplies and sums in
float32 (no tensor cores to wait for), at more it uses tl.dot. Each shape, at 1 and 32 tokens, is timed in
a CUDA graph of 64 products that cycle through copies of the weights larger than L2 together (as a step's
32 layers read theirs), median of 5, for cuBLAS and each candidate config; the best config per shape is
reported with its GB/s, and `per_layer_us` sums a layer's four products (qkv, o, gate/up, down) both ways.
"""

import argparse
import itertools
import json
import os
import statistics
import sys

import torch

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel is defined
import triton
import triton.language as tl

HIDDEN, KV, FFN, VOCAB = 4096, 1024, 14336, 49152
L2_BYTES = 60 << 20  # an H100's and H200's L2 is 50 MiB: cycle through more than 4 times that
GRAPH_OPS = 64


def shapes(tp: int) -> dict[str, tuple[int, int]]:
    """(N, K) of a rank's weight: q/k/v and gate/up column-parallel, o and down row-parallel."""
    return {"qkv": ((HIDDEN + 2 * KV) // tp, HIDDEN), "o": (HIDDEN, HIDDEN // tp),
            "gate_up": (2 * FFN // tp, HIDDEN), "down": (HIDDEN, FFN // tp), "lm_head": (VOCAB // tp, HIDDEN)}


@triton.jit
def gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """out[M, N] = x[M, K] @ w[N, K]^T (K a multiple of BLOCK_K): BLOCK_N outputs a program."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    n_ok = n < N
    dtype = out_ptr.dtype.element_ty
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = tl.load(w_ptr + n[:, None] * K + (k0 + k)[None, :], mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr + k0 + k)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        tl.store(out_ptr + n, acc.to(dtype), mask=n_ok)
    else:
        m = tl.arange(0, BLOCK_M)
        m_ok = m < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = tl.load(w_ptr + n[:, None] * K + (k0 + k)[None, :], mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr + m[:, None] * K + (k0 + k)[None, :], mask=m_ok[:, None], other=0.0)
            acc += tl.dot(x, tl.trans(w))
        tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(dtype), mask=m_ok[:, None] & n_ok[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_n: int, block_k: int, warps: int,
         stages: int) -> torch.Tensor:
    m, k = x.shape
    block_m = 1 if m == 1 else max(16, triton.next_power_of_2(m))
    gemv_kernel[(triton.cdiv(w.shape[0], block_n),)](x, w, out, m, w.shape[0], k, BLOCK_M=block_m,
                                                      BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                                                      num_stages=stages)
    return out


def configs(tokens: int) -> list[tuple[int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, warps, stages) to try."""
    if tokens == 1:
        return list(itertools.product((8, 16, 32, 64), (256, 512), (4, 8), (3, 4)))
    return list(itertools.product((16, 32, 64), (64, 128), (4, 8), (3, 4)))


def graph_us(run, copies: int) -> float:
    """µs per product: GRAPH_OPS products (copy i % copies each) in one CUDA graph, replayed 10 times,
    median of 5."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            run(i % copies)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(GRAPH_OPS):
            run(i % copies)
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / (10 * GRAPH_OPS))
    return statistics.median(samples)


def measure(tokens: int, n: int, k: int) -> dict:
    copies = max(2, -(-4 * L2_BYTES // (n * k * 2)))
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
    x = torch.randn(tokens, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(tokens, n, dtype=torch.bfloat16, device="cuda")
    expected = x.float() @ ws[0].float().t()
    cublas = graph_us(lambda i: torch.mm(x, ws[i].t(), out=out), copies)
    best = None
    for config in configs(tokens):
        got = gemv(x, ws[0], out, *config).float()
        if not torch.allclose(got, expected, atol=2e-2, rtol=2e-2):
            raise AssertionError(f"the candidate {config} is wrong at {tokens} x {n} x {k}")
        us = graph_us(lambda i, c=config: gemv(x, ws[i], out, *c), copies)
        if best is None or us < best[0]:
            best = (us, config)
    weights = n * k * 2
    return {"cublas_us": round(cublas, 2), "cublas_gbps": round(weights / cublas / 1e3, 1),
            "triton_us": round(best[0], 2), "triton_gbps": round(weights / best[0] / 1e3, 1),
            "triton_config": dict(zip(("block_n", "block_k", "warps", "stages"), best[1]))}


def check_on_cpu() -> None:
    """The candidate's arithmetic under the interpreter: small shapes, both of its paths."""
    g = torch.Generator().manual_seed(0)
    for tokens, n, k, config in ((1, 24, 512, (8, 256, 4, 3)), (3, 40, 256, (16, 128, 4, 3))):
        x, w = torch.randn(tokens, k, generator=g), torch.randn(n, k, generator=g)
        out = gemv(x, w, torch.empty(tokens, n), *config)
        torch.testing.assert_close(out, x @ w.t(), atol=1e-3, rtol=1e-3)
    print("the candidate's products match torch's on the CPU")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", default="1,32")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.device == "cpu":
        check_on_cpu()
        return
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    for tp, tokens in itertools.product((1, 2), (int(t) for t in args.tokens.split(","))):
        rows = result.setdefault(f"tp{tp}", {}).setdefault(str(tokens), {})
        for name, (n, k) in shapes(tp).items():
            rows[name] = measure(tokens, n, k)
            print(f"TP={tp} {tokens:>2} tokens {name:8s} {n:>6} x {k:>5}: cuBLAS {rows[name]['cublas_us']:7.2f} us "
                  f"({rows[name]['cublas_gbps']:6.1f} GB/s), Triton {rows[name]['triton_us']:7.2f} us "
                  f"({rows[name]['triton_gbps']:6.1f} GB/s) {rows[name]['triton_config']}", flush=True)
        layer = ("qkv", "o", "gate_up", "down")
        rows["per_layer_us"] = {"cublas": round(sum(rows[p]["cublas_us"] for p in layer), 2),
                                "best_of_both": round(sum(min(rows[p]["cublas_us"], rows[p]["triton_us"])
                                                          for p in layer), 2)}
    print(json.dumps({k: v for k, v in result.items() if k.startswith("tp")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
