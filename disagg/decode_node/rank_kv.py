"""A decode node's tensor-parallel ranks receiving their own KV heads (docs/ARCHITECTURE.md, "Tensor
parallelism").

Each worker rank runs a lookup-buffer consumer of its own in its process (`serve_rank`, the engine's
`rank_service`), on a pipe endpoint of its own, which the decode node registers with every prefill
node. For a request whose blocks are reserved, the prefill node sends each rank an entry of that
rank's KV heads only (`rank_entry_id`), and each receives it straight into the rows of those blocks
in its own KV cache: no rank's KV passes through another process.

The driver (rank 0, where the decode node runs) tells each worker what to expect, waits for its
entries and discards them over the channel the engine gave it (`RankReceivers`, by `RankCalls`); a worker's receiver
answers on its own threads, beside the rank's steps. A rank whose process dies fails every call
waiting on it at once.
"""

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from disagg import metrics
from disagg.config import KVTransferConfig
from disagg.control_plane import HeadsEntry, KVRank
from disagg.lookup_buffer import LookupBufferConsumer
from disagg.pipes.base import PipeConfig
from disagg.pipes.row_scatter import RowScatter
from disagg.rank_calls import QUICK_CALL_S, Call, RankCalls, RankGone, answer_calls

logger = logging.getLogger(__name__)

ADDRESS_TIMEOUT_S = 30.0  # a worker sends its endpoint as soon as its KV cache is built, before the engine starts


@dataclass
class Expect:
    """Receive each entry into the rows of tokens [start, end) of these blocks (KVCache.rows), within
    its KV heads of the rank's cache (`heads[i]`, [first, end) counted from the rank's first; None: all
    of them)."""
    entry_ids: list[str]
    heads: list[tuple[int, int] | None]
    blocks: list[int]
    start: int
    end: int


@dataclass
class Select:
    """Wait (bounded, all of them together) for the entries, each verified against the prompt's tokens,
    as drop_select does."""
    entry_ids: list[str]
    token_ids: list[int]
    timeout: float
    source: tuple[str, int] | None


@dataclass
class Discard:
    entry_ids: list[str]


@dataclass
class Reply:
    number: int
    received_bytes: int  # KV bytes the rank's consumer has received in all, so far
    error: str | None = None  # why the call failed: the entry will not be in the blocks
    in_place: bool = True  # Select: the entries landed in the blocks
    peer_may_write: bool = False  # Discard: a peer may still write into the blocks


def within_rank(heads: tuple[int, int], rank_heads: tuple[int, int]) -> tuple[int, int] | None:
    """KV heads [first, end) of the model as the cache of a rank holding `rank_heads` counts them (a
    RowScatter's `heads`); None: all it holds."""
    first, end = rank_heads
    return None if heads == (first, end) else (heads[0] - first, heads[1] - first)


def rank_service_for(kv: KVTransferConfig) -> Callable:
    """The engine's rank_service for a decode node with these pipe settings (picklable: it goes to each
    worker's process)."""
    return functools.partial(serve_rank, kv.kv_connector, kv.pipe_config(), kv.extra("buffer_ttl"),
                             int(kv.kv_buffer_size))


def serve_rank(pipe_name: str, config: PipeConfig, ttl: float, kv_buffer_size: int, rank: int, kv_cache,
               channel) -> None:
    """The engine's rank_service on a worker rank (bound to the node's pipe settings with partial):
    a consumer on an endpoint of its own (an ephemeral port on the node's kv_ip), whose address goes
    to the driver first, then one thread answering the driver's calls."""
    received = [0]

    def count(nbytes: int) -> None:
        received[0] += nbytes

    consumer = LookupBufferConsumer(pipe_name, replace(config, kv_port=0), ttl=ttl, kv_buffer_size=kv_buffer_size,
                                    on_received=count, device=kv_cache.kv.device)
    channel.send(consumer.address)
    logger.info("tensor-parallel rank %d receives its KV heads on %s:%d", rank, *consumer.address)
    threading.Thread(target=RankReceiver(consumer, kv_cache, channel, received).serve, name=f"kv-rank{rank}",
                     daemon=True).start()


