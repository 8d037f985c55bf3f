"""Producer side of the lookup buffer (prefill node).

`insert` only takes the entry into a bounded buffer and returns: the engine never waits
on the network. One sender thread per destination connects lazily to the consumer the
entry is addressed to and pushes its entries in insertion order, reconnecting after a
failure; an entry's bytes are freed once it is sent. Entries whose consumer cannot be
reached expire after `ttl`, so a dead decode node never pins prefill memory.
"""

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

import torch

from disagg import pipes
from disagg.lookup_buffer.errors import BufferFullError, LookupBufferError
from disagg.lookup_buffer.messages import (
    Extras,
    Hello,
    KVEntry,
    check_extras,
    check_request_id,
    encode_entry,
    encode_hello,
    token_digest,
)
from disagg.pipes.base import KVPipe, PipeClosed, PipeConfig, PipeError, ProtocolError

log = logging.getLogger(__name__)

# Reconnect backoff: quick after a blip, at most one attempt a second against a dead node.
RETRY_MIN_S = 0.05
RETRY_MAX_S = 1.0
IDLE_SENDER_S = 60.0  # a destination with nothing to send this long loses its thread and connection


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
class _Pending:
    entry: KVEntry
    dest: tuple[str, int]
    nbytes: int
    deadline: float  # time.monotonic() after which the entry expires unsent
    sending: bool = False  # on the wire right now: cannot be dropped until the send ends
    aborted: bool = False  # aborted while sending: not retried if that send fails


class LookupBufferProducer:
    """Bounded outbox of KV entries, each pushed to the consumer it is addressed to.

    `config` gives the pipe's auth token and timeout; its `kv_ip`/`kv_port` name this
    producer to consumers (the `source` a consumer's lookup may name). The producer
    listens on nothing.
    """

    def __init__(
        self, pipe_name: str, config: PipeConfig, kv_buffer_size: int, ttl: float, insert_timeout: float,
        idle_sender_s: float = IDLE_SENDER_S,
    ) -> None:
        if kv_buffer_size <= 0:
            raise ValueError(f"kv_buffer_size must be positive, got {kv_buffer_size}")
        self.pipe_name = pipe_name
        self.config = config
        self.kv_buffer_size = kv_buffer_size
        self.ttl = ttl
        self.insert_timeout = insert_timeout
        self.idle_sender_s = idle_sender_s
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
        check_request_id(request_id)  # what the consumer would refuse is refused here, before it is sent
        extras = dict(extras or {})
        check_extras(extras)
        entry = KVEntry(request_id, token_digest(token_ids), list(kv_tensors), extras)
        nbytes = entry.nbytes
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
            pending = _Pending(entry, dest, nbytes, time.monotonic() + self.ttl)
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

    def abort(self, request_id: str, dest: tuple[str, int] | None = None) -> bool:
        """Drop the request's entry (if `dest` is given, only one addressed there) if no byte of it
        was sent yet; False if unknown, addressed elsewhere or already on the wire."""
        with self._cond:
            pending = self._pending.get(request_id)
            if pending is None or (dest is not None and pending.dest != (str(dest[0]), int(dest[1]))):
                return False
            if pending.sending:
                pending.aborted = True
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
        retry_s = RETRY_MIN_S
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or queue, self.idle_sender_s)
                if self._closed:
                    break
                if not queue:  # idle: give back the thread and the connection; insert makes new ones
                    del self._senders[dest], self._queues[dest]
                    self._pipes.pop(dest, None)
                    self._last_error.pop(dest, None)
                    break
            pending: _Pending | None = None
            try:
                if pipe is None:
                    pipe = self._connect(dest)
                with self._cond:
                    if self._closed or not queue:  # closed, or the entries expired while we connected
                        continue
                    pending = queue.popleft()
                    pending.sending = True
                header, kv = encode_entry(pending.entry)
                pipe.send(header)
                pipe.send(kv)
            except Exception as e:  # noqa: BLE001  any failure (a name that cannot resolve, too) is retried until the entries expire
                if isinstance(e, ProtocolError) and pending is not None:
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
                    if pending is not None:
                        self._requeue(pending)
                    if self._closed:  # close() cut the pipe: not a failure
                        break
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
            pipe.close()

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
        if pending.aborted:
            self._free(pending)
            self._stats.aborts += 1
        elif pending.deadline <= time.monotonic():
            self._expire(pending)
        else:
            self._queues[pending.dest].appendleft(pending)

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
                    if pending.deadline > now:
                        next_deadline = pending.deadline
                        break
                    if not pending.sending:  # a sending entry is expired by its sender if the send fails
                        expired.append(pending)
                for pending in expired:
                    self._queues[pending.dest].remove(pending)
                    self._expire(pending)
                self._cond.wait(None if next_deadline is None else next_deadline - now)

    def _expire(self, pending: _Pending) -> None:
        self._free(pending)
        self._stats.expiries += 1
        reason = self._last_error.get(pending.dest, "still queued")
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
