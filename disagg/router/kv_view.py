"""What the router knows of one decode node's KV: the block hashes each of its tiers holds (device,
host, disk), followed from the node's GET /kv_events stream (disagg/api/kv_events.py).

A prompt's leading blocks held in any tier count, each by its tier's weight (MEDIUM_WEIGHTS): a
device block is not computed at all, a host block is copied in instead of computed, a disk block
read (a decode node's remote request takes host hits only, and on a GPU a disk read can be slower
than computing the block).

The view is live only between a snapshot and the end of its stream: a stream that breaks, skips a
sequence number or stays silent past KV_EVENTS_SILENCE_S (the node sends a heartbeat every second)
empties the view, and the router reconnects for a fresh snapshot. An empty view matches nothing, so
a node that stopped publishing is scored by its load alone.
"""

import asyncio
import json
import logging
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger(__name__)

KV_EVENTS_SILENCE_S = 5.0  # no line for this long: the node stopped publishing
KV_EVENTS_RETRY_S = 1.0  # between attempts to (re)subscribe
MEDIUM_WEIGHTS = {"device": 1.0, "host": 0.5, "disk": 0.25}  # what a block held there is worth


class KVEventsError(Exception):
    """The stream said something the view cannot follow (a gap in its sequence, a bad line)."""


@dataclass
class CacheView:
    block_size: int = 0  # 0: no snapshot yet
    hashes: dict[str, set[int]] = field(default_factory=dict)  # medium -> the hashes that tier holds
    seq: int = 0
    live: bool = False
    reason: str = "not subscribed yet"  # why it is not live, for /health

    def apply(self, message: dict) -> None:
        """One line of the stream; raises KVEventsError when the view can no longer be trusted."""
        kind = message.get("type")
        if kind == "snapshot":
            self.block_size = int(message["block_size"])
            self.hashes = {medium: set(held) for medium, held in message["hashes"].items()}
            self.seq = int(message["seq"])
            self.live, self.reason = True, ""
            return
        if not self.live:
            raise KVEventsError(f"a {kind!r} line before the snapshot")
        if kind == "heartbeat":
            return
        if kind != "events":
            raise KVEventsError(f"unknown line type {kind!r}")
        if message["seq"] != self.seq + 1:
            raise KVEventsError(f"batch {message['seq']} after {self.seq}: batches were missed")
        self.seq = message["seq"]
        held = self.hashes.setdefault(message["medium"], set())
        held.update(message["stored"])
        held.difference_update(message["removed"])

    def drop(self, reason: str) -> None:
        self.hashes = {}
        self.live, self.reason = False, reason

    def matched_blocks(self, block_hashes: list[int]) -> float:
        """The prompt's leading blocks the node holds in any tier, each counted by its tier's weight
        (a chained hash names its whole prefix, so the count stops at the first block held nowhere)."""
        if not self.live:
            return 0.0
        matched = 0.0
        for h in block_hashes:
            weight = max((MEDIUM_WEIGHTS.get(medium, 0.0) for medium, held in self.hashes.items() if h in held),
                         default=0.0)
            if not weight:
                break
            matched += weight
        return matched


async def follow_kv_events(view: CacheView, url: str, client: httpx.AsyncClient, headers: dict[str, str]) -> None:
    """Keep `view` in step with the node's GET /kv_events at `url`, reconnecting for ever (cancel to stop)."""
    while True:
        try:
            async with client.stream("GET", url, headers=headers,
                                     timeout=httpx.Timeout(KV_EVENTS_SILENCE_S)) as response:
                if response.status_code != 200:
                    raise KVEventsError(f"GET /kv_events answered {response.status_code}")
                async for text in response.aiter_lines():
                    if text:
                        view.apply(json.loads(text))
                raise KVEventsError("the stream ended")
        except (httpx.HTTPError, KVEventsError, ValueError, KeyError, TypeError) as e:
            reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if view.live:
                logger.warning("KV events of %s stopped (%s); its cache view is dropped until it resubscribes",
                               url, reason)
            view.drop(reason)
        await asyncio.sleep(KV_EVENTS_RETRY_S)
