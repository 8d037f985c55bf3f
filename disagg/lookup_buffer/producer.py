"""Producer side of the lookup buffer (prefill node).

`insert` only takes the entry into a bounded buffer and returns: the engine never waits
on the network. An entry may also come in parts: `open` reserves its room and queues it,
then `put` hands over each layer group's KV as the prefill computes it, and the sender
sends each part as soon as it is there (docs/ARCHITECTURE.md, "Layer-wise send"); an entry opened to
carry its prompt's first token ends with it (`put_first_token`). One sender
thread per destination connects lazily to the consumer the entry is addressed to and pushes
its entries in insertion order, reconnecting after a failure; an entry's bytes are freed once
it is sent. Entries whose consumer cannot be reached expire after `ttl`, so a dead decode node
never pins prefill memory.
"""

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from disagg import pipes
from disagg.lookup_buffer.errors import BufferFullError, LookupBufferError
from disagg.lookup_buffer.messages import (
    Extras,
    FirstToken,
    Hello,
    KVEntry,
    check_extras,
    check_request_id,
    check_tensors,
    encode_bye,
    encode_chunk,
    encode_entry,
    encode_first_token,
    encode_hello,
    token_digest,
)
from disagg.pipes.base import KVPipe, PipeConfig
from disagg.pipes.errors import PipeClosed, PipeError, ProtocolError
from disagg.timeline import mark

log = logging.getLogger(__name__)

# Reconnect backoff: quick after a blip, at most one attempt a second against a dead node.
RETRY_MIN_S = 0.05
RETRY_MAX_S = 1.0
IDLE_SENDER_S = 60.0  # a destination with nothing to send this long loses its thread and connection
SENT, CANCELLED, WITHDRAWN = "sent", "cancelled", "withdrawn"  # how an entry's send ended


@dataclass
class ProducerStats:
    entries: int = 0  # held: queued or being sent
    bytes: int = 0  # KV bytes held
    inserts: int = 0
    sent: int = 0
    bytes_sent: int = 0
    expiries: int = 0  # dropped unsent after ttl
    aborts: int = 0
    insert_waits: int = 0  # inserts that found the buffer full and waited (backpressure)
    full_errors: int = 0  # inserts refused with BufferFullError
    send_errors: int = 0  # failed connects or sends, each followed by a retry
    rejected: int = 0  # entries the pipe refused to encode (e.g. an unsupported dtype), dropped


@dataclass
class _Part:
    tensors: list[torch.Tensor]
    ready: torch.cuda.Event | None  # its tensors hold their values once this has happened
    ends_chunk: bool = False  # the last layer group of a chunk that more follow: the entry may be withdrawn after it
    first_token_put_at: float | None = None  # a first token behind the KV: when it was put (time.perf_counter())


@dataclass
class _Pending:
    entry: KVEntry
    dest: tuple[str, int]
    nbytes: int
    deadline: float  # time.monotonic() after which the entry expires unsent
    parts: list[_Part]  # the messages of its KV that are there, in order
    num_parts: int | None  # how many there will be; None until a layer-wise entry's last part (or first token) is put
    # A layer-wise entry's puts so far: tokens of its chunks put whole, then its current chunk's.
    tokens_put: int = 0
    chunk_tokens: int = 0
    groups_put: int = 0  # layer groups of the current chunk
    sending: bool = False  # on the wire right now: cannot be dropped until the send ends
    aborted: bool = False  # aborted while sending: not retried if that send fails
    awaited: int | None = None  # the part its sender waits for, with every part before it sent
    put_sending: bool = False  # put_first_token is sending a part on the sender's connection
    sent_by_put: int | None = None  # the part put_first_token sent on the sender's connection, this attempt


