"""The chained hash that names a full KV block, and a prompt's block hashes.

One function for the block manager (its prefix cache) and for anyone outside the engine who must
name the same blocks from token ids alone (the router, matching a prompt against the hashes a node
publishes). Plain Python: the router loads no torch."""

import hashlib
import struct


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
    hashes: list[int] = []
    for i in range(max(0, len(token_ids) - 1) // block_size):
        hashes.append(chain_hash(hashes[-1] if hashes else None, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes
