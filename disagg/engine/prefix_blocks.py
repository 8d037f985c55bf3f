"""PrefixBlocks: prefix-cache blocks copied out of this engine, or put into it, by hash (prefix pull
between prefill nodes; docs/ARCHITECTURE.md, "Prefix pull").

`export` copies the KV of the leading blocks held under a run of chained hashes, for a peer that
lacks them. `insert` puts KV that arrived from a peer into free blocks under the hashes of this
engine's own tokens (a block's hash is computed here, from the tokens, never taken from the peer),
registers them in the prefix cache and lets go of them: a prompt that starts with those tokens then
hits them, as it would blocks computed here. Both run on the engine thread, between steps.
"""

import torch

from disagg.engine.block_hash import chain_hash
from disagg.engine.block_manager import BlockManager
from disagg.engine.kv_cache import KVCache
from disagg.engine.kv_tiers.offload import KVOffload


class PrefixBlocks:
    def __init__(self, kv_cache: KVCache, block_manager: BlockManager, offload: KVOffload | None):
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.offload = offload  # lazy: a block evicted for an insert is copied out before it is written

    def held(self, token_ids: list[int], limit: int) -> int:
        """How many of the prompt's first `limit` full blocks the prefix cache holds, leading ones."""
        bm, size = self.block_manager, self.block_manager.block_size
        h, held = None, 0
        for i in range(limit):
            tokens = tuple(token_ids[i * size:(i + 1) * size])
            h = chain_hash(h, tokens)
            block_id = bm.hash_to_block.get(h)
            if block_id is None or bm.blocks[block_id].token_ids != tokens:
                break
            held += 1
        return held

    def export(self, hashes: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """The tokens and a copy of the KV, [layers, 2, tokens, kv heads, head dim], of the leading
        blocks held under `hashes` (up to the first one not held); ([], None) when none is."""
        bm = self.block_manager
        block_ids = []
        for h in hashes:
            block_id = bm.hash_to_block.get(h)
            if block_id is None:
                break
            block_ids.append(block_id)
        if not block_ids:
            return [], None
        tokens = [t for block_id in block_ids for t in bm.blocks[block_id].token_ids]
        kv = self.kv_cache.kv[:, :, self.kv_cache.slots(block_ids, len(tokens))]  # a copy: the blocks may be reused
        if kv.is_cuda:
            torch.cuda.current_stream(kv.device).synchronize()  # the pipe's thread reads it
        return tokens, kv

    def insert(self, token_ids: list[int], first: int, kv: torch.Tensor) -> int:
        """Cache the KV of blocks first, first + 1, ... of a prompt (kv holds their tokens, in whole
        blocks; token_ids the prompt up to their end at least). Blocks cached already are kept; stops
        when no block is free. Returns how many were put in."""
        bm, size = self.block_manager, self.block_manager.block_size
        count = kv.shape[2] // size
        if kv.shape[2] != count * size or len(token_ids) < (first + count) * size:
            raise ValueError(f"KV of {kv.shape[2]} tokens from block {first} does not fit whole blocks "
                             f"of a prompt of {len(token_ids)} tokens")
        h = None
        for i in range(first):
            h = chain_hash(h, token_ids[i * size:(i + 1) * size])
        taken = []
        for i in range(first, first + count):
            tokens = tuple(token_ids[i * size:(i + 1) * size])
            h = chain_hash(h, tokens)
            if h in bm.hash_to_block:
                continue
            if not bm.num_free_blocks:
                break
            taken.append((bm.take_free(), i - first, h, tokens))
        if self.offload is not None:
            self.offload.store_new()  # lazy: what the blocks held goes to the host tier before it is overwritten
        for block_id, i, h, tokens in taken:
            self.kv_cache.scatter([block_id], kv[:, :, i * size:(i + 1) * size])
            bm.cache_block(block_id, h, tokens)
            if bm.newly_cached is not None:  # eager: the host tier copies it too
                bm.newly_cached.append(block_id)
            bm.release(block_id)  # free and cached, most recently used: the prompt's allocation takes it back
        return len(taken)
