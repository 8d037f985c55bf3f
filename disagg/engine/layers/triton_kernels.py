"""Triton kernels of the CUDA attention backend: KV write, paged prefill and paged decode.

The cache layout is KVCache's: per layer, K and V are [slots, kv_heads, head_dim] with slot
= block * block_size + offset. Kernels find a token's slot through a block table that lives on
the device ([rows, max_blocks] int32, one row per running sequence, docs/ARCHITECTURE.md,
"Engine (as built)"), so no slot mapping or gathered K/V is ever built per step.

Every query row of a program is one (query token, query head) pair of one KV head's group,
so the heads that share a KV head (GQA) read each K/V tile once. The kernels also run under
TRITON_INTERPRET=1 on CPU tensors, which is how CI checks them against the SDPA reference.
"""

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
DECODE_BLOCK_N = 64  # keys a decode program reads per tile


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, table_ptr, rows_ptr, positions_ptr,
                    stride_k, stride_v, stride_table, ROW: tl.constexpr, ROW_PAD: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr):
    """One program per token: its K and V rows ([kv_heads * head_dim]) into its cache slot.
    A token with a negative position is padding (a CUDA graph's unused batch rows)."""
    t = tl.program_id(0)
    pos = tl.load(positions_ptr + t)
    row = tl.load(rows_ptr + t).to(tl.int64)
    block = tl.load(table_ptr + row * stride_table + tl.maximum(pos, 0) // BLOCK_SIZE)
    slot = block.to(tl.int64) * BLOCK_SIZE + tl.maximum(pos, 0) % BLOCK_SIZE
    offs = tl.arange(0, ROW_PAD)
    mask = offs < tl.where(pos >= 0, ROW, 0)
    k = tl.load(k_ptr + t * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_v + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


@triton.jit
def _attend_tile(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, start, kv_end,
                 q_pos, d, d_mask, scale_log2, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    """Online softmax over keys [start, start + BLOCK_N) of one sequence (flash attention's step)."""
    j = start + tl.arange(0, BLOCK_N)
    j_mask = j < kv_end
    block = tl.load(table_row_ptr + j // BLOCK_SIZE, mask=j_mask, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + j % BLOCK_SIZE
    kv_offs = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
    kv_mask = j_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * scale_log2
    keep = j_mask[None, :]
    if CAUSAL:
        keep = keep & (j[None, :] <= q_pos[:, None])
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing to attend yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def prefill_attention_kernel(q_ptr, out_ptr, k_cache_ptr, v_cache_ptr, table_ptr, seq_rows_ptr,
                             query_start_ptr, seq_lens_ptr, tile_seq_ptr, tile_start_ptr,
                             stride_qt, stride_qh, stride_ot, stride_oh, stride_table, scale_log2,
                             NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                             HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr):
    """Causal attention of a tile of one sequence's new queries over its whole context, read
    from the cache (cached prefix, earlier chunks and this step's tokens, already stored).
    Grid: (query tiles of all sequences, kv heads)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_start_ptr + tile)  # index of the tile's first query in its sequence
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    context = tl.load(seq_lens_ptr + seq)
    table_row_ptr = table_ptr + tl.load(seq_rows_ptr + seq).to(tl.int64) * stride_table

    r = tl.arange(0, BLOCK_M)
    qi = first + r // GROUP
    head = kv_head * GROUP + r % GROUP
    r_mask = (r < (BLOCK_M // GROUP) * GROUP) & (qi < q_len)
    q_pos = context - q_len + qi
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    q_offs = (q_begin + qi).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=r_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # Keys after the tile's last query are never attended.
    kv_end = tl.minimum(context, context - q_len + first + BLOCK_M // GROUP)
    for start in range(0, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head,
                                     start, kv_end, q_pos, d, d_mask, scale_log2, NUM_KV_HEADS, HEAD_DIM,
                                     BLOCK_N, BLOCK_SIZE, True, IEEE)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_offs = (q_begin + qi).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


@triton.jit
def _slices(positions_ptr, batch, splits, BATCH_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """The step's context slices, from its sequences' contexts: as vectors over [0, BATCH_PAD), each
    sequence's key tiles, first program and number of programs (slices). A slice holds at most the
    mean load of batch x splits programs: equal contexts get `splits` slices each, as many as one
    split count for all would give them, and a long context among short ones gets more, so that no
    slice is much longer than another (a step lasts as long as its longest: benchmarks/decode_mixed.py).
    The counts sum to at most batch x (splits + 1): the grid's programs."""
    i = tl.arange(0, BATCH_PAD)
    tiles = tl.cdiv(tl.maximum(tl.load(positions_ptr + i, mask=i < batch, other=-1) + 1, 0), BLOCK_N)
    per_slice = tl.maximum(tl.cdiv(tl.sum(tiles, 0), batch * splits), 1)
    count = tl.where(i < batch, tl.maximum(tl.cdiv(tiles, per_slice), 1), 0)
    return i, tiles, tl.cumsum(count, 0) - count, count


# batch and splits unspecialized: a decode count no graph bucket warmed compiles no variant mid-serving
@triton.jit(do_not_specialize=["batch", "splits"])
def decode_attention_kernel(q_ptr, part_out_ptr, part_lse_ptr, k_cache_ptr, v_cache_ptr, table_ptr,
                            rows_ptr, positions_ptr, stride_qt, stride_qh, stride_table, scale_log2, batch,
                            splits, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                            HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, BATCH_PAD: tl.constexpr,
                            IEEE: tl.constexpr):
    """Split-K (flash-decoding) attention of one new token per sequence: each program takes one
    slice of one sequence's context (`_slices`) for one KV head's group and writes a partial output
    and its log-sum-exp at its own index; `merge_splits_kernel` combines a sequence's slices. Grid:
    (batch x (splits + 1), kv heads). A sequence with a negative position is padding and attends to nothing."""
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    i, tiles, firsts, counts = _slices(positions_ptr, batch, splits, BATCH_PAD, BLOCK_N)
    b = tl.sum(((firsts <= program) & (i < batch)).to(tl.int32), 0) - 1  # every sequence has a program
    mine = i == b
    num_tiles = tl.sum(tl.where(mine, tiles, 0), 0)
    split = program - tl.sum(tl.where(mine, firsts, 0), 0)
    count = tl.sum(tl.where(mine, counts, 0), 0)
    if split < count:  # else a program left over: no slice
        context = tl.load(positions_ptr + b) + 1
        table_row_ptr = table_ptr + tl.load(rows_ptr + b).to(tl.int64) * stride_table
        r = tl.arange(0, BLOCK_M)
        head = kv_head * GROUP + r
        r_mask = r < GROUP
        d = tl.arange(0, HEAD_DIM_PAD)
        d_mask = d < HEAD_DIM
        q = tl.load(q_ptr + b * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=r_mask[:, None] & d_mask[None, :], other=0.0)
        per_split = tl.cdiv(num_tiles, count)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        q_pos = tl.zeros([BLOCK_M], tl.int32)  # unused: no causal mask within the context
        for tile in range(split * per_split, tl.minimum((split + 1) * per_split, num_tiles)):
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head,
                                         tile * BLOCK_N, context, q_pos, d, d_mask, scale_log2, NUM_KV_HEADS,
                                         HEAD_DIM, BLOCK_N, BLOCK_SIZE, False, IEEE)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        part = program.to(tl.int64) * (NUM_KV_HEADS * GROUP) + head
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], out, mask=r_mask[:, None])
        tl.store(part_lse_ptr + part, lse, mask=r_mask)


@triton.jit(do_not_specialize=["batch", "splits"])
def merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, positions_ptr, stride_ot, stride_oh, batch, splits,
                        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                        BLOCK_N: tl.constexpr, BATCH_PAD: tl.constexpr, LANES: tl.constexpr):
    """Weights each of a sequence's slices by its share of the softmax mass, LANES slices at a time (the
    split count: one round when contexts are equal). Grid: (sequences, heads)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    i, _, firsts, counts = _slices(positions_ptr, batch, splits, BATCH_PAD, BLOCK_N)
    first = tl.sum(tl.where(i == b, firsts, 0), 0)
    count = tl.sum(tl.where(i == b, counts, 0), 0)
    s = tl.arange(0, LANES)
    d = tl.arange(0, HEAD_DIM_PAD)
    m = tl.max(tl.full([LANES], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([LANES], tl.float32), 0)
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for start in range(0, count, LANES):
        valid = start + s < count
        part = (first + start + s).to(tl.int64) * NUM_HEADS + h
        lse = tl.load(part_lse_ptr + part, mask=valid, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m_safe))
        parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], mask=valid[:, None], other=0.0)
        scale = tl.exp2(m - m_safe)  # what the slices before weighed, against the new maximum
        acc = acc * scale + tl.sum(parts * w[:, None], 0)
        total = total * scale + tl.sum(w, 0)
        m = m_new
    out = acc / tl.maximum(total, 1e-30)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# -- launchers -----------------------------------------------------------------------------


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> None:
    """k/v [T, kv_heads, head_dim] (rows may be strided views) into the cache at their positions."""
    row = k_cache.shape[1] * k_cache.shape[2]
    store_kv_kernel[(k.shape[0],)](k, v, k_cache, v_cache, table, rows, positions, k.stride(0), v.stride(0),
                                   table.stride(0), ROW=row, ROW_PAD=triton.next_power_of_2(row),
                                   BLOCK_SIZE=block_size)


def _group(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int]:
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    return num_kv_heads, q.shape[1] // num_kv_heads, head_dim


def prefill_attention(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      table: torch.Tensor, seq_rows: torch.Tensor, query_start: torch.Tensor,
                      seq_lens: torch.Tensor, tile_seq: torch.Tensor, tile_start: torch.Tensor,
                      block_size: int, block_m: int) -> None:
    """q/out [T, heads, head_dim]; one tile per `block_m // group` queries of a sequence."""
    num_kv_heads, group, head_dim = _group(q, k_cache)
    prefill_attention_kernel[(tile_seq.shape[0], num_kv_heads)](
        q, out, k_cache, v_cache, table, seq_rows, query_start, seq_lens, tile_seq, tile_start,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), table.stride(0), head_dim ** -0.5 * LOG2E,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_SIZE=block_size, IEEE=q.dtype == torch.float32,
        num_warps=8 if block_m >= 128 else 4, num_stages=2)


def decode_attention(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int,
                     num_splits: int) -> None:
    """q/out [B, heads, head_dim], one token per sequence at `positions` (its context is positions + 1),
    its context in slices of about the mean load of B x num_splits programs a KV head (`_slices`)."""
    num_kv_heads, group, head_dim = _group(q, k_cache)
    batch, num_heads = q.shape[0], q.shape[1]
    head_dim_pad = triton.next_power_of_2(head_dim)
    num_programs = batch * (num_splits + 1)
    batch_pad = triton.next_power_of_2(batch)
    part_out = torch.empty(num_programs, num_heads, head_dim_pad, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_programs, num_heads, dtype=torch.float32, device=q.device)
    decode_attention_kernel[(num_programs, num_kv_heads)](
        q, part_out, part_lse, k_cache, v_cache, table, rows, positions, q.stride(0), q.stride(1),
        table.stride(0), head_dim ** -0.5 * LOG2E, batch, num_splits, NUM_KV_HEADS=num_kv_heads, GROUP=group,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=DECODE_BLOCK_N, BLOCK_SIZE=block_size, BATCH_PAD=batch_pad, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2)
    merge_splits_kernel[(batch, num_heads)](part_out, part_lse, out, positions, out.stride(0), out.stride(1), batch,
                                            num_splits, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
                                            HEAD_DIM_PAD=head_dim_pad, BLOCK_N=DECODE_BLOCK_N, BATCH_PAD=batch_pad,
                                            LANES=triton.next_power_of_2(num_splits))
