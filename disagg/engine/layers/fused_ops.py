"""Triton kernels for the elementwise parts of a Llama layer on the GPU path: residual add +
RMSNorm (under tensor parallelism also the sum over ranks before it), rotary embedding in place,
SiLU(gate) * up. Each is one kernel where torch's ops are
several, which matters most in a decode step, where a layer's ~40 small kernels cost more than
its weights take to read (docs/ARCHITECTURE.md, "Engine (as built)").

Each rounds to the model dtype where the reference (transformers) rounds, so bfloat16 results
stay close to torch's ops; float32 results equal them up to summation order.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, eps,
                    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """One row: (x + residual, written back to residual), then its RMSNorm times weight."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = (x + tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
        x = x.to(tl.float32)
    h = (x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * h).to(dtype), mask=mask)


@triton.jit
def _thread_index():
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _swap_when(flags, old: tl.constexpr, new: tl.constexpr, sem: tl.constexpr):
    """Set each flag from `old` to `new` as soon as it is `old`: a system-scope compare-and-swap, spun."""
    tl.inline_asm_elementwise(f"""{{
        .reg .u32 %prev;
        .reg .pred %done;
        again:
        atom.global.{sem}.sys.cas.b32 %prev, [$1], {old}, {new};
        setp.eq.u32 %done, %prev, {old};
        @!%done bra again;
    }}""", "=r, l", [flags], dtype=tl.uint32, is_pure=False, pack=1)


@triton.jit
def sum_rms_norm_kernel(part_ptrs, pad_ptrs, residual_ptr, weight_ptr, out_ptr, stride_r, eps, pad_base,
                        N: tl.constexpr, BLOCK: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                        SYNC: tl.constexpr):
    """One row: the sum of every rank's part of it (part_ptrs: each rank's [T, N] product, read over
    NVLink), + residual (written back to residual), then its RMSNorm times weight. First, the block
    meets the same block of every other rank through their signal pads (pad_ptrs, entries from
    pad_base on): each rank's part is written before its block signals. SYNC off: no barrier (a test
    of the arithmetic on one device)."""
    row = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    if SYNC:
        ranks = tl.arange(0, WORLD)
        pads = tl.load(pad_ptrs + ranks).to(tl.pointer_type(tl.uint32))
        own = tl.load(pad_ptrs + RANK).to(tl.pointer_type(tl.uint32))
        # One thread per rank: a tensor of WORLD flags is held by more threads than that, and a
        # second signal to the same flag would be taken as the next barrier's.
        if _thread_index() < WORLD:
            # signal each rank once it has taken the last signal; then take each rank's
            _swap_when(pads + pad_base + row * WORLD + RANK, 0, 1, "release")
            _swap_when(own + pad_base + row * WORLD + ranks, 1, 0, "acquire")
        tl.debug_barrier()
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.zeros([BLOCK], tl.float32)
    for rank in tl.static_range(WORLD):  # in rank order on every rank: all get the same sum
        part = tl.multiple_of(tl.load(part_ptrs + rank).to(tl.pointer_type(dtype)), 16)  # 16-byte loads
        x += tl.load(part + row * N + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
    # Rounded as an all-reduce's result would be, then as rms_norm_kernel goes on.
    residual = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    x = (x.to(dtype).to(tl.float32) + residual).to(dtype)
    tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
    x = x.to(tl.float32)
    h = (x * tl.rsqrt(tl.sum(x * x, 0) / N + eps)).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (w * h).to(dtype), mask=mask)


@triton.jit
def _rotate(base, t, stride, heads, cos, sin, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
            HALF_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    offs = t * stride + h[:, None] * HEAD_DIM + i[None, :]
    mask = (h[:, None] < heads) & (i[None, :] < HALF)
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + offs + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base + offs, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(base + offs + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, positions_ptr, stride_q, stride_k, stride_table,
                  NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                  HALF_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One token: every q and k head rotated in place (x1, x2 -> x1 cos - x2 sin, x2 cos + x1 sin)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.maximum(tl.load(positions_ptr + t), 0).to(tl.int64)  # padding tokens: any row, never read back
    i = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + pos * stride_table + i, mask=i < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_table + i, mask=i < HALF, other=0.0)[None, :]
    _rotate(q_ptr, t, stride_q, NUM_Q, cos, sin, HEADS_PAD, HALF, HALF_PAD, HEAD_DIM)
    _rotate(k_ptr, t, stride_k, NUM_K, cos, sin, HEADS_PAD, HALF, HALF_PAD, HEAD_DIM)


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N: tl.constexpr, BLOCK: tl.constexpr):
    """out = silu(x[:, :N]) * x[:, N:], rounded after the SiLU as torch's two ops round."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [T, N], or of x + residual when given (the sum is written to residual)."""
    out = torch.empty_like(x)
    n = x.shape[-1]
    res = x if residual is None else residual
    rms_norm_kernel[(x.shape[0],)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), eps, N=n,
                                   BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None,
                                   num_warps=8 if n >= 2048 else 4)
    return out


def sum_rms_norm(part_ptrs: torch.Tensor, pad_ptrs: torch.Tensor | None, pad_base: int, rank: int,
                 residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of (the sum over ranks of a [T, N] product + residual), the sum written to residual:
    part_ptrs (int64, on the device) holds every rank's address of its part, pad_ptrs every rank's
    signal pad (None: no barrier, the parts are known to be written)."""
    n = residual.shape[-1]
    out = torch.empty(residual.shape[0], n, dtype=residual.dtype, device=residual.device)
    sum_rms_norm_kernel[(residual.shape[0],)](
        # without a barrier the pads are never read: any pointer stands in for them
        part_ptrs, part_ptrs if pad_ptrs is None else pad_ptrs, residual, weight, out, residual.stride(0), eps,
        pad_base, N=n,
        BLOCK=triton.next_power_of_2(n), RANK=rank, WORLD=part_ptrs.shape[0], SYNC=pad_ptrs is not None,
        num_warps=8 if n >= 2048 else 4)
    return out


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """q [T, H, D] and k [T, Hkv, D] (heads contiguous, tokens strided) rotated in place;
    cos/sin [max_positions, D] float32 tables."""
    heads, head_dim = q.shape[1], q.shape[2]
    half = head_dim // 2
    rotary_kernel[(q.shape[0],)](q, k, cos, sin, positions, q.stride(0), k.stride(0), cos.stride(0),
                                 NUM_Q=heads, NUM_K=k.shape[1], HEADS_PAD=triton.next_power_of_2(heads), HALF=half,
                                 HALF_PAD=triton.next_power_of_2(half), HEAD_DIM=head_dim)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = 1024
    silu_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), N=n, BLOCK=block)
    return out
