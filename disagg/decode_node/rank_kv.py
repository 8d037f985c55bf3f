"""A decode node's tensor-parallel ranks receiving their own KV heads (docs/ARCHITECTURE.md, "Tensor
parallelism").

Each worker rank runs a lookup-buffer consumer of its own in its process (`serve_rank`, the engine's
`rank_service`), on a pipe endpoint of its own, which the decode node registers with every prefill
node. For a request whose blocks are reserved, the prefill node sends each rank an entry of that
rank's KV heads only (`rank_entry_id`), and each receives it straight into the rows of those blocks
in its own KV cache: no rank's KV passes through another process.

The driver (rank 0, where the decode node runs) tells each worker what to expect, waits for its
entry and discards it over the channel the engine gave it (`RankReceivers`); a worker's receiver
answers on its own threads, beside the rank's steps. A rank whose process dies fails every call
waiting on it at once.
"""

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from disagg import metrics
from disagg.config import KVTransferConfig
from disagg.control_plane import KVRank, rank_entry_id
from disagg.lookup_buffer import LookupBufferConsumer
from disagg.pipes.base import PipeConfig
from disagg.pipes.row_scatter import RowScatter

logger = logging.getLogger(__name__)

ADDRESS_TIMEOUT_S = 30.0  # a worker sends its endpoint as soon as its KV cache is built, before the engine starts


@dataclass
class Expect:
    """Receive the entry into the rows of tokens [start, end) of these blocks (KVCache.rows)."""
    entry_id: str
    blocks: list[int]
    start: int
    end: int


@dataclass
class Select:
    """Wait (bounded) for the entry, verified against the prompt's tokens, as drop_select does."""
    entry_id: str
    token_ids: list[int]
    timeout: float
    source: tuple[str, int] | None


@dataclass
class Discard:
    entry_id: str


@dataclass
class Call:
    number: int
    message: Expect | Select | Discard


@dataclass
class Reply:
    number: int
    received_bytes: int  # KV bytes the rank's consumer has received in all, so far
    error: str | None = None  # why the call failed: the entry will not be in the blocks
    in_place: bool = True  # Select: the entry landed in the blocks
    peer_may_write: bool = False  # Discard: a peer may still write into the blocks


