"""TritonAttention: the CUDA backend. Paged kernels read the cache in place through a
device-resident block table; a step's metadata is a few int32 vectors sent in one copy."""

from dataclasses import dataclass

import numpy as np
import torch
import triton

from disagg.engine.block_table import DeviceBlockTable
from disagg.engine.kv_cache import KVCache
from disagg.engine.layers import triton_kernels
from disagg.engine.layers.attention import StepInputs
from disagg.engine.scheduler import ScheduledSeq

MAX_SPLITS = 32
# Decode attention's programs (sequence x KV head x context slice) an SM: fewer leave HBM bandwidth idle,
# more run in an extra wave (an H200 at 4k context: benchmarks/decode_splits.py).
PROGRAMS_PER_SM = 4.5
ALIGN = 4  # int32 elements: 16 bytes


def split_count(num_decodes: int, num_kv_heads: int, num_sms: int) -> int:
    """A step's split count: num_decodes x it context slices a KV head, shared out by length
    (triton_kernels._slices); the most, in powers of two up to MAX_SPLITS, that keep a step's programs
    within PROGRAMS_PER_SM an SM. Slices with no keys exit at once."""
    splits = 1
    while splits < MAX_SPLITS and 2 * splits * num_decodes * num_kv_heads <= PROGRAMS_PER_SM * num_sms:
        splits *= 2
    return splits


@dataclass
class TritonMetadata:
    positions: torch.Tensor  # [T] int32; negative: a padding token (CUDA graph buckets)
    token_rows: torch.Tensor  # [T] int32 block-table row of each token's sequence
    num_decodes: int  # rows 0..num_decodes-1 are single-token segments
    num_splits: int  # split-K: num_decodes x num_splits context slices, shared out by length
    # Multi-token segments, numbered from 0 after the decodes; None when the step has none.
    query_start: torch.Tensor | None = None  # [P + 1] first row of each segment, relative to num_decodes
    seq_lens: torch.Tensor | None = None  # [P] context length after this step
    seq_rows: torch.Tensor | None = None  # [P]
    tile_seq: torch.Tensor | None = None  # [tiles] segment of each query tile
    tile_start: torch.Tensor | None = None  # [tiles] its first query within the segment


class TritonAttention:
    def __init__(self, kv_cache: KVCache, num_heads: int, max_num_seqs: int, max_model_len: int):
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        device = kv_cache.kv.device
        max_blocks = -(-max_model_len // self.block_size) + 1
        self.block_table = DeviceBlockTable(2 * max_num_seqs, max_blocks, device)
        num_kv_heads = kv_cache.kv.shape[3]
        self.group = num_heads // num_kv_heads
        self.num_kv_heads = num_kv_heads
        # Query rows of a prefill tile: wide for the matrix units, a power of two, at least 16 for tl.dot.
        self.block_m = min(128, max(16, triton.next_power_of_2(32 * self.group)))
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        # The step's metadata goes through pinned memory: from pageable memory the copy is staged by
        # the driver on the engine thread. `copied` marks when the last copy has read the buffer.
        self.staging = torch.empty(0, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def num_splits(self, batch: int) -> int:
        return split_count(batch, self.num_kv_heads, self.num_sms)

    def prepare(self, batch: list[ScheduledSeq]) -> StepInputs:
        rows, updates = self.block_table.assign([item.seq for item in batch])
        ids, positions, token_rows, sample_rows = [], [], [], []
        query_start, seq_lens, seq_rows, tile_seq, tile_start = [0], [], [], [], []
        per_tile = self.block_m // self.group
        num_decodes = 0
        for item, row in zip(batch, rows):
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            if n == 1:
                assert not seq_lens, "single-token segments must come first"
                num_decodes += 1
                ids.append(seq.token_ids[start])
                positions.append(start)
                token_rows.append(row)
            else:
                ids.extend(seq.token_ids[start:start + n])
                positions.extend(range(start, start + n))
                token_rows.extend([row] * n)
                tiles = range(0, n, per_tile)
                tile_seq.extend([len(seq_lens)] * len(tiles))
                tile_start.extend(tiles)
                query_start.append(query_start[-1] + n)
                seq_lens.append(start + n)
                seq_rows.append(row)
            if start + n == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
        parts = [ids, positions, token_rows, sample_rows]
        if seq_lens:
            parts += [query_start, seq_lens, seq_rows, tile_seq, tile_start]
        parts.append(updates.reshape(-1))
        # Every part starts 16-byte aligned: Triton compiles a kernel once per alignment of its pointers,
        # and a compile mid-serving stalls every request for about a second.
        starts = np.cumsum([0] + [-(-len(p) // ALIGN) * ALIGN for p in parts])
        host = np.zeros(starts[-1], np.int32)
        for part, start in zip(parts, starts):
            host[start:start + len(part)] = part
        flat = self._to_device(host)
        views = [flat[start:start + len(part)] for part, start in zip(parts, starts)]
        self.block_table.apply(views[-1].view(2, -1))
        meta = TritonMetadata(views[1], views[2], num_decodes, self.num_splits(max(num_decodes, 1)))
        if seq_lens:
            meta.query_start, meta.seq_lens, meta.seq_rows, meta.tile_seq, meta.tile_start = views[4:9]
        return StepInputs(views[0], views[1], meta, views[3])

    def _to_device(self, host: np.ndarray) -> torch.Tensor:
        """Everything the step needs from the host, in one copy."""
        if self.copied is None:
            return torch.from_numpy(host)
        if self.staging.numel() < host.size:  # the old buffer's pending copy keeps it alive (caching host allocator)
            self.staging = torch.empty(max(host.size, 2 * self.staging.numel()), dtype=torch.int32, pin_memory=True)
        self.copied.synchronize()  # the previous step's copy has read the buffer (long done: its step ended)
        staged = self.staging[:host.size]
        staged.numpy()[:] = host
        flat = staged.to(self.kv_cache.kv.device, non_blocking=True)
        self.copied.record()
        return flat

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TritonMetadata) -> torch.Tensor:
        self.store(layer, k, v, meta)
        out = torch.empty_like(q)
        self.attend(layer, q, out, meta)
        return out

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: TritonMetadata) -> None:
        """The step's K and V into their cache slots (padding tokens, at position -1, nowhere)."""
        triton_kernels.store_kv(k, v, self.kv_cache.keys(layer), self.kv_cache.values(layer), self.block_table.table,
                                meta.token_rows, meta.positions, self.block_size)

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor, meta: TritonMetadata) -> None:
        """out = attention of the step's queries over the cache (their own K and V stored first)."""
        k_cache, v_cache = self.kv_cache.keys(layer), self.kv_cache.values(layer)
        table = self.block_table.table
        b = meta.num_decodes
        if b:
            triton_kernels.decode_attention(q[:b], out[:b], k_cache, v_cache, table, meta.token_rows[:b],
                                            meta.positions[:b], self.block_size, meta.num_splits)
        if meta.tile_seq is not None:
            triton_kernels.prefill_attention(q[b:], out[b:], k_cache, v_cache, table, meta.seq_rows,
                                             meta.query_start, meta.seq_lens, meta.tile_seq, meta.tile_start,
                                             self.block_size, self.block_m)
