"""KVPipe: a FIFO of tensor lists (or None) between two endpoints.

A pipe moves tensors and knows nothing of requests. One side listens on its own
endpoint (`kv_ip`, `kv_port`) and accepts any number of peers, each accepted
connection being its own `KVPipe`; the other side connects. This is what lets
one prefill node feed several decode nodes and the reverse (xPyD).
"""

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch


class PipeError(RuntimeError):
    """The pipe cannot carry on: the peer is gone, timed out or spoke nonsense."""


class PipeClosed(PipeError):
    """The peer closed the connection or died."""


class PipeTimeout(PipeError):
    """A send or receive made no progress within the pipe's timeout."""


class ProtocolError(PipeError):
    """A malformed header, wrong magic or unsupported protocol version."""


class AuthError(PipeError):
    """The peer's shared secret did not match ours."""


@dataclass
class PipeConfig:
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    auth_token: str | None = None  # shared secret checked in the handshake
    timeout: float = 30.0  # seconds a send/recv may stall before PipeTimeout


class KVPipe(ABC):
    """One connection. Messages arrive in the order they were sent.

    Every transport keeps the same state: one sender and one receiver at a time, and a
    pipe that failed mid-message stays broken (its byte stream can no longer be trusted)."""

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

    def _fail(self, error: PipeError) -> PipeError:
        """What to raise for an error mid-message: the stream can no longer be trusted, so
        the pipe is broken for good (or it was closed locally under a blocked call)."""
        if self._closed:
            return PipeClosed("the pipe was closed locally")
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

    @abstractmethod
    def send(self, tensors: list[torch.Tensor] | None) -> None:
        """Send a list of tensors (any dtype, shape, device; may be empty) or None."""

    @abstractmethod
    def recv(self, out: list[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
        """Receive the next message. With `out`, fill those preallocated tensors in place
        (their count, dtypes and shapes must match the message, else ProtocolError)."""

    @abstractmethod
    def close(self) -> None:
        """Close this connection; the peer's pending recv raises PipeClosed."""


class PipeListener(ABC):
    """A bound endpoint that accepts peers. A transport admits each peer on its own thread
    (the handshake can be slow or hostile) and hands the pipes that passed to `_admitted`;
    accept() takes them in order."""

    def __init__(self) -> None:
        self._ready: queue.Queue[KVPipe | None] = queue.Queue()  # None: the listener closed
        self._closed = threading.Event()

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
