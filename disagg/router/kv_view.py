"""What the router knows of one decode node's KV: the block hashes each of its tiers holds (the view
is engine/kv_view.py's, which decode nodes share), followed from the node's GET /kv_events stream
(disagg/api/kv_events.py).

The view is live only between a snapshot and the end of its stream: a stream that breaks, skips a
sequence number or stays silent past KV_EVENTS_SILENCE_S (the node sends a heartbeat every second)
empties the view, and the router reconnects for a fresh snapshot. An empty view matches nothing, so
a node that stopped publishing is scored by its load alone.

Beside what the node published, the view holds what the router sent it (`routed`): a prompt's blocks
count as held on the node it went to for ROUTED_TTL_S, as SGLang's router inserts a request's prefix
into its worker's tree at routing time. Until then the node's events could not say so (its blocks
are stored only once the prompt is computed), and the later uses of a prefix that arrive while its
first use is being computed would be taken for new prompts and spread over the nodes.
"""

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import httpx

from disagg.engine import kv_view as engine_kv_view
from disagg.engine.kv_view import KVEventsError

logger = logging.getLogger(__name__)

KV_EVENTS_SILENCE_S = 5.0  # no line for this long: the node stopped publishing
KV_EVENTS_RETRY_S = 1.0  # between attempts to (re)subscribe
# A prompt routed to a node counts as held there this long: its first token, and the node's events
# of its blocks, come well within it unless the node is overloaded, when load decides anyway.
ROUTED_TTL_S = 10.0
ROUTED_MAX = 1 << 16  # routed hashes kept per node (1M prompt tokens at 16 a block, ~7 MB), the oldest dropped first


@dataclass
class CacheView(engine_kv_view.CacheView):
    """The shared view (engine/kv_view.py), fed the stream's JSON lines, and the prompts the router
    sent the node."""
    routed: dict[int, float] = field(default_factory=dict)  # hash -> when it stops counting, oldest first

    def expect(self, block_hashes: list[int], now: float | None = None) -> None:
        """A prompt of these blocks was sent to the node: count them as held for ROUTED_TTL_S."""
        now = time.monotonic() if now is None else now
        for h in block_hashes:
            self.routed.pop(h, None)  # to the end: the dict stays in expiry order
            self.routed[h] = now + ROUTED_TTL_S
        while self.routed and (len(self.routed) > ROUTED_MAX or next(iter(self.routed.values())) <= now):
            del self.routed[next(iter(self.routed))]

    def weight(self, block_hash: int) -> float:
        """As the shared view's, a block routed here within ROUTED_TTL_S counting as held on the device."""
        if self.routed.get(block_hash, 0.0) > time.monotonic():
            return engine_kv_view.MEDIUM_WEIGHTS["device"]
        return super().weight(block_hash)

    def apply(self, message: dict) -> None:
        """One line of the stream; raises KVEventsError when the view can no longer be trusted."""
        kind = message.get("type")
        if kind == "snapshot":
            self.snapshot(message["seq"], message["block_size"], message["hashes"])
            return
        if not self.live:
            raise KVEventsError(f"a {kind!r} line before the snapshot")
        if kind == "heartbeat":
            return
        if kind != "events":
            raise KVEventsError(f"unknown line type {kind!r}")
        self.events(message["seq"], message["medium"], message["stored"], message["removed"])


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
