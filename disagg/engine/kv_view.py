"""What a follower of a node's KV events (kv_events.py) knows of that node's KV: the block hashes
each of its tiers holds (device, host, disk), live only between a snapshot and the end of the
stream it came on. The router follows decode nodes (router/kv_view.py), a decode node its prefill
nodes (Watch); both match a prompt's block hashes (block_hash.py) against it. Plain Python: the
router loads no torch.

A prompt's leading blocks held in any tier count, each by its tier's weight (MEDIUM_WEIGHTS): a
device block is not computed at all, a host block is copied in instead of computed, a disk block
read (a decode node's remote request takes host hits only, and on a GPU a disk read can be slower
than computing the block).

A gap in the batches' numbers, or a broken stream, drops the view; an empty view matches nothing,
so a node that stopped publishing is weighed by its load alone until a new snapshot comes.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field

MEDIUM_WEIGHTS = {"device": 1.0, "host": 0.5, "disk": 0.25}  # what a block held there is worth


class KVEventsError(Exception):
    """The stream said something the view cannot follow (a gap in its sequence, a bad message)."""


@dataclass
class CacheView:
    block_size: int = 0  # 0: no snapshot yet
    hashes: dict[str, set[int]] = field(default_factory=dict)  # medium -> the hashes that tier holds
    seq: int = 0
    live: bool = False
    reason: str = "not subscribed yet"  # why it is not live, for /health

    def snapshot(self, seq: int, block_size: int, hashes: dict[str, list[int]]) -> None:
        self.block_size = int(block_size)
        self.hashes = {medium: set(held) for medium, held in hashes.items()}
        self.seq = int(seq)
        self.live, self.reason = True, ""

    def events(self, seq: int, medium: str, stored: list[int], removed: list[int]) -> None:
        """One batch, of one tier; raises KVEventsError when the view can no longer be trusted."""
        if not self.live:
            raise KVEventsError("a batch before the snapshot")
        if seq != self.seq + 1:
            raise KVEventsError(f"batch {seq} after {self.seq}: batches were missed")
        self.seq = seq
        held = self.hashes.setdefault(medium, set())
        held.update(stored)
        held.difference_update(removed)

    def drop(self, reason: str) -> None:
        self.hashes = {}
        self.live, self.reason = False, reason

    def leading_blocks(self, block_hashes: Iterable[int], medium: str = "device") -> int:
        """How many of the prompt's leading blocks the node holds in one tier."""
        held = self.hashes.get(medium, set()) if self.live else set()
        count = 0
        for h in block_hashes:
            if h not in held:
                break
            count += 1
        return count

    def matched_blocks(self, block_hashes: Iterable[int]) -> float:
        """The prompt's leading blocks the node holds in any tier, each counted by its tier's weight
        (a chained hash names its whole prefix, so the count stops at the first block held nowhere)."""
        if not self.live:
            return 0.0
        matched = 0.0
        for h in block_hashes:
            weight = self.weight(h)
            if not weight:
                break
            matched += weight
        return matched

    def weight(self, block_hash: int) -> float:
        """What the node's holding one block is worth: its best tier's weight, 0 where none holds it."""
        return max((MEDIUM_WEIGHTS.get(medium, 0.0) for medium, held in self.hashes.items() if block_hash in held),
                   default=0.0)
