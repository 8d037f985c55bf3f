"""GET /kv_events: the node's KV events as a stream, for a router (`disagg router --routing
cache_aware`) to know which prompts' blocks this node holds, and in which tier.

HTTP, not gRPC: decode and colocated nodes serve no gRPC (only prefill nodes do), and the router
knows them only by their HTTP address, which it health-checks already. One JSON object a line
(NDJSON): first a snapshot `{"type": "snapshot", "seq", "block_size", "hashes": {medium: [...]}}`
(medium "device", and "host" and "disk" where the node has those tiers), then a batch
`{"type": "events", "seq", "medium", "stored", "removed"}` whenever a tier changed, and a heartbeat
`{"type": "heartbeat", "seq"}` every HEARTBEAT_S when it did not, so that the router can tell a
quiet node from one that stopped publishing. A subscriber that falls behind is cut off; it
reconnects and starts from a new snapshot. The stream ends when the server shuts down
(`app.state.shutting_down`, set by serving.py), within a heartbeat.
"""

import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from disagg.engine.async_engine import AsyncEngine
from disagg.engine.kv_events import KVEventsLagged

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
MEDIA_TYPE = "application/x-ndjson"


def line(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


async def kv_events_response(engine: AsyncEngine, request: Request) -> StreamingResponse:
    subscription = await engine.subscribe_kv_events()

    async def lines() -> AsyncIterator[bytes]:
        try:
            snapshot = subscription.snapshot
            yield line({"type": "snapshot", "seq": snapshot.seq, "block_size": snapshot.block_size,
                        "hashes": snapshot.hashes})
            seq = snapshot.seq
            while not getattr(request.app.state, "shutting_down", False):
                batch = await subscription.next(HEARTBEAT_S)
                if batch is None:
                    yield line({"type": "heartbeat", "seq": seq})
                    continue
                seq = batch.seq
                yield line({"type": "events", "seq": batch.seq, "medium": batch.medium, "stored": batch.stored,
                            "removed": batch.removed})
        except KVEventsLagged as e:
            logger.warning("KV events subscriber cut off: %s; it will reconnect", e)
        finally:
            subscription.close()

    return StreamingResponse(lines(), media_type=MEDIA_TYPE)
