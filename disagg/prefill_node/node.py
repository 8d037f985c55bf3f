"""PrefillNode: computes prompts and pushes their KV to the decode node that asked.

A Prefill call runs the prompt through the engine for exactly one token (prefix-cache hits
skip what is cached), takes the prompt's KV out of the paged cache, inserts it into the
LookupBuffer producer addressed to the caller's pipe endpoint and answers with the first
token. Insert only queues the bytes: the engine never waits on the network.
"""

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict

from disagg import metrics
from disagg.control_plane import NodeInfo, PrefillCall, PrefillProgress, PrefillResult
from disagg.engine.async_engine import AsyncEngine
from disagg.lookup_buffer import LookupBufferProducer, token_digest

logger = logging.getLogger(__name__)

MAX_REGISTERED_DESTINATIONS = 1024  # decode nodes' pipe endpoints remembered, least recently used dropped


class PrefillNode:
    def __init__(self, engine: AsyncEngine, producer: LookupBufferProducer, info: NodeInfo,
                 kv_buffer_device: str = "cpu"):
        self.engine = engine
        self.producer = producer
        self.info = info
        self.kv_buffer_device = kv_buffer_device
        self.callers: dict[str, tuple[str, int]] = {}  # request id -> the kv_dest of the call computing it
        # Pipe endpoints decode nodes registered at their Info handshake: the only places KV goes,
        # so a caller cannot make this node connect anywhere it likes.
        self.destinations: OrderedDict[tuple[str, int], None] = OrderedDict()

    async def prefill(self, call: PrefillCall) -> PrefillResult:
        start = time.perf_counter()
        # Only the first token is sampled here; stop rules and lengths are the decode node's.
        params = dataclasses.replace(call.params, max_tokens=1, min_tokens=min(call.params.min_tokens, 1), stop=[])
        if params.structured is not None:  # compiled here, off the engine thread, which then finds it cached
            await asyncio.to_thread(self.engine.engine.grammars.compile, params.structured)
        final = None
        self.callers[call.request_id] = call.kv_dest
        try:
            async for out in self.engine.generate(call.request_id, call.prompt_token_ids, params, export_kv=True):
                final = out
        finally:
            self.callers.pop(call.request_id, None)
        computed = time.perf_counter()
        metrics.PREFILL_COMPUTE.observe(computed - start)
        if final is None or final.kv is None:
            raise RuntimeError(f"prefill of {call.request_id} ended without KV ({final and final.finish_reason})")
        kv = final.kv[:, :, call.skip_tokens:]  # the decode node holds the rest
        kv = (kv if self.kv_buffer_device == "cuda" else kv.cpu()).contiguous()
        # Insert may wait (bounded) for buffer space: keep that off the event loop.
        await asyncio.to_thread(self.producer.insert, call.request_id, call.prompt_token_ids, [kv],
                                None, call.kv_dest)
        metrics.KV_BUFFER_INSERT.observe(time.perf_counter() - computed)
        seconds = time.perf_counter() - start
        metrics.KV_BYTES.labels("sent").inc(kv.nbytes)
        logger.info("prefill %s: %d prompt tokens (%d cached), %.1f KiB KV to %s:%d in %.3fs",
                    call.request_id, len(call.prompt_token_ids), final.num_cached_tokens,
                    kv.nbytes / 1024, *call.kv_dest, seconds)
        return PrefillResult(
            first_token=final.token_ids[0],
            first_logprob=final.logprobs[0] if final.logprobs else None,
            token_digest=token_digest(call.prompt_token_ids),
            num_cached_tokens=final.num_cached_tokens,
            kv_bytes=kv.nbytes,
            prefill_seconds=seconds,
        )

    def register(self, dest: tuple[str, int]) -> None:
        self.destinations[dest] = None
        self.destinations.move_to_end(dest)
        if len(self.destinations) > MAX_REGISTERED_DESTINATIONS:
            self.destinations.popitem(last=False)

    def is_registered(self, dest: tuple[str, int]) -> bool:
        return dest in self.destinations

    def progress(self, request_id: str) -> PrefillProgress:
        """Read from the event loop while the engine thread runs: a snapshot for a heartbeat,
        not a synchronized view (both numbers only grow)."""
        engine = self.engine.engine
        request = engine.requests.get(request_id)
        return PrefillProgress(engine.num_steps, request.seq.num_computed_tokens if request else 0)

    async def abort(self, request_id: str, caller: tuple[str, int]) -> bool:
        """Drop a request, only for the decode node (by its pipe endpoint) that asked for it."""
        in_engine = self.callers.get(request_id) == caller and await self.engine.abort(request_id)
        in_buffer = self.producer.abort(request_id, caller)
        return in_engine or in_buffer
