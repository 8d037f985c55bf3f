"""KVPipe: a FIFO of tensor lists (or None) between two endpoints.

A pipe moves tensors and knows nothing of requests. One side listens on its own
endpoint (`kv_ip`, `kv_port`) and accepts any number of peers, each accepted
connection being its own `KVPipe`; the other side connects. This is what lets
one prefill node feed several decode nodes and the reverse (xPyD).
"""

import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagg.pipes import wire
from disagg.pipes.errors import NoMessage, PeerMayWrite, PipeClosed, PipeError, PipeTimeout
from disagg.pipes.row_scatter import RowScatter
from disagg.rate_limited_log import RateLimitedLog

logger = logging.getLogger(__name__)


# The most send_at_once sends (a first-token message, with 20 top logprobs): a TCP socket that polls
# writable has at least a third of its send buffer free, never less than 1.5 KiB.
AT_ONCE_MAX_BYTES = 1024


# Where recv puts one tensor of a message: a tensor of its shape, views whose bytes, in order, make
# up the tensor, or rows of a bigger one (a KV cache's blocks; docs/ARCHITECTURE.md, "Pipes").
Destination = torch.Tensor | list[torch.Tensor] | RowScatter


def fill(dest: Destination, tensor: torch.Tensor, non_blocking: bool = False) -> None:
    """Copy a tensor received elsewhere into its destination."""
    if isinstance(dest, torch.Tensor):
        dest.copy_(tensor, non_blocking=non_blocking)
        return
    if isinstance(dest, RowScatter):
        dest.fill(tensor, non_blocking)
        return
    if not dest:  # an empty tensor
        return
    flat = tensor if tensor.dim() == 1 else tensor.reshape(-1)
    chunks = flat.split([view.numel() for view in dest])
    # One multi-tensor copy, not a kernel per view: a KV cache's views can number thousands. They are
    # flat, so no chunk needs a view of its own (Python a receiver beside a busy engine pays for).
    sources = [chunk if chunk.shape == view.shape else chunk.view(view.shape) for chunk, view in zip(chunks, dest)]
    torch._foreach_copy_(dest, sources, non_blocking=non_blocking)


@dataclass
class PipeConfig:
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    auth_token: str | None = None  # shared secret checked in the handshake
    timeout: float = 30.0  # seconds a send/recv may stall before PipeTimeout
    # What a peer that never authenticates, or sends nonsense once it has, can cost a listener.
    handshake_timeout: float = 5.0  # seconds for the whole handshake, however slowly the peer trickles it
    max_handshakes: int = 64  # handshakes in progress at once; further connections are closed at once
    max_handshakes_per_host: int = 16  # of those, from one source address
    max_message_bytes: int = 1 << 34  # tensor bytes a received message may claim; checked before allocating


class KVPipe(ABC):
    """One connection. Messages arrive in the order they were sent.

    Every transport keeps the same state: one sender and one receiver at a time, and a
    pipe that failed mid-message stays broken (its byte stream can no longer be trusted).
    A message the wire cannot describe (a dtype or rank it does not carry) is refused before
    any byte of it leaves, and the pipe stays usable; any other failure of a send breaks the
    pipe, since the transport cannot always tell whether some of the message left."""

    def __init__(self) -> None:
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._closed = False
        self._broken: str | None = None  # why the pipe can no longer be used

    def _check_usable(self) -> None:
        if self._closed:
            raise PipeClosed("the pipe was closed")
        if self._broken:
            raise PipeError(f"the pipe is broken and must be reconnected: {self._broken}")

    def _fail(self, error: Exception, doing: str) -> PipeError:
        """What to raise for an error mid-message: the stream can no longer be trusted, so
        the pipe is broken for good (or it was closed locally under a blocked call). Any
        exception counts (a tensor we could not allocate leaves its bytes on the wire).
        PeerMayWrite stays what it is, closed or not: its caller must keep the memory aside."""
        if self._closed and not isinstance(error, PeerMayWrite):
            return PipeClosed("the pipe was closed locally")
        if not isinstance(error, PipeError):
            error = PipeError(f"{doing} a message failed: {error!r}")
        self._broken = str(error)
        return error

    def _say_goodbye(self, send_close: Callable[[], None]) -> None:
        """Tell the peer this is a clean close, unless the pipe is broken or a send is stuck
        holding the lock: the peer then raises PipeClosed at once instead of on a timeout."""
        if not self._broken and self._send_lock.acquire(timeout=1.0):
            try:
                send_close()
            except (OSError, PipeError):
                pass
            finally:
                self._send_lock.release()

    def send(self, tensors: list[torch.Tensor] | None, computed: bool = True) -> None:
        """Send a list of tensors (any dtype the wire carries, any shape, device; may be empty) or None.
        computed=False: CUDA tensors whose values are still being computed on the current stream (a
        layer-wise KV part behind its layers), or behind other work queued there, so a GPU transport's
        receive may wait on the peer's GPU for them."""
        with self._send_lock:
            self._check_usable()
            if tensors is None:
                header = wire.encode(wire.Kind.NONE)
            else:  # ProtocolError here: nothing was sent, the pipe stays usable
                header = wire.encode(wire.Kind.TENSORS, [wire.TensorMeta.of(t) for t in tensors])
            try:
                self._send(header, tensors, computed)
            except Exception as e:  # noqa: BLE001  any error breaks the pipe: re-raised as its PipeError
                raise self._fail(e, "sending") from None

    def send_at_once(self, tensors: list[torch.Tensor]) -> bool:
        """send() of a small message of CPU tensors on the caller's thread, only if it cannot wait: no
        other send in progress, and the transport takes the message without blocking (_takes_at_once).
        False, with nothing sent, otherwise; a failure mid-message breaks the pipe as send's does.
        For a thread that must not wait on the network (an engine's) but should not wait for another
        thread's turn either."""
        if any(t.is_cuda for t in tensors) or sum(t.nbytes for t in tensors) > AT_ONCE_MAX_BYTES:
            return False
        if not self._send_lock.acquire(blocking=False):
            return False
        try:
            try:
                if self._closed or self._broken or not self._takes_at_once():
                    return False
            except (OSError, ValueError):  # the socket closed under us: the pipe's own send will say so
                return False
            header = wire.encode(wire.Kind.TENSORS, [wire.TensorMeta.of(t) for t in tensors])
            try:
                self._send(header, tensors, True)
            except Exception as e:  # noqa: BLE001  any error breaks the pipe: re-raised as its PipeError
                raise self._fail(e, "sending") from None
            return True
        finally:
            self._send_lock.release()

    def _takes_at_once(self) -> bool:
        """A message of at most AT_ONCE_MAX_BYTES of CPU tensors would be sent now without blocking."""
        return False

    @abstractmethod
    def _send(self, header: bytes, tensors: list[torch.Tensor] | None, computed: bool) -> None:
        """send's transport part, under the send lock: the message's wire header (kind and tensor
        metadata) and its tensors; any error breaks the pipe."""

    def recv(self, out: list[Destination] | None = None) -> list[Destination] | None:
        """Receive the next message. With `out`, fill those destinations in place and return
        them (their count, dtypes and sizes must match the message, else ProtocolError)."""
        with self._recv_lock:
            self._check_usable()
            try:
                return self._recv(out)
            except NoMessage:
                raise  # nothing was consumed: the pipe stays usable
            except Exception as e:  # noqa: BLE001  any error breaks the pipe: re-raised as its PipeError
                raise self._fail(e, "receiving") from None

    @abstractmethod
    def _recv(self, out: list[Destination] | None) -> list[Destination] | None:
        """recv's transport part, under the receive lock; any error but NoMessage breaks the pipe."""

    def register(self, tensor: torch.Tensor) -> None:
        """Receives may land in `tensor` (a KV cache), and sends may come from it, for the rest of
        the connection: a transport that reads and writes registered memory (nixl) registers it once
        here instead of per message. The others need nothing."""
        return

    @abstractmethod
    def close(self) -> None:
        """Close this connection; the peer's pending recv raises PipeClosed."""


