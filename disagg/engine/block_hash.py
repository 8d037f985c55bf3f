"""The chained hash that names a full KV block, and a prompt's block hashes.

One function for the block manager (its prefix cache) and for anyone outside the engine who must
name the same blocks from token ids alone (the router, matching a prompt against the hashes a node
publishes). Plain Python: the router loads no torch."""

import hashlib
import struct
from collections.abc import Iterator


def chain_hash(prev_hash: int | None, token_ids: list[int] | tuple[int, ...]) -> int:
    """64 bits of sha256 over the previous block's hash and this block's tokens. Not Python's
    hash(): one can build a prefix that collides with someone else's under it, and then be served
    their KV (a hit checks the block's own tokens, not the blocks before it). The same in every
    process, so the disk tier finds blocks after a restart and the router names a node's blocks."""
    data = struct.pack(f"<Q{len(token_ids)}q", prev_hash or 0, *token_ids)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The hashes of the prompt's leading full blocks that a prefix cache may serve: as
    BlockManager.num_block_keys counts them, the last token is always computed, so a prompt of
    exactly n blocks can hit n - 1."""
    return list(LazyBlockHashes(token_ids, block_size))


class LazyBlockHashes:
    """prompt_block_hashes, each hashed when first read and kept: a lookup that stops at the first block
    a cache lacks hashes no further. A decode node weighs its prefill nodes' caches on each remote
    request's way to its Prefill call, where hashing all of a 16k prompt's blocks took about 1 ms."""

    def __init__(self, token_ids: list[int], block_size: int):
        self.token_ids = token_ids
        self.block_size = block_size
        self.count = max(0, len(token_ids) - 1) // block_size
        self.hashes: list[int] = []

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[int]:
        for i in range(self.count):
            if i == len(self.hashes):
                block = self.token_ids[i * self.block_size:(i + 1) * self.block_size]
                self.hashes.append(chain_hash(self.hashes[-1] if self.hashes else None, block))
            yield self.hashes[i]


def hashes_at(block_hashes: dict[int, LazyBlockHashes], token_ids: list[int], block_size: int) -> LazyBlockHashes:
    """The prompt's LazyBlockHashes at `block_size` from `block_hashes` (the prompt's, by block size), made
    and kept there the first time it is asked for: one prompt is weighed at each block size once."""
    if block_size not in block_hashes:
        block_hashes[block_size] = LazyBlockHashes(token_ids, block_size)
    return block_hashes[block_size]
