"""Attention backends: how a step's batch becomes attention metadata, and how a layer stores
its new K/V and attends over the paged cache. One is chosen at engine start
(docs/ARCHITECTURE.md, "Engine (as built)"): `SdpaAttention` on the CPU, the reference;
`TritonAttention` (triton_attention.py) on CUDA.

Tokens of a batch are flat: first the single-token segments (decodes), then the multi-token
segments (prompts or chunks of them). `ModelRunner.order` puts a batch in that order.
"""

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from disagg.engine.kv_cache import KVCache
from disagg.engine.scheduler import ScheduledSeq


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: Any  # the backend's own metadata
    sample_rows: torch.Tensor  # [S] rows whose logits pick a token: sequences whose last token is computed


class AttentionBackend(Protocol):
    kv_cache: KVCache

    def prepare(self, batch: list[ScheduledSeq]) -> StepInputs: ...

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D]: store k/v in the cache, return attention [T, H, D]."""
        ...


@dataclass
class PrefillSegment:
    start: int  # first row in the flat batch
    num_new: int  # tokens computed in this step
    context_len: int  # tokens attended to, cached ones included
    context_slots: torch.Tensor | None  # [context_len] cache rows; None when all context is new


@dataclass
class SdpaMetadata:
    slot_mapping: torch.Tensor  # [T] cache row each new token's K/V is written to
    num_decodes: int  # rows 0..num_decodes-1 are single-token segments
    decode_slots: torch.Tensor | None  # [B, max_context] cache rows, padded
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_context] True where attended
    prefills: list[PrefillSegment]


class SdpaAttention:
    """torch's scaled_dot_product_attention over K/V gathered from the cache: decodes in one
    padded call, each multi-token segment on its own, so a long prompt never pads short ones."""

    def __init__(self, kv_cache: KVCache):
        self.kv_cache = kv_cache

    def prepare(self, batch: list[ScheduledSeq]) -> StepInputs:
        device = self.kv_cache.kv.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[torch.Tensor] = []
        sample_rows: list[int] = []
        decode_context: list[torch.Tensor] = []
        prefills: list[PrefillSegment] = []
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            row = len(ids)
            context = self.kv_cache.slots(seq.block_table, end)
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            slots.append(context[start:])
            if n == 1:
                assert not prefills, "single-token segments must come first"
                decode_context.append(context)
            else:
                prefills.append(PrefillSegment(row, n, end, None if start == 0 else context))
            if end == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
        decode_slots = decode_mask = None
        if decode_context:
            # Padding points at row 0 and is masked out; the cache is zeroed, so it holds no NaN.
            decode_slots = torch.nn.utils.rnn.pad_sequence(decode_context, batch_first=True)
            lengths = torch.tensor([len(c) for c in decode_context], device=device)
            width = decode_slots.shape[1]
            decode_mask = (torch.arange(width, device=device)[None, :] < lengths[:, None])[:, None, None, :]
        meta = SdpaMetadata(torch.cat(slots), len(decode_context), decode_slots, decode_mask, prefills)
        return StepInputs(torch.tensor(ids, dtype=torch.int64, device=device),
                          torch.tensor(pos, dtype=torch.int64, device=device), meta,
                          torch.tensor(sample_rows, dtype=torch.int64, device=device))

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: SdpaMetadata) -> torch.Tensor:
        self.kv_cache.store(layer, k, v, meta.slot_mapping)
        k_cache, v_cache = self.kv_cache.keys(layer), self.kv_cache.values(layer)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        if meta.num_decodes:
            b = meta.num_decodes
            qd = q[:b].unsqueeze(2)  # [B, H, 1, D]
            kd = _gather(k_cache, meta.decode_slots).transpose(1, 2)  # [B, Hkv, L, D]
            vd = _gather(v_cache, meta.decode_slots).transpose(1, 2)
            out[:b] = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask,
                                                     enable_gqa=gqa).squeeze(2)
        for seg in meta.prefills:
            rows = slice(seg.start, seg.start + seg.num_new)
            qs = q[rows].transpose(0, 1)  # [H, n, D]
            if seg.context_slots is None:
                ks, vs = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
            else:
                ks = _gather(k_cache, seg.context_slots).transpose(0, 1)
                vs = _gather(v_cache, seg.context_slots).transpose(0, 1)
                o = _attend_after_context(qs, ks, vs, gqa)
            out[rows] = o.transpose(0, 1)
        return out


# With a mask, torch's CPU attention computes the whole [heads, queries, context] score matrix (and
# its softmax) in float32: a 2,048-token chunk after 6k cached tokens is 1.4 GB at once. Queries go
# in blocks whose scores stay under this many bytes; each row's result is the same.
SCORES_BYTES = 64 << 20


def _attend_after_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
    """q [H, n, D] for the last n positions of a context of k/v [Hkv, L, D]: causal attention."""
    num_heads, n, _ = q.shape
    context = k.shape[1]
    block = max(1, SCORES_BYTES // (num_heads * context * 4))
    k_pos = torch.arange(context, device=q.device)
    out = torch.empty_like(q)
    for first in range(0, n, block):
        last = min(n, first + block)
        # New token i sits at context position context - n + i.
        q_pos = torch.arange(context - n + first, context - n + last, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        out[:, first:last] = F.scaled_dot_product_attention(q[:, first:last], k, v, attn_mask=mask, enable_gqa=gqa)
    return out


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for cache [rows, Hkv, D]: index_select copies whole rows and, on the
    CPU, takes ~60% of the time of advanced indexing (1 thread, batch 32, context 160)."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])