class RankGone(RuntimeError):
    """A worker rank's process ended: its KV cannot arrive."""


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
        while True:
            try:
                call: Call = self.channel.recv()
            except (EOFError, OSError):  # the driver is gone; the rank's step loop ends too
                self.consumer.close()
                return
            message = call.message
            if isinstance(message, Select):
                threading.Thread(target=self._select, args=(call.number, message), daemon=True).start()
            elif isinstance(message, Expect):
                rows = self.kv_cache.rows(message.blocks, message.start, message.end)
                self.consumer.expect(message.entry_id, [RowScatter(self.kv_cache.kv, rows)])
                self._reply(Reply(call.number, self.received[0]))
            else:
                self.consumer.discard(message.entry_id)
                self._reply(Reply(call.number, self.received[0],
                                  peer_may_write=self.consumer.peer_may_write(message.entry_id)))

    def _select(self, number: int, select: Select) -> None:
        try:
            entry = self.consumer.drop_select(select.entry_id, select.token_ids, select.timeout, select.source)
            reply = Reply(number, self.received[0], in_place=entry.in_place)
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
        self.channels = channels
        self.kv_heads = kv_heads
        self.endpoints: list[tuple[str, int]] = []
        for rank, channel in enumerate(channels, 1):
            if not channel.poll(ADDRESS_TIMEOUT_S):
                raise RankGone(f"tensor-parallel rank {rank} sent no KV endpoint within {ADDRESS_TIMEOUT_S}s")
            self.endpoints.append((kv_ip, channel.recv()[1]))
        self.numbers = itertools.count()
        self.calls: dict[int, tuple[int, asyncio.AbstractEventLoop, asyncio.Future]] = {}  # number -> rank, waiter
        self.received = [0] * len(channels)  # bytes each worker reported, counted into the metrics
        self.gone: dict[int, str] = {}  # rank -> why its calls fail
        self.lock = threading.Lock()
        self.readers = [threading.Thread(target=self._read, args=(rank, channel), name=f"kv-rank{rank}-replies",
                                         daemon=True) for rank, channel in enumerate(channels, 1)]
        for reader in self.readers:
            reader.start()

    def kv_ranks(self, kv_dest: tuple[str, int]) -> list[KVRank]:
        """Every rank's endpoint and heads, for a Prefill call; rank 0's endpoint is kv_dest."""
        return [KVRank(dest, heads) for dest, heads in zip([kv_dest, *self.endpoints], self.kv_heads)]

    async def expect(self, request_id: str, blocks: list[int], start: int, end: int) -> None:
        """Each worker receives its entry of the request into the rows of tokens [start, end) of these blocks."""
        await self._all(lambda r: Expect(rank_entry_id(request_id, r), blocks, start, end))

    async def drop_select(self, request_id: str, token_ids: list[int], timeout: float,
                          source: tuple[str, int] | None) -> None:
        """Returns once every worker's entry is in its blocks; raises why one's is not (the first)."""
        replies = await self._all(lambda r: Select(rank_entry_id(request_id, r), token_ids, timeout, source))
        if not all(reply.in_place for reply in replies):
            raise RuntimeError(f"a rank's KV of {request_id} did not land in its blocks")

    async def discard(self, request_id: str) -> bool:
        """Each worker drops the request's entry and lets go of its blocks; True if a peer may still write
        into them (PeerMayWrite on a rank). A rank that is gone writes nothing."""
        replies = await asyncio.gather(*(self._call(r, Discard(rank_entry_id(request_id, r)))
                                         for r in range(1, len(self.channels) + 1)), return_exceptions=True)
        return any(isinstance(reply, Reply) and reply.peer_may_write for reply in replies)

    async def _all(self, message) -> list[Reply]:
        """The same call to every worker; the first failure cancels the waits for the others (the caller
        discards the request, which ends them on the workers)."""
        tasks = [asyncio.ensure_future(self._call(r, message(r))) for r in range(1, len(self.channels) + 1)]
        try:
            return await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    async def _call(self, rank: int, message) -> Reply:
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        number = next(self.numbers)
        with self.lock:
            if rank in self.gone:
                raise RankGone(self.gone[rank])
            self.calls[number] = (rank, loop, waiter)
        try:
            self.channels[rank - 1].send(Call(number, message))
            reply: Reply = await waiter
        finally:
            with self.lock:
                self.calls.pop(number, None)
        if reply.error is not None:
            raise RuntimeError(f"tensor-parallel rank {rank}: {reply.error}")
        return reply

    def _read(self, rank: int, channel) -> None:
        while True:
            try:
                reply: Reply = channel.recv()
            except (EOFError, OSError):
                break
            delta, self.received[rank - 1] = reply.received_bytes - self.received[rank - 1], reply.received_bytes
            metrics.KV_RANK_BYTES.labels(str(rank)).inc(delta)
            metrics.KV_BYTES.labels("received").inc(delta)
            with self.lock:
                call = self.calls.get(reply.number)
            if call is not None:
                call[1].call_soon_threadsafe(_resolve, call[2], reply)
        reason = f"tensor-parallel rank {rank}'s process ended: its KV cannot arrive"
        with self.lock:
            self.gone[rank] = reason
            waiting = [(loop, waiter) for r, loop, waiter in self.calls.values() if r == rank]
        for loop, waiter in waiting:
            loop.call_soon_threadsafe(_fail, waiter, RankGone(reason))


def _resolve(waiter: asyncio.Future, reply: Reply) -> None:
    if not waiter.done():
        waiter.set_result(reply)


def _fail(waiter: asyncio.Future, error: Exception) -> None:
    if not waiter.done():
        waiter.set_exception(error)