class PipeListener(ABC):
    """A bound endpoint that accepts peers. A transport admits each peer on its own thread
    (the handshake can be slow or hostile) and hands the pipes that passed to `_admitted`;
    accept() takes them in order.

    Peers that have not authenticated yet are bounded: at most `max_handshakes` at a time
    (`max_handshakes_per_host` from one address), each for at most `handshake_timeout`, so
    idle or trickling connections cannot pile up threads and sockets."""

    def __init__(self, config: PipeConfig) -> None:
        self._config = config
        self._ready: queue.Queue[KVPipe | None] = queue.Queue()  # None: the listener closed
        self._closed = threading.Event()
        self._handshakes_lock = threading.Lock()
        self._handshakes: dict[str | None, int] = {}  # source address (None: unknown) -> in progress
        self._rejections = RateLimitedLog(logger)

    def _start_handshake(self, host: str | None) -> bool:
        """Take a handshake slot for a new peer from `host` (None where the transport cannot
        tell), or refuse the peer: False, and the caller closes its connection at once."""
        with self._handshakes_lock:
            total, mine = sum(self._handshakes.values()), self._handshakes.get(host, 0)
            if total >= self._config.max_handshakes:
                limit, why = "max_handshakes", f"{total} handshakes in progress"
            elif host is not None and mine >= self._config.max_handshakes_per_host:
                limit, why = "max_handshakes_per_host", f"{mine} handshakes from it in progress"
            else:
                self._handshakes[host] = mine + 1
                return True
        self._rejections.warning(limit, f"refused a pipe peer from {host} at once: {why} ({limit})")
        return False

    def _end_handshake(self, host: str | None) -> None:
        with self._handshakes_lock:
            self._handshakes[host] -= 1
            if not self._handshakes[host]:
                del self._handshakes[host]

    def accept(self, timeout: float | None = None) -> KVPipe:
        """Wait for the next peer that passes the handshake; PipeTimeout if none came."""
        try:
            pipe = self._ready.get(timeout=timeout)
        except queue.Empty:
            raise PipeTimeout(f"no peer connected to {self.address} within {timeout}s") from None
        if pipe is None:
            self._ready.put(None)  # wake any other accept() too
            raise PipeClosed("the listener was closed")
        return pipe

    def _admitted(self, pipe: KVPipe) -> None:
        if self._closed.is_set():
            pipe.close()
        else:
            self._ready.put(pipe)

    @property
    @abstractmethod
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound (port 0 in the config picks a free one)."""

    @abstractmethod
    def _stop_listening(self) -> None:
        """The transport's part of close(): take no more connections."""

    def close(self) -> None:
        """Stop listening and close the pipes nobody accepted; accepted ones stay open."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._stop_listening()
        while True:
            try:
                pipe = self._ready.get_nowait()
            except queue.Empty:
                break
            if pipe is not None:
                pipe.close()
        self._ready.put(None)