class RankReceiver:
    """A worker's side: the driver's calls onto its consumer. Select waits on a thread of its own, so
    that other requests' calls go on meanwhile."""

    def __init__(self, consumer: LookupBufferConsumer, kv_cache, channel, received: list[int]):
        self.consumer = consumer
        self.kv_cache = kv_cache
        self.channel = channel
        self.received = received  # [bytes], counted by the consumer's receiver threads
        self.lock = threading.Lock()  # one reply at a time on the channel

    def serve(self) -> None:
        answer_calls(self.channel, self._handle, self._failed, self.consumer.close)

    def _failed(self, call: Call, e: Exception) -> None:
        self._reply(Reply(call.number, self.received[0], error=f"{type(e).__name__}: {e}"))

    def _handle(self, call: Call) -> None:
        message = call.message
        if isinstance(message, Select):
            threading.Thread(target=self._select, args=(call.number, message), daemon=True).start()
        elif isinstance(message, Expect):
            rows = self.kv_cache.rows(message.blocks, message.start, message.end)
            for entry_id, heads in zip(message.entry_ids, message.heads):
                self.consumer.expect(entry_id, [RowScatter(self.kv_cache.kv, rows, heads)])
            self._reply(Reply(call.number, self.received[0]))
        else:
            for entry_id in message.entry_ids:
                self.consumer.discard(entry_id)
            self._reply(Reply(call.number, self.received[0], peer_may_write=any(
                self.consumer.peer_may_write(entry_id) for entry_id in message.entry_ids)))

    def _select(self, number: int, select: Select) -> None:
        deadline = time.monotonic() + select.timeout
        try:
            in_place = True
            for entry_id in select.entry_ids:
                timeout = max(0.0, deadline - time.monotonic())
                entry = self.consumer.drop_select(entry_id, select.token_ids, timeout, select.source)
                in_place = in_place and entry.in_place
            reply = Reply(number, self.received[0], in_place=in_place)
        except Exception as e:  # noqa: BLE001  any reason the KV will not be there goes to the driver
            reply = Reply(number, self.received[0], error=f"{type(e).__name__}: {e}")
        self._reply(reply)

    def _reply(self, reply: Reply) -> None:
        with self.lock:
            with contextlib.suppress(OSError):  # the driver is gone
                self.channel.send(reply)


class RankReceivers:
    """The driver's side: each worker rank's receiver, by the channel the engine opened to it."""

    def __init__(self, channels: list, kv_heads: list[tuple[int, int]], kv_ip: str):
        """channels: rank r's at index r - 1; kv_heads: every rank's [first, end), rank 0's first."""
        self.kv_heads = kv_heads
        self.endpoints: list[tuple[str, int]] = []
        for rank, channel in enumerate(channels, 1):
            if not channel.poll(ADDRESS_TIMEOUT_S):
                raise RankGone(f"tensor-parallel rank {rank} sent no KV endpoint within {ADDRESS_TIMEOUT_S}s")
            self.endpoints.append((kv_ip, channel.recv()[1]))
        self.received = [0] * len(channels)  # bytes each worker reported, counted into the metrics
        self.calls = RankCalls(channels, self._count)
        self.calls.start()

    def kv_ranks(self, kv_dest: tuple[str, int]) -> list[KVRank]:
        """Every rank's endpoint and heads, for a Prefill call; rank 0's endpoint is kv_dest."""
        return [KVRank(dest, heads) for dest, heads in zip([kv_dest, *self.endpoints], self.kv_heads)]

    async def expect(self, entries: list[HeadsEntry], blocks: list[int], start: int, end: int) -> None:
        """Each worker receives its entries of the request (plan_entries') into the rows of tokens
        [start, end) of these blocks, each within its heads."""
        def expect(rank: int, mine: list[HeadsEntry]) -> Expect:
            return Expect([e.entry_id for e in mine], [within_rank(e.heads, self.kv_heads[rank]) for e in mine],
                          blocks, start, end)
        await self.calls.each({rank: expect(rank, mine) for rank, mine in self._by_rank(entries).items()},
                              QUICK_CALL_S)

    async def drop_select(self, entries: list[HeadsEntry], token_ids: list[int], timeout: float,
                          source: tuple[str, int] | None) -> None:
        """Returns once every worker's entries are in its blocks; raises why one's are not (the first)."""
        replies = await self.calls.each({rank: Select([e.entry_id for e in mine], token_ids, timeout, source)
                                         for rank, mine in self._by_rank(entries).items()}, timeout + QUICK_CALL_S)
        if not all(reply.in_place for reply in replies.values()):
            raise RuntimeError(f"a rank's KV of {entries[0].entry_id} did not land in its blocks")

    async def discard(self, entries: list[HeadsEntry]) -> bool:
        """Each worker drops its entries of the request and lets go of its blocks; True if a peer may still
        write into them (PeerMayWrite on a rank). A rank that is gone writes nothing."""
        replies = await asyncio.gather(*(self.calls.call(rank, Discard([e.entry_id for e in mine]), QUICK_CALL_S)
                                         for rank, mine in self._by_rank(entries).items()), return_exceptions=True)
        return any(isinstance(reply, Reply) and reply.peer_may_write for reply in replies)

    @staticmethod
    def _by_rank(entries: list[HeadsEntry]) -> dict[int, list[HeadsEntry]]:
        """The workers' entries (decode rank 1 on), by rank."""
        by_rank: dict[int, list[HeadsEntry]] = {}
        for entry in entries:
            if entry.decode_rank > 0:
                by_rank.setdefault(entry.decode_rank, []).append(entry)
        return by_rank

    def _count(self, rank: int, reply: Reply) -> None:
        delta, self.received[rank - 1] = reply.received_bytes - self.received[rank - 1], reply.received_bytes
        metrics.KV_RANK_BYTES.labels(str(rank)).inc(delta)
        metrics.KV_BYTES.labels("received").inc(delta)
