"""Consumer side of the lookup buffer (decode node).

The consumer listens on its own endpoint (`address`, which the decode node advertises
as "where to send the KV") and accepts any number of producers. One receiver thread
per connection stores arriving entries by request id; `drop_select` blocks until the
entry for exactly its request id is there, checks its token digest and hands it over.
Entries nobody claims expire after `ttl`.

`expect(request_id, into)` names where a request's KV goes (views of the decode node's
blocks for it): its bytes are then received straight there, never into a buffer of their
own. `discard` ends such a receive (it closes that connection) before it returns, so the
caller may give the blocks back afterwards, unless `peer_may_write` says that a peer writing
one-sided (nixl) may still write there: then they must never be reused. A RowScatter's tensor (the
KV cache) is registered with each connection that receives into it (`KVPipe.register`), once.

Memory is bounded by `kv_buffer_size`: a message claiming more is refused before it is
allocated, and an entry that arrives before any lookup asks for it is dropped if the
entries already held would then exceed the buffer. A malformed message ends only the
connection that sent it.
"""

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from disagg import pipes
from disagg.lookup_buffer.errors import (
    BufferFullError,
    DigestMismatch,
    EntryCancelled,
    LookupBufferError,
    LookupDiscarded,
    LookupTimeout,
    ProducerLost,
)
from disagg.lookup_buffer.messages import (
    MAX_HEADER_BYTES,
    Bye,
    Hello,
    KVEntry,
    decode,
    decode_chunk,
    decode_first_token,
    token_digest,
)
from disagg.pipes.base import Destination, KVPipe, PipeConfig
from disagg.pipes.errors import PeerMayWrite, PipeClosed, PipeError, PipeTimeout, ProtocolError
from disagg.pipes.row_scatter import RowScatter
from disagg.rate_limited_log import RateLimitedLog
from disagg.timeline import mark

log = logging.getLogger(__name__)

ACCEPT_POLL_S = 0.2  # how soon the accept thread notices close()
RECEIVED, CANCELLED, WITHDRAWN = "received", "cancelled", "withdrawn"  # how an entry's receive ended
MAX_REFUSED_IDS = 10_000  # dropped entries remembered so their lookups fail at once


@dataclass
class ConsumerStats:
    entries: int = 0  # received, not yet claimed
    bytes: int = 0  # KV bytes of those entries
    connections: int = 0  # live producer connections
    received: int = 0
    bytes_received: int = 0
    received_in_place: int = 0  # of those, straight into the destination expect() named
    hits: int = 0  # lookups answered with an entry
    timeouts: int = 0
    expiries: int = 0  # entries dropped unclaimed after ttl
    digest_mismatches: int = 0
    refused: int = 0  # entries dropped on arrival: unclaimed entries already filled kv_buffer_size
    producer_losses: int = 0  # lookups failed because their producer's connection broke
    discards: int = 0
    cancelled: int = 0  # layer-wise entries their producer cancelled on the way (its prefill failed)


@dataclass
class _Lookup:
    request_id: str
    timeout: float
    deadline: float  # time.monotonic()
    source: tuple[str, int] | None
    losses_at_start: int  # broken connections from `source` when the lookup began


@dataclass
class _Arrived:
    entry: KVEntry
    nbytes: int
    source: tuple[str, int]
    deadline: float  # time.monotonic() after which it expires unclaimed


