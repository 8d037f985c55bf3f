"""BlockManager: the pool of KV blocks, ref counts, and the prefix cache.

A full block is known by a chained hash that covers every token before it too, so two
requests share a block only when their whole prefix up to it is equal. A block whose last
user finished stays in the cache while free; free blocks are reused least recently used
first, and a cached block hit again is taken back out of the free list.

With KV tiers (docs/ARCHITECTURE.md, "Engine (as built)") the manager also lists the blocks the
tiers must copy: newly cached ones (`eager`) or evicted ones (`lazy`), and lends blocks to them.
For KV events (`kv_events.py`) it notes which hashes entered or left the prefix cache.
"""

import time
from collections import OrderedDict

from disagg.engine.block_hash import chain_hash
from disagg.engine.kv_tiers.stats import Latencies, TierStats
from disagg.engine.sequence import Sequence

# A block key: its chained hash and its own tokens.
BlockKey = tuple[int, tuple[int, ...]]


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # set while registered in the prefix cache
        self.token_ids: tuple[int, ...] = ()  # a hit is checked against these, not the hash alone


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.block_hashes: dict[str, list[int]] = {}  # request id -> chained hashes of its full blocks
        # Filled only when KV tiers ask (KVOffload): block ids newly cached ("eager"), or blocks
        # evicted from the cache, with their key, before anything overwrites them ("lazy").
        self.newly_cached: list[int] | None = None
        self.evicted: list[tuple[int, BlockKey]] | None = None
        # Filled only when KV events are published (AsyncEngine): hashes that entered or left the
        # prefix cache since the last publish. Only the hash: whether it is in now says which.
        self.changed_hashes: set[int] | None = None
        self.stats = TierStats()  # lookups and hits of admitted sequences
        self.allocation_latency = Latencies()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def num_block_keys(self, seq: Sequence) -> int:
        """How many of the sequence's leading full blocks a cache may serve. At least one token is
        always left to compute, since the last position's logits pick the next token. A sequence
        still to score its prompt gets none: it needs the logits of every prompt position."""
        if not self.enable_prefix_caching or seq.scores_prompt:
            return 0
        return (seq.num_tokens - 1) // self.block_size

    def block_key(self, seq: Sequence, i: int) -> BlockKey:
        """The key of the sequence's block i, hashed (with the ones before it) only when first
        asked for and kept on the sequence: a full block's tokens never change, waiting sequences
        are looked up every step, and a lookup that stops early need not hash a long prompt."""
        keys = seq.block_keys
        for j in range(len(keys), i + 1):
            tokens = tuple(seq.token_ids[j * self.block_size:(j + 1) * self.block_size])
            keys.append((chain_hash(keys[-1][0] if keys else None, tokens), tokens))
        return keys[i]

    def block_keys(self, seq: Sequence, limit: int | None = None) -> list[BlockKey]:
        """The keys of the blocks a cache may serve (the first `limit` of them)."""
        count = self.num_block_keys(seq) if limit is None else min(limit, self.num_block_keys(seq))
        if count:
            self.block_key(seq, count - 1)
        return seq.block_keys[:count]

    def prefix_hits(self, seq: Sequence) -> list[int]:
        """The sequence's leading cached blocks, up to the first miss (hashed no further)."""
        hits = []
        for i in range(self.num_block_keys(seq)):
            h, tokens = self.block_key(seq, i)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self.prefix_hits(seq)
        in_use = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return self.blocks_for(seq.num_tokens) - in_use <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give the sequence blocks for all its tokens, reusing prefix-cache hits."""
        assert not seq.block_table
        start = time.perf_counter()
        hits = self.prefix_hits(seq)
        self.stats.lookups += len(hits) + (len(hits) < self.num_block_keys(seq))
        self.stats.hits += len(hits)
        for block_id in hits:
            self._take(block_id)
        # In ascending order: blocks freed together come back in descending order (tail first), and
        # adjacent rows make one run for a copy or a receive into the blocks instead of one per block.
        seq.block_table = hits + sorted(self.take_free() for _ in range(self.blocks_for(seq.num_tokens) - len(hits)))
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        self.block_hashes[seq.request_id] = [self.blocks[b].hash for b in hits]
        self.allocation_latency.observe(time.perf_counter() - start)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        seq.block_table.extend(self.take_free() for _ in range(needed))

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's newly computed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self.block_hashes[seq.request_id]
        for i in range(seq.num_hashed_blocks, seq.num_computed_tokens // self.block_size):
            if i < len(seq.block_keys):  # hashed already by a lookup (block_keys)
                h, tokens = seq.block_keys[i]
            else:
                tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                h = chain_hash(hashes[-1] if hashes else None, tokens)
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            # Another request may have computed the same block first: keep that one cached.
            if self.cache_block(block.block_id, h, tokens) and self.newly_cached is not None:
                self.newly_cached.append(block.block_id)
        seq.num_hashed_blocks = seq.num_computed_tokens // self.block_size

    def cache_block(self, block_id: int, h: int, token_ids: tuple[int, ...]) -> bool:
        """Register a block whose KV is in place under its key; False if another block has it."""
        if h in self.hash_to_block:
            return False
        block = self.blocks[block_id]
        block.hash, block.token_ids = h, token_ids
        self.hash_to_block[h] = block_id
        if self.changed_hashes is not None:
            self.changed_hashes.add(h)
        return True

    def free(self, seq: Sequence) -> None:
        # Tail first, so the end of a sequence is evicted before the prefix others may share.
        for block_id in reversed(seq.block_table):
            self.release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_hashed_blocks = 0
        self.block_hashes.pop(seq.request_id, None)

    def release(self, block_id: int) -> None:
        """Drop one reference; a block nobody holds goes back to the free list."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_ids[block_id] = None
            if block.hash is None:
                self.free_ids.move_to_end(block_id, last=False)  # nothing to keep: reuse first

    def hold(self, block_id: int) -> None:
        """One more reference (a copy out of the block is in flight): it is not reused meanwhile."""
        self._take(block_id)

    def _take(self, block_id: int) -> int:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_ids[block_id]
        block.ref_count += 1
        return block_id

    def take_free(self) -> int:
        """The least recently used free block, evicted from the prefix cache, with one reference."""
        block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict it from the prefix cache
            if self.evicted is not None:
                self.evicted.append((block_id, (block.hash, block.token_ids)))
            del self.hash_to_block[block.hash]
            if self.changed_hashes is not None:
                self.changed_hashes.add(block.hash)
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id