class LookupBufferProducer:
    """Bounded outbox of KV entries, each pushed to the consumer it is addressed to.

    `config` gives the pipe's auth token and timeout; its `kv_ip`/`kv_port` name this
    producer to consumers (the `source` a consumer's lookup may name). The producer
    listens on nothing.
    """

    def __init__(
        self, pipe_name: str, config: PipeConfig, kv_buffer_size: int, ttl: float, insert_timeout: float,
        idle_sender_s: float | None = IDLE_SENDER_S, on_sent: Callable[[int, float], None] | None = None,
        on_first_token_sent: Callable[[float], None] | None = None,
    ) -> None:
        """idle_sender_s: how long a destination's connection stays with nothing to send (None: until
        close). on_sent(nbytes, seconds) is called on a sender thread for every KV message it has sent,
        with the seconds the send took (for a GPU part: until the transport was done with it);
        on_first_token_sent(seconds) for every first token, with the seconds from its put to its send's end
        (the first token's whole way on this side), on the thread that sent it: the sender, or
        put_first_token's caller."""
        if kv_buffer_size <= 0:
            raise ValueError(f"kv_buffer_size must be positive, got {kv_buffer_size}")
        self.pipe_name = pipe_name
        self.config = config
        self.kv_buffer_size = kv_buffer_size
        self.ttl = ttl
        self.insert_timeout = insert_timeout
        self.idle_sender_s = idle_sender_s
        self.on_sent = on_sent
        self.on_first_token_sent = on_first_token_sent
        self.source = (config.kv_ip, config.kv_port)

        # One condition guards all state below; every change that may unblock someone
        # (space freed, entry queued, close) notifies all waiters.
        self._cond = threading.Condition()
        self._closed = False
        self._pending: dict[str, _Pending] = {}  # insertion order == deadline order (one ttl)
        self._queues: dict[tuple[str, int], deque[_Pending]] = {}  # per destination, not yet sending
        self._senders: dict[tuple[str, int], threading.Thread] = {}
        self._pipes: dict[tuple[str, int], KVPipe] = {}  # live connections, closed by close()
        self._last_error: dict[tuple[str, int], str] = {}
        self._stats = ProducerStats()
        self._reaper = threading.Thread(target=self._expire_loop, name="kv-producer-expire", daemon=True)
        self._reaper.start()

    def insert(
        self,
        request_id: str,
        token_ids: list[int] | torch.Tensor,
        kv_tensors: list[torch.Tensor],
        extras: Extras | None,
        dest: tuple[str, int],
    ) -> None:
        """Queue one request's KV for the consumer at `dest`; returns once it is buffered.

        The buffer keeps the tensors as given (no copy): the caller hands them over and
        must not modify them afterwards. Waits up to `insert_timeout` for space, then
        raises BufferFullError.
        """
        entry = KVEntry(request_id, token_digest(token_ids), list(kv_tensors), dict(extras or {}))
        self._queue(entry, dest, entry.nbytes, [_Part(entry.kv_tensors, None)])

    def open(self, request_id: str, token_ids: list[int], layers: list[tuple[int, int]], tokens: int,
             nbytes: int, dest: tuple[str, int], wait: bool = True, first_token: bool = False) -> bool:
        """Queue the entry of a request whose KV of `tokens` tokens is still being computed: it will
        come as one `put` per layer group in `layers` ([first, end) pairs covering all layers in
        order) for each chunk of those tokens, in order, `nbytes` in all, and then, with first_token,
        the prompt's first token (put_first_token). Waits for buffer space as insert does, so that put
        never waits; with wait=False, returns False at once instead (nothing queued). True once queued."""
        entry = KVEntry(request_id, token_digest(token_ids), [], {}, layers=list(layers), tokens=tokens,
                        carries_first_token=first_token)
        return self._queue(entry, dest, nbytes, [], None, wait)

    def put(self, request_id: str, first: int, end: int, kv: torch.Tensor,
            ready: torch.cuda.Event | None = None) -> bool:
        """The KV [end - first, 2, tokens, ...] of layers [first, end) for the next tokens of an
        opened entry (kept as given, like insert's): a chunk's tokens begin with a put of its first
        group. With `ready`, it holds its values once that event has happened. False, and dropped,
        if the entry is gone (aborted). Never waits."""
        with self._cond:
            pending = self._pending.get(request_id)
            if pending is None or pending.entry.layers is None or pending.aborted:
                return False
            layers = pending.entry.layers
            if (first, end) != layers[pending.groups_put]:
                raise ValueError(f"put of layers [{first}, {end}) for {request_id!r}; "
                                 f"layers {list(layers[pending.groups_put])} come next")
            if pending.groups_put == 0:
                self._start_chunk(pending, kv.shape[2])
            elif kv.shape[2] != pending.chunk_tokens:
                raise ValueError(f"put of {kv.shape[2]} tokens for {request_id!r} in a chunk of {pending.chunk_tokens}")
            pending.groups_put += 1
            part = _Part([kv], ready)
            pending.parts.append(part)
            if pending.groups_put == len(layers):
                pending.groups_put, pending.tokens_put = 0, pending.tokens_put + pending.chunk_tokens
                part.ends_chunk = pending.tokens_put < pending.entry.tokens
                if not part.ends_chunk and not pending.entry.carries_first_token:
                    pending.num_parts = len(pending.parts)
            self._part_added(pending)
            return True

    def put_first_token(self, request_id: str, first: FirstToken) -> bool:
        """The prompt's first token, the last message of an entry opened with first_token, after all its
        KV was put. False, and dropped, if the entry is gone (aborted). Never waits: a send on the
        caller's thread is one the pipe takes at once (KVPipe.send_at_once).

        If the entry's sender is waiting for just this part, the caller sends it itself when the pipe
        takes it without blocking (KVPipe.send_at_once): handed to the sender thread, the token waited
        1.5-2.6 ms on a GPU pair's prefill node for that thread to get the GIL, twice (once to wake,
        once after its send), from the engine thread and the event loop answering the Prefill call."""
        mark("disagg.producer.first_token_put")
        part = _Part(encode_first_token(first), None, first_token_put_at=time.perf_counter())
        with self._cond:
            pending = self._pending.get(request_id)
            if pending is None or pending.aborted:
                return False
            if not pending.entry.carries_first_token or pending.num_parts is not None or pending.put_sending \
                    or pending.tokens_put != pending.entry.tokens:
                raise ValueError(f"{request_id!r} takes no first token now: not opened to carry one, "
                                 "its KV not all put, or its first token put already")
            pipe = self._pipes.get(pending.dest)
            if pipe is None or not pending.sending or pending.awaited != len(pending.parts):
                self._add_last_part(pending, part)
                return True
            pending.put_sending = True  # its sender waits until this ends
        sent = kept = False
        try:
            sent = pipe.send_at_once(part.tensors)
        except PipeError:
            pass  # the pipe is broken: the sender's next send finds out, and the entry goes again
        finally:
            with self._cond:
                pending.put_sending = False
                if sent:
                    pending.sent_by_put = len(pending.parts)
                kept = sent or not pending.aborted
                if kept:
                    self._add_last_part(pending, part)
                else:  # aborted meanwhile and not on the wire: its sender cancels the entry
                    self._cond.notify_all()
        if sent:
            mark("disagg.producer.first_token_sent")
            if self.on_first_token_sent is not None:
                self.on_first_token_sent(time.perf_counter() - part.first_token_put_at)
        return kept

    def _add_last_part(self, pending: _Pending, part: _Part) -> None:
        pending.parts.append(part)
        pending.num_parts = len(pending.parts)
        self._part_added(pending)

    def _part_added(self, pending: _Pending) -> None:
        """Under the lock: an opened entry got its next part. Its ttl bounds the wait for the consumer, not
        the prefill: it runs from its latest part."""
        pending.deadline = time.monotonic() + self.ttl
        request_id = pending.entry.request_id
        self._pending[request_id] = self._pending.pop(request_id)  # deadline order
        self._cond.notify_all()

    def _start_chunk(self, pending: _Pending, tokens: int) -> None:
        """Under the lock: the first put of a chunk of `tokens` tokens. The first chunk's size goes in
        the entry's header, each later one's in a chunk message before its parts."""
        left = pending.entry.tokens - pending.tokens_put
        if not 0 < tokens <= left:
            raise ValueError(f"put of {tokens} tokens for {pending.entry.request_id!r}; {left} are left")
        pending.chunk_tokens = tokens
        if pending.parts:
            pending.parts.append(_Part(encode_chunk(tokens), None))
        else:
            pending.entry.chunk = tokens

    def _queue(self, entry: KVEntry, dest: tuple[str, int], nbytes: int, parts: list[_Part],
               num_parts: int | None = 1, wait: bool = True) -> bool:
        request_id = entry.request_id
        check_request_id(request_id)  # what the consumer would refuse is refused here, before it is sent
        check_extras(entry.extras)
        dest = (str(dest[0]), int(dest[1]))
        if nbytes > self.kv_buffer_size:
            with self._cond:
                self._stats.full_errors += 1
            raise BufferFullError(
                f"KV of request {request_id!r} is {nbytes} bytes, more than the whole kv_buffer_size "
                f"({self.kv_buffer_size} bytes): raise kv_buffer_size"
            )
        with self._cond:
            self._check_open()
            if request_id in self._pending:
                raise ValueError(f"request {request_id!r} already has an unsent entry; request ids must be unique")
            if self._stats.bytes + nbytes > self.kv_buffer_size:
                if not wait:
                    return False
                self._stats.insert_waits += 1
                has_space = self._cond.wait_for(
                    lambda: self._closed or self._stats.bytes + nbytes <= self.kv_buffer_size, self.insert_timeout
                )
                self._check_open()
                if not has_space:
                    self._stats.full_errors += 1
                    raise BufferFullError(
                        f"KV buffer full for {self.insert_timeout}s: {self._stats.bytes} of {self.kv_buffer_size} "
                        f"bytes held by {len(self._pending)} unsent entries, request {request_id!r} needs {nbytes}; "
                        "the decode nodes are not draining it (slow or unreachable): raise kv_buffer_size "
                        "or add decode capacity"
                    )
            pending = _Pending(entry, dest, nbytes, time.monotonic() + self.ttl, parts, num_parts)
            self._pending[request_id] = pending
            self._queues.setdefault(dest, deque()).append(pending)
            self._stats.inserts += 1
            self._stats.entries += 1
            self._stats.bytes += nbytes
            if dest not in self._senders:
                sender = threading.Thread(
                    target=self._send_loop, args=(dest,), name=f"kv-producer-send-{dest[0]}:{dest[1]}", daemon=True
                )
                self._senders[dest] = sender
                sender.start()
            self._cond.notify_all()
            return True

    def abort(self, request_id: str, dest: tuple[str, int] | None = None) -> bool:
        """Drop the request's entry (if `dest` is given, only one addressed there) if no byte of it
        was sent yet; False if unknown, addressed elsewhere or already on the wire."""
        with self._cond:
            pending = self._pending.get(request_id)
            if pending is None or (dest is not None and pending.dest != (str(dest[0]), int(dest[1]))):
                return False
            if pending.sending:
                pending.aborted = True
                self._cond.notify_all()  # a sender waiting for its next part stops waiting
                return False
            self._queues[pending.dest].remove(pending)
            self._free(pending)
            self._stats.aborts += 1
            return True

    def stats(self) -> ProducerStats:
        with self._cond:
            return replace(self._stats)

    def close(self) -> None:
        """Stop the senders and drop unsent entries; a send in progress is cut off."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            live = list(self._pipes.values())
            threads = [self._reaper, *self._senders.values()]
        for pipe in live:  # unblocks a sender stuck on a consumer that stopped reading
            pipe.close()
        for thread in threads:
            thread.join()
        with self._cond:
            for pending in list(self._pending.values()):
                self._free(pending)

    def _send_loop(self, dest: tuple[str, int]) -> None:
        queue = self._queues[dest]
        pipe: KVPipe | None = None
        stream: list[torch.cuda.Stream] = []  # this thread's CUDA stream, made when first needed
        retry_s = RETRY_MIN_S
        idle = False
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or _next(queue) is not None, self.idle_sender_s)
                if self._closed:
                    break
                if not queue:  # idle: give back the thread and the connection; insert makes new ones
                    del self._senders[dest], self._queues[dest]
                    self._pipes.pop(dest, None)
                    self._last_error.pop(dest, None)
                    idle = True
                    break
            pending: _Pending | None = None
            started = False  # the entry's header is on the wire: the receiver expects its parts next
            try:
                if pipe is None:
                    pipe = self._connect(dest)
                with self._cond:
                    pending = None if self._closed else _next(queue)
                    if pending is None:  # closed, expired while we connected, or parts still to come
                        continue
                    queue.remove(pending)
                    pending.sending = True
                check_tensors(pending.parts[0].tensors)
                pipe.send(encode_entry(pending.entry))
                started = True
                outcome = self._send_parts(pipe, pending, queue, stream)
                if outcome != SENT:
                    with self._cond:
                        if outcome == WITHDRAWN:
                            self._requeue(pending)
                        else:
                            self._drop_unfinished(pending, "cancelled on the wire: no next part came within the ttl")
                    continue
            except Exception as e:  # noqa: BLE001  any failure (a name that cannot resolve, too) is retried until the entries expire
                if isinstance(e, ProtocolError) and pending is not None and not started:
                    # The pipe refused to encode this entry (e.g. a dtype it cannot carry): a retry
                    # would fail the same way. Drop it and keep the pipe; if that broke too, the
                    # next send says so.
                    with self._cond:
                        self._reject(pending, e)
                    continue
                if pipe is not None:
                    pipe.close()
                with self._cond:
                    self._pipes.pop(dest, None)
                    if self._closed:  # close() cut the pipe: not a failure
                        break
                    if isinstance(e, ProtocolError) and pending is not None:  # a part it cannot carry: drop the entry
                        self._reject(pending, e)
                        pipe = None
                        continue
                    if pending is not None:
                        self._requeue(pending)
                    self._on_send_error(dest, e, pipe is not None)
                    self._cond.wait_for(lambda: self._closed, retry_s)
                pipe = None
                retry_s = min(2 * retry_s, RETRY_MAX_S)
                continue
            retry_s = RETRY_MIN_S
            with self._cond:
                self._free(pending)
                self._stats.sent += 1
                self._stats.bytes_sent += pending.nbytes
        if pipe is not None:
            if idle:  # the consumer's lookups from us go on: nothing was lost
                with contextlib.suppress(PipeError):
                    pipe.send(encode_bye())
            pipe.close()

    def _send_parts(self, pipe: KVPipe, pending: _Pending, queue: deque[_Pending],
                    stream: list[torch.cuda.Stream]) -> str:
        """Each part of an entry on the wire once it is there: SENT. CANCELLED if one never comes (its
        prefill failed and aborted the entry, or its ttl passed): a None message in its place tells
        the receiver, and the connection goes on. WITHDRAWN if, between two chunks of a prompt still
        computing, an entry whose parts are all there waits for this connection: a chunk message of
        0 tokens tells the receiver to drop what it got, and the entry goes again, whole, later (a
        prefill in progress must not hold up KV that is ready; docs/ARCHITECTURE.md, "Layer-wise send")."""
        i, outcome = 0, SENT
        whole = len(pending.entry.layers or ()) == 1  # each part holds every layer
        while pending.num_parts is None or i < pending.num_parts:
            between_chunks = i > 0 and pending.parts[i - 1].ends_chunk
            with self._cond:
                pending.awaited = i
                # B023: wait_for calls the predicate in this iteration only.
                self._cond.wait_for(lambda: self._closed or pending.aborted or len(pending.parts) > i  # noqa: B023
                                    or (between_chunks and _complete(queue) is not None),  # noqa: B023
                                    max(0.0, pending.deadline - time.monotonic()))
                # put_first_token's send on this pipe ends without blocking: the pipe is ours again after it.
                self._cond.wait_for(lambda: not pending.put_sending)
                pending.awaited = None
                if pending.sent_by_put == i:
                    i += 1
                    continue
                part = pending.parts[i] if len(pending.parts) > i else None
                if part is None and self._closed:
                    raise PipeClosed("the lookup-buffer producer is closed")
                withdraw = part is None and between_chunks and not pending.aborted and _complete(queue) is not None
            if part is None:
                pipe.send(encode_chunk(0) if withdraw else None)
                outcome = WITHDRAWN if withdraw else CANCELLED
                break
            self._send_part(pipe, part, stream, whole)
            i += 1
        if stream:
            # Sent once the transport is done reading its GPU parts: the engine's allocator may reuse
            # their memory as soon as the entry is dropped, and it knows nothing of this stream. Once
            # an entry, not a part, so that the next part's send never waits for the receiver. (After
            # a failed send, closing the pipe ends its transfers.)
            stream[0].synchronize()
        return outcome

    def _send_part(self, pipe: KVPipe, part: _Part, stream: list[torch.cuda.Stream], whole: bool) -> None:
        """whole: the part holds every layer (a prompt's KV sent after its last layer), so nothing computes
        while it crosses: it goes once its values are there, at a GPU transport's full rate (torch_dist
        sends a part still being computed through a communicator of few CTAs)."""
        check_tensors(part.tensors)
        cuda = part.tensors[0].is_cuda
        on_gpu = part.ready is not None and cuda
        if part.ready is not None and (whole or not on_gpu):
            part.ready.synchronize()  # its copy to host memory is done, or its layers have run
        start = time.perf_counter()
        if not on_gpu:
            # A CUDA entry with no event (a prefix pull's blocks, read and synced by the engine) goes on this
            # thread's stream: computed only if nothing is queued there, else its send waits behind that.
            pipe.send(part.tensors, not cuda or torch.cuda.current_stream(part.tensors[0].device).query())
        else:
            computed = part.ready.query()  # False: its layers are still queued on the engine's stream
            # On a stream of its own that waits for this part alone: on the engine's stream a GPU
            # transport would also wait for the layers queued after it.
            if not stream:
                stream.append(torch.cuda.Stream(part.tensors[0].device))
            with torch.cuda.stream(stream[0]):
                stream[0].wait_event(part.ready)
                pipe.send(part.tensors, computed)
        if part.first_token_put_at is not None:
            mark("disagg.producer.first_token_sent")
            if self.on_first_token_sent is not None:
                self.on_first_token_sent(time.perf_counter() - part.first_token_put_at)
        else:
            mark("disagg.producer.part_sent")
            if self.on_sent is not None:
                self.on_sent(sum(t.nbytes for t in part.tensors), time.perf_counter() - start)

    def _connect(self, dest: tuple[str, int]) -> KVPipe:
        pipe = pipes.connect(self.pipe_name, self.config, dest[0], dest[1])
        try:
            pipe.send(encode_hello(Hello(source=self.source)))
        except PipeError:
            pipe.close()
            raise
        with self._cond:
            if self._closed:  # close() has already closed the pipes it knew of
                pipe.close()
                raise PipeClosed("the lookup-buffer producer is closed")
            self._pipes[dest] = pipe
            if self._last_error.pop(dest, None) is not None:
                log.info("reconnected to decode node %s:%d", *dest)
        return pipe

    def _on_send_error(self, dest: tuple[str, int], error: Exception, connected: bool) -> None:
        what = "lost the connection to" if connected else "cannot connect to"
        self._stats.send_errors += 1
        if dest not in self._last_error:  # warn once per outage, not once per retry
            log.warning(
                "%s decode node %s:%d (%s); retrying, its entries expire after %.1fs", what, *dest, error, self.ttl
            )
        self._last_error[dest] = f"{what} it: {error}"

    def _requeue(self, pending: _Pending) -> None:
        """A failed send: retry the entry first, unless it was aborted or expired meanwhile."""
        pending.sending = False
        pending.sent_by_put = None  # the entry goes again from its start, each part on the sender's thread
        if pending.aborted or pending.deadline <= time.monotonic():
            self._drop_unfinished(pending)
        else:
            self._queues[pending.dest].appendleft(pending)

    def _drop_unfinished(self, pending: _Pending, reason: str | None = None) -> None:
        """An entry that will not be sent: aborted, or its ttl passed (while a send failed or a part
        was awaited)."""
        if pending.aborted:
            self._free(pending)
            self._stats.aborts += 1
        else:
            self._expire(pending, reason)

    def _reject(self, pending: _Pending, error: ProtocolError) -> None:
        self._free(pending)
        self._stats.rejected += 1
        log.error(
            "dropped KV of request %r: the %s pipe cannot send it (%s)", pending.entry.request_id, self.pipe_name, error
        )

    def _expire_loop(self) -> None:
        with self._cond:
            while not self._closed:
                now, next_deadline, expired = time.monotonic(), None, []
                for pending in self._pending.values():
                    if not pending.parts:  # still computing: its prefill's end or abort settles it
                        continue
                    if pending.deadline > now:
                        next_deadline = pending.deadline
                        break
                    if not pending.sending:  # a sending entry is expired by its sender if the send fails
                        expired.append(pending)
                for pending in expired:
                    self._queues[pending.dest].remove(pending)
                    self._expire(pending)
                self._cond.wait(None if next_deadline is None else next_deadline - now)

    def _expire(self, pending: _Pending, reason: str | None = None) -> None:
        self._free(pending)
        self._stats.expiries += 1
        reason = reason or self._last_error.get(pending.dest, "still queued")
        log.warning(
            "dropped KV of request %r for %s:%d unsent after ttl %.1fs (%s)",
            pending.entry.request_id, *pending.dest, self.ttl, reason,
        )

    def _free(self, pending: _Pending) -> None:
        del self._pending[pending.entry.request_id]
        self._stats.entries -= 1
        self._stats.bytes -= pending.nbytes
        self._cond.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise LookupBufferError("the lookup-buffer producer is closed")


def _next(queue: deque[_Pending]) -> _Pending | None:
    """The entry to send now: the first whose parts are all there, else the first with its first part there."""
    return _complete(queue) or next((pending for pending in queue if pending.parts), None)


def _complete(queue: deque[_Pending]) -> _Pending | None:
    return next((pending for pending in queue if len(pending.parts) == pending.num_parts), None)
