"""KV events: which block hashes a node's device prefix cache holds, for a router to route by.

After each turn of the engine loop in which the prefix cache changed, the engine thread publishes
one numbered batch (hashes stored, hashes removed). A subscriber first gets a snapshot (every hash
held, as of the batch numbered `seq`), then each later batch, in order. One that falls more than
`max_pending` batches behind is dropped (`KVEventsLagged`): it subscribes again and starts over
from a fresh snapshot, so a missed batch never leaves a stale view. The host and disk tiers are not
reported: a block only there is loaded rather than computed, but it is no device hit.

The publisher lives on the engine thread; a subscription belongs to its subscriber's event loop,
and batches reach it through that loop (`call_soon_threadsafe`), after its snapshot.
"""

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field

from disagg.engine.block_manager import BlockManager


@dataclass(frozen=True)
class KVSnapshot:
    seq: int  # the number of the last batch it includes
    block_size: int
    hashes: list[int]


@dataclass(frozen=True)
class KVEventBatch:
    seq: int  # one more than the batch (or snapshot) before it
    stored: list[int]
    removed: list[int]


class KVEventsLagged(Exception):
    """The subscriber fell too far behind; batches were dropped, so subscribe again."""


@dataclass
class KVEventSubscription:
    loop: asyncio.AbstractEventLoop
    max_pending: int
    snapshot: KVSnapshot | None = None  # set when subscribed
    pending: deque[KVEventBatch] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    lagged: bool = False
    closed: bool = False  # set by the subscriber when done; the publisher then forgets it

    def offer(self, batch: KVEventBatch) -> None:
        """On the subscriber's loop."""
        if len(self.pending) >= self.max_pending:
            self.lagged = True
        else:
            self.pending.append(batch)
        self.ready.set()

    async def next(self, timeout: float) -> KVEventBatch | None:
        """The next batch, or None when none came within `timeout` seconds."""
        if not self.pending and not self.lagged:
            self.ready.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ready.wait(), timeout)
        if self.lagged:
            raise KVEventsLagged(f"more than {self.max_pending} KV event batches were waiting unread")
        return self.pending.popleft() if self.pending else None

    def close(self) -> None:
        self.closed = True


class KVEventPublisher:
    """On the engine thread only. The block manager notes changed hashes while anyone subscribes."""

    def __init__(self, block_manager: BlockManager):
        self.block_manager = block_manager
        self.seq = 0
        self.subscribers: list[KVEventSubscription] = []

    def subscribe(self, subscription: KVEventSubscription) -> KVSnapshot:
        self.publish()  # what changed before this snapshot goes to the earlier subscribers only
        bm = self.block_manager
        if bm.changed_hashes is None:
            bm.changed_hashes = set()
        self.subscribers.append(subscription)
        return KVSnapshot(self.seq, bm.block_size, list(bm.hash_to_block))

    def publish(self) -> None:
        bm = self.block_manager
        self.subscribers = [s for s in self.subscribers if not s.closed]
        if not self.subscribers:
            bm.changed_hashes = None  # nobody listens: note nothing
            return
        if not bm.changed_hashes:
            return
        changed, bm.changed_hashes = bm.changed_hashes, set()
        self.seq += 1
        held = bm.hash_to_block
        batch = KVEventBatch(self.seq, [h for h in changed if h in held], [h for h in changed if h not in held])
        for subscription in self.subscribers:
            try:
                subscription.loop.call_soon_threadsafe(subscription.offer, batch)
            except RuntimeError:  # its event loop is closed: nobody reads it any more
                subscription.closed = True
