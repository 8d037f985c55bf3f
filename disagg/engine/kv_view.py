"""What a follower of a node's KV events (kv_events.py) knows of that node's prefix cache: the
block hashes it holds, live only between a snapshot and the end of the stream it came on. The
router follows decode nodes (router/kv_view.py), a decode node its prefill nodes (Watch); both match
a prompt's block hashes (block_hash.py) against it. Plain Python: the router loads no torch.

A gap in the batches' numbers, or a broken stream, drops the view; an empty view matches nothing,
so a node that stopped publishing is weighed by its load alone until a new snapshot comes.
"""

from dataclasses import dataclass, field


class KVEventsError(Exception):
    """The stream said something the view cannot follow (a gap in its sequence, a bad message)."""


@dataclass
class CacheView:
    block_size: int = 0  # 0: no snapshot yet
    hashes: set[int] = field(default_factory=set)
    seq: int = 0
    live: bool = False
    reason: str = "not subscribed yet"  # why it is not live, for /health

    def snapshot(self, seq: int, block_size: int, hashes: list[int]) -> None:
        self.block_size = int(block_size)
        self.hashes = set(hashes)
        self.seq = int(seq)
        self.live, self.reason = True, ""

    def events(self, seq: int, stored: list[int], removed: list[int]) -> None:
        """One batch; raises KVEventsError when the view can no longer be trusted."""
        if not self.live:
            raise KVEventsError("a batch before the snapshot")
        if seq != self.seq + 1:
            raise KVEventsError(f"batch {seq} after {self.seq}: batches were missed")
        self.seq = seq
        self.hashes.update(stored)
        self.hashes.difference_update(removed)

    def drop(self, reason: str) -> None:
        self.hashes = set()
        self.live, self.reason = False, reason

    def matched_blocks(self, block_hashes: list[int]) -> int:
        """How many of the prompt's leading blocks the node holds (a chained hash names its whole prefix)."""
        if not self.live:
            return 0
        for i, h in enumerate(block_hashes):
            if h not in self.hashes:
                return i
        return len(block_hashes)
