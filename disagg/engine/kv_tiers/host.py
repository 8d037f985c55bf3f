"""HostTier: a pool of KV blocks in host memory (pinned when the device is CUDA) under the
device pool, keyed by the prefix cache's chained block hashes (docs/ARCHITECTURE.md, "Engine (as
built)").

Each slot holds one block as [layers, 2, block_size, kv_heads, head_dim], contiguous, so a block
is one copy and one file. A block being copied in or out, or written to disk, is pinned (ref
count) and never evicted; ready, unpinned blocks are evicted least recently used first.
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch

from disagg.engine.kv_tiers.stats import TierStats


@dataclass
class HostBlock:
    slot: int
    token_ids: tuple[int, ...]  # a hit is checked against these, not the hash alone
    ready: bool = False  # its data is in place (False while a copy or a disk read fills it)
    ref_count: int = 1  # created pinned by whoever fills it


class HostTier:
    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool):
        self.kv = torch.empty(num_blocks, *block_shape, dtype=dtype, pin_memory=pin_memory)
        self.block_bytes = self.kv[0].nbytes
        self.blocks: OrderedDict[int, HostBlock] = OrderedDict()  # hash -> block, least recent first
        self.free_slots = list(range(num_blocks - 1, -1, -1))
        self.stats = TierStats()
        # Filled only when KV events are published (kv_events.py): hashes that entered or left `blocks`.
        self.changed_hashes: set[int] | None = None

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[0]


    @property
    def num_used(self) -> int:
        return len(self.blocks)

    @property
    def num_pinned(self) -> int:
        return sum(1 for b in self.blocks.values() if b.ref_count > 0)

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

    def lookup(self, h: int, token_ids: tuple[int, ...], filling_ok: bool = False) -> HostBlock | None:
        """A ready block for this hash and these tokens, made most recently used; None if absent.
        filling_ok: a block still being filled will do (the caller orders its read after the fill)."""
        block = self.blocks.get(h)
        if block is None or not (block.ready or filling_ok) or block.token_ids != token_ids:
            return None
        self.blocks.move_to_end(h)
        return block

    def allocate(self, h: int, token_ids: tuple[int, ...]) -> HostBlock | None:
        """A new pinned, not yet ready block for this hash; evicts the least recently used unpinned
        block if the pool is full. None if every block is pinned."""
        assert h not in self.blocks
        if not self.free_slots and not self._evict_one():
            return None
        block = HostBlock(self.free_slots.pop(), token_ids)
        self.blocks[h] = block
        self._note(h)
        return block

    def _evict_one(self) -> bool:
        for h, block in self.blocks.items():
            if block.ref_count == 0:
                del self.blocks[h]
                self.free_slots.append(block.slot)
                self.stats.evictions += 1
                self._note(h)
                return True
        return False

    def _note(self, h: int) -> None:
        if self.changed_hashes is not None:
            self.changed_hashes.add(h)

    def pin(self, block: HostBlock) -> None:
        block.ref_count += 1

    def unpin(self, block: HostBlock) -> None:
        assert block.ref_count > 0
        block.ref_count -= 1

    def drop(self, h: int) -> None:
        """Forget a block whose fill failed (it must be pinned only by the one who filled it)."""
        block = self.blocks.pop(h)
        assert block.ref_count == 1 and not block.ready
        self.free_slots.append(block.slot)
        self._note(h)