class LookupBufferConsumer:
    """Entries pushed by producers, claimed by request id."""

    def __init__(
        self, pipe_name: str, config: PipeConfig, ttl: float = 60.0, kv_buffer_size: int = 1 << 30,
        on_received: Callable[[int], None] | None = None, device: torch.device | str | None = None,
        on_entry: Callable[[float], None] | None = None,
    ) -> None:
        """on_received(nbytes) is called on a receiver thread for every KV message as it arrives, and
        on_entry(seconds) for every entry received, with the seconds from its header to its last part.
        device: where the KV cache lives; a CUDA one is where GPU transports receive."""
        if kv_buffer_size <= 0:
            raise ValueError(f"kv_buffer_size must be positive, got {kv_buffer_size}")
        self.device = torch.device(device) if device is not None else None
        self._on_cuda = self.device is not None and self.device.type == "cuda"
        self.ttl = ttl
        self.on_received = on_received
        self.on_entry = on_entry
        self.kv_buffer_size = kv_buffer_size
        # No entry larger than the buffer can be kept: refuse its message before allocating it.
        max_message_bytes = min(config.max_message_bytes, kv_buffer_size + MAX_HEADER_BYTES)
        self._listener = pipes.listen(pipe_name, replace(config, max_message_bytes=max_message_bytes))

        # One condition guards all state below; every arrival, loss, discard and close
        # notifies all waiters, each of which rechecks its own request.
        self._cond = threading.Condition()
        self._closed = False
        self._entries: dict[str, _Arrived] = {}  # insertion order == deadline order (one ttl)
        self._discarded: dict[str, float] = {}  # request id -> deadline: late arrivals are dropped
        self._waiting: dict[str, int] = {}  # request id -> lookups waiting: its entry is never refused
        self._refused: dict[str, float] = {}  # request id -> deadline: its lookups fail at once
        self._cancelled: dict[str, float] = {}  # request id -> deadline: its producer cancelled its entry
        self._written_on: dict[str, float] = {}  # request id -> deadline: a peer may still write its destination
        self._destinations: dict[str, list[Destination]] = {}  # request id -> where its KV goes (expect)
        self._filling: dict[str, KVPipe] = {}  # request id -> the connection receiving into its destination
        # Connections discard() closed to cut off a receive: the producer is not lost, it connects again and
        # sends what it still holds, so their lookups go on.
        self._cut: set[KVPipe] = set()
        # drop_select_async's waits, by request id: an arrival wakes its own request's lookups, not every one.
        self._wakers: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._refusals = RateLimitedLog(log)
        self._pipes: set[KVPipe] = set()
        self._receivers: list[threading.Thread] = []
        self._losses: dict[tuple[str, int], int] = {}  # broken connections per producer
        self._loss_reasons: dict[tuple[str, int], str] = {}
        self._stats = ConsumerStats()
        self._threads = [
            threading.Thread(target=self._accept_loop, name="kv-consumer-accept", daemon=True),
            threading.Thread(target=self._expire_loop, name="kv-consumer-expire", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) producers push to: what the decode node advertises."""
        return self._listener.address

    def drop_select(
        self,
        request_id: str,
        token_ids: list[int] | torch.Tensor,
        timeout: float,
        source: tuple[str, int] | None = None,
    ) -> KVEntry:
        """Wait up to `timeout` seconds for the entry of `request_id`, remove it and return it.

        Raises LookupTimeout if it does not arrive, DigestMismatch if it was computed for
        other tokens, LookupDiscarded if `discard` was called for it, BufferFullError if it
        arrived before this lookup while the buffer was full and was dropped, and, when
        `source` names the producer expected to send it (its config's kv_ip, kv_port),
        ProducerLost as soon as a connection from that producer breaks during the wait (not one
        `discard` cut, nor one the producer closed with a bye), and
        EntryCancelled if the producer cancelled a layer-wise entry on its way.
        """
        expected = token_digest(token_ids)  # before the wait: a 16k prompt's takes 0.25 ms
        lookup = self._start_lookup(request_id, timeout, source)
        with self._cond:
            try:
                while not self._arrived(lookup):
                    self._cond.wait(lookup.deadline - time.monotonic())
            finally:
                self._end_lookup(request_id)
            return self._take(request_id, expected)

    async def drop_select_async(
        self,
        request_id: str,
        token_ids: list[int] | torch.Tensor,
        timeout: float,
        source: tuple[str, int] | None = None,
    ) -> KVEntry:
        """drop_select for an event loop: the wait holds no thread, so any number of lookups wait at
        once (in a thread pool they would queue behind each other once its threads are taken)."""
        loop = asyncio.get_running_loop()
        expected = token_digest(token_ids)
        lookup = self._start_lookup(request_id, timeout, source)
        try:
            while True:
                with self._cond:
                    if self._arrived(lookup):
                        return self._take(request_id, expected)
                    woken = loop.create_future()
                    self._wakers.setdefault(request_id, set()).add((loop, woken))
                try:
                    await asyncio.wait_for(woken, max(0.0, lookup.deadline - time.monotonic()))
                except TimeoutError:
                    pass  # _arrived raises LookupTimeout
                finally:
                    with self._cond:
                        waiting = self._wakers[request_id]
                        waiting.discard((loop, woken))
                        if not waiting:
                            del self._wakers[request_id]
        finally:
            with self._cond:
                self._end_lookup(request_id)

    def _start_lookup(self, request_id: str, timeout: float, source: tuple[str, int] | None) -> _Lookup:
        source = (str(source[0]), int(source[1])) if source is not None else None
        with self._cond:
            self._waiting[request_id] = self._waiting.get(request_id, 0) + 1
            return _Lookup(request_id, timeout, time.monotonic() + timeout, source, self._losses.get(source, 0))

    def _end_lookup(self, request_id: str) -> None:
        self._waiting[request_id] -= 1
        if not self._waiting[request_id]:
            del self._waiting[request_id]

    def _arrived(self, lookup: _Lookup) -> bool:
        """Under the lock: True once the lookup's entry is there; raises why it will not come."""
        request_id, source = lookup.request_id, lookup.source
        if request_id in self._entries:
            return True
        self._check_open()
        if request_id in self._discarded:
            raise LookupDiscarded(f"lookup for request {request_id!r} ended: the request was discarded")
        if request_id in self._cancelled:
            raise EntryCancelled(f"the prefill node cancelled the KV of request {request_id!r} on its way "
                                 "(its prefill failed); recompute the prefill or retry")
        if request_id in self._refused:
            raise BufferFullError(
                f"KV for request {request_id!r} arrived before its lookup and was dropped: the decode node's "
                f"kv_buffer_size ({self.kv_buffer_size} bytes) was full of unclaimed entries; recompute the "
                "prefill, and raise kv_buffer_size if this recurs"
            )
        if source is not None and self._losses.get(source, 0) != lookup.losses_at_start:
            self._stats.producer_losses += 1
            raise ProducerLost(
                f"no KV for request {request_id!r}: the connection from producer {source[0]}:{source[1]} "
                f"broke while we waited ({self._loss_reasons[source]}); recompute the prefill or retry "
                "on another prefill node"
            )
        if time.monotonic() >= lookup.deadline:
            self._stats.timeouts += 1
            raise LookupTimeout(
                f"no KV for request {request_id!r} arrived within {lookup.timeout}s; the prefill node may be slow, "
                "overloaded or unable to reach this decode node: recompute the prefill or raise the timeout"
            )
        return False

    def _take(self, request_id: str, expected: str) -> KVEntry:
        """Under the lock: remove the arrived entry and hand it over if computed for the tokens whose
        token_digest is `expected`."""
        arrived = self._remove(request_id)
        self._destinations.pop(request_id, None)
        if arrived.entry.token_digest != expected:
            self._stats.digest_mismatches += 1
            raise DigestMismatch(
                f"KV for request {request_id!r} was computed for other tokens: entry digest "
                f"{arrived.entry.token_digest}, expected {expected}; the prefill and decode nodes "
                "tokenized the prompt differently (tokenizer or chat template mismatch?)"
            )
        self._stats.hits += 1
        return arrived.entry

    def _wake(self, request_id: str | None = None) -> None:
        """Under the lock: the lookups of `request_id` (None: every lookup, for a lost producer or a close)
        recheck their request; threads wait on the condition, and every one of them wakes."""
        self._cond.notify_all()
        waiting = self._wakers.values() if request_id is None else [self._wakers.get(request_id, ())]
        for wakers in waiting:
            for loop, woken in wakers:
                loop.call_soon_threadsafe(_set_done, woken)

    def expect(self, request_id: str, into: list[Destination]) -> None:
        """Receive the KV of `request_id`, when it comes, into `into` (one destination per KV
        tensor, e.g. views of the blocks reserved for it), not into new memory. Its entry then
        has in_place set. Ends with drop_select taking the entry, or with discard."""
        with self._cond:
            self._check_open()
            self._destinations[request_id] = into

    def discard(self, request_id: str) -> bool:
        """The request was aborted: drop its entry, end its lookups, and drop it if it arrives
        later (within ttl). A receive into its expect() destination is cut off (its connection
        closed) and over when this returns. True if an entry was dropped."""
        with self._cond:
            self._stats.discards += 1
            self._discarded.pop(request_id, None)  # re-insert: the dict stays in deadline order
            self._discarded[request_id] = time.monotonic() + self.ttl
            self._destinations.pop(request_id, None)
            self._wake(request_id)
            filling = self._filling.get(request_id)
            dropped = request_id in self._entries
            if dropped:
                self._remove(request_id)
        if filling is not None:
            with self._cond:
                self._cut.add(filling)
            filling.close()  # the receive fails at once; then its thread lets go of the destination
            with self._cond:
                self._cond.wait_for(lambda: request_id not in self._filling)
        return dropped

    def peer_may_write(self, request_id: str) -> bool:
        """A receive into the request's expect() destination was cut off while the peer's one-sided
        writes into it may still be in flight: never reuse that memory. Known once discard returns."""
        with self._cond:
            return request_id in self._written_on

    def stats(self) -> ConsumerStats:
        with self._cond:
            return replace(self._stats)

    def close(self) -> None:
        """Stop listening, close every connection, end waiting lookups and drop all entries."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._wake()
            live = list(self._pipes)
        self._listener.close()
        for pipe in live:  # wakes its receiver's blocked recv
            pipe.close()
        for thread in self._threads:
            thread.join()
        with self._cond:
            receivers = list(self._receivers)
        for thread in receivers:
            thread.join()
        with self._cond:
            for request_id in list(self._entries):
                self._remove(request_id)

    def _accept_loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
            try:
                pipe = self._listener.accept(timeout=ACCEPT_POLL_S)
            except PipeTimeout:
                continue
            except PipeError as e:
                with self._cond:
                    if not self._closed:
                        log.error("KV consumer at %s stopped accepting producers: %s", self.address, e)
                return
            with self._cond:
                if self._closed:
                    pipe.close()
                    return
                self._pipes.add(pipe)
                receiver = threading.Thread(target=self._recv_loop, args=(pipe,), name="kv-consumer-recv", daemon=True)
                self._receivers.append(receiver)
                receiver.start()

    def _recv_loop(self, pipe: KVPipe) -> None:
        source: tuple[str, int] | None = None
        reason = "closed"
        between_entries = False  # waiting for the next entry's header: nothing is in flight on this connection
        routine = False  # closed between entries: see the log line below
        bye = False  # the producer closed an idle connection, saying so: nothing is lost
        try:
            self._use_own_stream()
            hello = decode(self._recv(pipe))
            if not isinstance(hello, Hello):
                raise ProtocolError("a producer must send a hello first; is the peer a disagg lookup-buffer producer?")
            source = hello.source
            with self._cond:
                self._stats.connections += 1
            while True:
                between_entries = True
                entry = decode(self._recv(pipe))
                between_entries = False
                if isinstance(entry, Bye):
                    bye, reason = True, "it had nothing to send"
                    break
                if not isinstance(entry, KVEntry):
                    raise ProtocolError("a producer sent a second hello on one connection")
                mark("disagg.consumer.entry_header")
                start = time.perf_counter()
                outcome = self._recv_kv(pipe, entry)
                if outcome == RECEIVED:
                    if self.on_entry is not None:
                        self.on_entry(time.perf_counter() - start)
                    self._store(entry, source)
                elif outcome == CANCELLED:
                    self._cancel(entry.request_id)
                # WITHDRAWN: the producer sends it again, from its start, later
        except PipeError as e:  # a malformed message too: this connection ends, the consumer carries on
            reason = str(e)
            routine = between_entries and isinstance(e, PipeClosed)
        except Exception as e:  # a bug, not the peer; still only this connection ends
            log.exception("KV consumer: receiving from producer %s failed", source or "(before its hello)")
            reason = repr(e)
        finally:
            pipe.close()
            with self._cond:
                self._pipes.discard(pipe)
                self._receivers.remove(threading.current_thread())
                cut = pipe in self._cut
                self._cut.discard(pipe)
                if source is not None:
                    self._stats.connections -= 1
                    if not (cut or bye):
                        self._losses[source] = self._losses.get(source, 0) + 1
                        self._loss_reasons[source] = reason
                        self._wake()
                # A producer closes a connection idle for a minute (its IDLE_SENDER_S), with a bye, and every
                # one as it stops: routine, and nothing was in flight (a decode node hears of a prefill node
                # that died from its gRPC health check); discard() cut one to end a receive.
                if not self._closed and (routine or bye):
                    log.info("KV producer %s closed its connection between entries: %s", source, reason)
                elif not self._closed and cut:
                    log.info("KV producer %s: its connection was cut to end a discarded request's receive", source)
                elif not self._closed:
                    log.warning("KV producer %s disconnected: %s", source or "(before its hello)", reason)

    def _use_own_stream(self) -> None:
        """This receiver thread's GPU work (NCCL receives, copies into the blocks) goes on a stream of
        its own, of high priority. On the engine's stream, NCCL would start each receive only after
        the decode steps queued before it, and at normal priority the copies into the blocks would
        queue behind their kernels (docs/ARCHITECTURE.md, "KV on GPUs: streams")."""
        if self._on_cuda:
            if self.device.index is not None:  # "cuda" alone: the current one, as the engine's
                torch.cuda.set_device(self.device)
            torch.cuda.set_stream(torch.cuda.Stream(priority=-1))

    def _recv(self, pipe: KVPipe, out: list[Destination] | None = None) -> list[Destination] | None:
        while True:
            try:
                return pipe.recv(out)
            except PipeTimeout:  # an idle connection, not a dead one; a stalled message breaks the pipe
                continue

    def _recv_kv(self, pipe: KVPipe, entry: KVEntry) -> str:
        """The messages after an entry's header: its KV, into the request's destination if expected:
        RECEIVED; CANCELLED or WITHDRAWN if the producer cancelled or withdrew a layer-wise entry on
        the way."""
        with self._cond:
            # Not in place: a discarded request; one whose blocks another receive is filling (a resend
            # on a new connection), or a peer may still write (after a cut-off receive).
            request_id = entry.request_id
            in_place = all(request_id not in ids for ids in (self._discarded, self._filling, self._written_on))
            into = self._destinations.get(request_id) if in_place else None
            if into is not None:
                self._filling[entry.request_id] = pipe
        try:
            for dest in into or []:
                if isinstance(dest, RowScatter):  # rows of the KV cache: registered once per connection (nixl)
                    pipe.register(dest.tensor)
            kv = self._recv_part(pipe, into) if entry.layers is None else self._recv_layers(pipe, entry, into)
            if self._on_cuda:
                # All of it in place before it is handed on, whatever reads it. Once per entry, not per
                # part: each wait gives up the GIL, and getting it back costs (docs/ARCHITECTURE.md,
                # "Threads and the GIL").
                torch.cuda.current_stream().synchronize()
        except BaseException as e:
            if into is not None:  # a GPU transfer cut off midway must stop writing before the blocks are given back
                pipe.close()
                if isinstance(e, PeerMayWrite):
                    with self._cond:
                        self._remember(self._written_on, request_id)
            raise
        finally:
            if into is not None:
                with self._cond:
                    del self._filling[entry.request_id]
                    self._cond.notify_all()
        if kv is None and entry.layers is None:
            raise ProtocolError("an entry's header must be followed by its KV tensors")
        if kv is None:
            return CANCELLED
        if kv is WITHDRAWN:
            return WITHDRAWN
        if into is not None:
            entry.in_place = True
            kv = [view for dest in kv for view in (dest if isinstance(dest, list) else [dest])]
        entry.kv_tensors = kv
        return RECEIVED

    def _recv_part(self, pipe: KVPipe, out: list[Destination] | None) -> list[Destination] | None:
        kv = self._recv(pipe, out)
        mark("disagg.consumer.part")
        if kv is not None and self.on_received is not None:
            self.on_received(sum(_nbytes(dest) for dest in kv))
        return kv

    def _recv_layers(self, pipe: KVPipe, entry: KVEntry,
                     into: list[Destination] | None) -> list[Destination] | str | None:
        """A layer-wise entry's KV, one part per group of layers and chunk of tokens: each straight into
        its share of the destination (views of the blocks are layer-major, then token-ordered), else
        into its share of one tensor sized by the first part; then its first token into the entry, if it
        carries one. None if a None message comes in place of a message (cancelled), WITHDRAWN for a
        chunk message of 0 tokens (it comes again later)."""
        if into is not None and len(into) != 1:
            raise ProtocolError(f"a layer-wise entry has one KV tensor; {len(into)} destinations were expected")
        num_layers = entry.layers[-1][1]
        whole: torch.Tensor | None = None
        start, tokens = 0, entry.chunk
        while True:
            for first, end in entry.layers:
                if into is not None:
                    out = [_share(into[0], first, end, num_layers, start, start + tokens, entry.tokens)]
                else:
                    out = None if whole is None else [whole[first:end, :, start:start + tokens]]
                part = self._recv_part(pipe, out)
                if part is None:
                    return None
                if len(part) != 1:
                    raise ProtocolError("each layer part of an entry must be one KV tensor")
                if into is None and whole is None:
                    whole = self._whole(part[0], end, num_layers, entry)
            start += tokens
            if start == entry.tokens:
                if entry.carries_first_token:
                    first = self._recv(pipe)
                    if first is None:
                        return None
                    entry.first_token = decode_first_token(first)
                    mark("disagg.consumer.first_token")
                return into if into is not None else [whole]
            chunk = self._recv_part(pipe, None)
            if chunk is None:
                return None
            tokens = decode_chunk(chunk, entry.tokens - start)
            if tokens == 0:
                return WITHDRAWN

    def _whole(self, first_part: torch.Tensor, end: int, num_layers: int, entry: KVEntry) -> torch.Tensor:
        """The tensor [layers, 2, tokens, ...] a layer-wise entry not received in place is assembled in,
        refused before it is allocated if it would exceed kv_buffer_size (each part alone passes the
        message limit)."""
        tokens = entry.tokens
        if first_part.dim() < 3 or first_part.shape[0] != end or first_part.shape[2] != entry.chunk:
            raise ProtocolError(f"the first part of layers [0, {end}) of a chunk of {entry.chunk} tokens has shape "
                                f"{list(first_part.shape)}")
        nbytes = first_part.nbytes // (end * first_part.shape[2]) * num_layers * tokens
        if nbytes > self.kv_buffer_size:
            raise ProtocolError(f"an entry of {nbytes} bytes of KV; kv_buffer_size is {self.kv_buffer_size}")
        shape = (num_layers, first_part.shape[1], tokens, *first_part.shape[3:])
        whole = torch.empty(shape, dtype=first_part.dtype, device=first_part.device)
        whole[:end, :, :first_part.shape[2]] = first_part
        return whole

    def _cancel(self, request_id: str) -> None:
        """The producer cancelled the request's entry on the way (its prefill failed): its lookup fails now."""
        with self._cond:
            self._stats.cancelled += 1
            self._remember(self._cancelled, request_id)
            self._wake(request_id)

    def _store(self, entry: KVEntry, source: tuple[str, int]) -> None:
        nbytes = 0 if entry.in_place else entry.nbytes  # in place, it takes no room in the buffer
        with self._cond:
            self._stats.received += 1
            self._stats.bytes_received += entry.nbytes
            self._stats.received_in_place += entry.in_place
            if entry.request_id in self._discarded:
                return
            if entry.request_id in self._entries:  # a resend after a broken connection: keep the newest
                self._remove(entry.request_id)
            if entry.request_id not in self._waiting and self._stats.bytes + nbytes > self.kv_buffer_size:
                self._refuse(entry.request_id, nbytes, source)
                return
            self._refused.pop(entry.request_id, None)
            self._cancelled.pop(entry.request_id, None)
            self._entries[entry.request_id] = _Arrived(entry, nbytes, source, time.monotonic() + self.ttl)
            self._stats.entries += 1
            self._stats.bytes += nbytes
            mark("disagg.consumer.stored")
            self._wake(entry.request_id)

    def _refuse(self, request_id: str, nbytes: int, source: tuple[str, int]) -> None:
        self._stats.refused += 1
        self._remember(self._refused, request_id)
        self._refusals.warning(
            "full",
            f"dropped KV of request {request_id!r} ({nbytes} bytes) from {source[0]}:{source[1]}: "
            f"{self._stats.bytes} bytes of unclaimed entries already held, kv_buffer_size is {self.kv_buffer_size}",
        )

    def _remember(self, ids: dict[str, float], request_id: str) -> None:
        """Under the lock: a request whose lookups fail at once, for ttl, the oldest forgotten past
        MAX_REFUSED_IDS. Re-inserted, so that the dict stays in deadline order."""
        ids.pop(request_id, None)
        ids[request_id] = time.monotonic() + self.ttl
        if len(ids) > MAX_REFUSED_IDS:
            del ids[next(iter(ids))]

    def _expire_loop(self) -> None:
        with self._cond:
            while not self._closed:
                now, deadlines = time.monotonic(), []
                while self._entries:
                    request_id, arrived = next(iter(self._entries.items()))
                    if arrived.deadline > now:
                        deadlines.append(arrived.deadline)
                        break
                    self._remove(request_id)
                    self._stats.expiries += 1
                    log.warning(
                        "dropped KV of request %r from %s:%d unclaimed after ttl %.1fs",
                        request_id, *arrived.source, self.ttl,
                    )
                for ids in (self._discarded, self._refused, self._cancelled, self._written_on):
                    while ids:
                        request_id, deadline = next(iter(ids.items()))
                        if deadline > now:
                            deadlines.append(deadline)
                            break
                        del ids[request_id]
                self._cond.wait(min(deadlines) - now if deadlines else None)

    def _remove(self, request_id: str) -> _Arrived:
        arrived = self._entries.pop(request_id)
        self._stats.entries -= 1
        self._stats.bytes -= arrived.nbytes
        return arrived

    def _check_open(self) -> None:
        if self._closed:
            raise LookupBufferError("the lookup-buffer consumer is closed")


def _share(dest: Destination, first: int, end: int, num_layers: int, start: int, stop: int,
           tokens: int) -> Destination:
    """Layers [first, end), tokens [start, stop) of a destination for [layers, 2, tokens, ...]: a slice
    of a tensor or of a RowScatter's rows, or the pieces of a list of contiguous views that hold them
    (per layer, K then V, the same number of views each, their tokens in order), cut flat."""
    if isinstance(dest, torch.Tensor):
        return dest[first:end, :, start:stop]
    if isinstance(dest, RowScatter):
        return dest.share(first, end, start, stop)
    if len(dest) % (2 * num_layers):
        raise ProtocolError(f"{len(dest)} destination views cannot hold {num_layers} layers alike")
    per_half = len(dest) // (2 * num_layers)  # the views of one layer's K (or V)
    views = dest[2 * first * per_half:2 * end * per_half]
    if (start, stop) == (0, tokens):
        return views
    total = sum(view.numel() for view in views[:per_half])
    row = total // tokens  # elements of one token
    if row == 0 or row * tokens != total:
        raise ProtocolError(f"destination views of {total} elements a layer cannot hold {tokens} tokens alike")
    pieces = []
    for i in range(0, len(views), per_half):
        position = 0  # of the first token in the view
        for view in views[i:i + per_half]:
            length = view.numel() // row
            lo, hi = max(start, position), min(stop, position + length)
            if lo < hi:
                pieces.append(view.view(-1)[(lo - position) * row:(hi - position) * row])
            position += length
    return pieces


def _nbytes(dest: Destination) -> int:
    return sum(_nbytes(view) for view in dest) if isinstance(dest, list) else dest.nbytes


def _set_done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
