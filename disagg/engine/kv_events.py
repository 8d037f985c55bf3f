"""KV events: which block hashes a node holds in each tier (its device prefix cache, and the host
and disk KV tiers when it has them), for a router to route by.

After each turn of the engine loop in which a tier changed, the engine thread publishes one
numbered batch per tier that changed (its medium, hashes stored, hashes removed), as vLLM's KV
events carry a `medium`. A subscriber first gets a snapshot (every hash each tier holds, as of the
batch numbered `seq`), then each later batch, in order. One that falls more than `max_pending`
batches behind is dropped (`KVEventsLagged`): it subscribes again and starts over from a fresh
snapshot, so a missed batch never leaves a stale view. A host block counts from when its copy
starts (it is dropped if that fails), a disk block once its file is written.

The publisher lives on the engine thread; a subscription belongs to its subscriber's event loop,
and batches reach it through that loop (`call_soon_threadsafe`), after its snapshot.
"""

import asyncio
import contextlib
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from disagg.engine.block_manager import BlockManager
from disagg.engine.kv_tiers.disk import DiskTier
from disagg.engine.kv_tiers.host import HostTier
from disagg.engine.kv_tiers.offload import KVOffload


@dataclass(frozen=True)
class KVSnapshot:
    seq: int  # the number of the last batch it includes
    block_size: int
    hashes: dict[str, list[int]]  # medium ("device", "host", "disk") -> every hash that tier holds


@dataclass(frozen=True)
class KVEventBatch:
    seq: int  # one more than the batch (or snapshot) before it
    medium: str  # the tier it is of: "device", "host" or "disk"
    stored: list[int]
    removed: list[int]


@dataclass
class Medium:
    """One tier as the publisher reads it: `index` is its own collection of the hashes it holds (the
    same object for its life), and `owner.changed_hashes` notes what entered or left it while anyone
    subscribes (None: note nothing)."""
    name: str
    owner: BlockManager | HostTier | DiskTier
    index: Collection[int]


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
    """On the engine thread only. Each tier (the block manager, the host and disk tiers) notes changed
    hashes while anyone subscribes."""

    def __init__(self, block_manager: BlockManager, offload: KVOffload | None = None):
        self.block_size = block_manager.block_size
        self.media = [Medium("device", block_manager, block_manager.hash_to_block)]
        if offload is not None:
            self.media.append(Medium("host", offload.host, offload.host.blocks))
            if offload.disk is not None:
                self.media.append(Medium("disk", offload.disk, offload.disk.files))
        self.seq = 0
        self.subscribers: list[KVEventSubscription] = []

    def subscribe(self, subscription: KVEventSubscription) -> KVSnapshot:
        self.publish()  # what changed before this snapshot goes to the earlier subscribers only
        for medium in self.media:
            if medium.owner.changed_hashes is None:
                medium.owner.changed_hashes = set()
        self.subscribers.append(subscription)
        return KVSnapshot(self.seq, self.block_size, {medium.name: list(medium.index) for medium in self.media})

    def publish(self) -> None:
        self.subscribers = [s for s in self.subscribers if not s.closed]
        for medium in self.media:
            owner = medium.owner
            if not self.subscribers:
                owner.changed_hashes = None  # nobody listens: note nothing
                continue
            if not owner.changed_hashes:
                continue
            changed, owner.changed_hashes = owner.changed_hashes, set()
            self.seq += 1
            held = medium.index
            batch = KVEventBatch(self.seq, medium.name, [h for h in changed if h in held],
                                 [h for h in changed if h not in held])
            for subscription in self.subscribers:
                try:
                    subscription.loop.call_soon_threadsafe(subscription.offer, batch)
                except RuntimeError:  # its event loop is closed: nobody reads it any more
                    subscription.closed = True
