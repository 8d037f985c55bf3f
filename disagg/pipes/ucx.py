"""ucx: a pipe over a `ucxx` endpoint. UCX picks the fastest path it finds: shared
memory on one host, RDMA or NVLink where present; CUDA tensors go as they are.

ucxx's API is asyncio; its context is process-wide, so every pipe and listener in a
process shares one private event-loop thread and the blocking methods below run
coroutines on it. Each message is tag messages on the endpoint's own tag, in order:
the fixed header, the metadata block, then one message per non-empty tensor.

ucxx closes an endpoint only by force, which drops what UCX has not delivered yet, and a send
completes once the transport has its bytes, not the peer: close() sends the CLOSE message, then
asks the peer, on a tag of its own, to answer once all before it has arrived; each pipe keeps a
receive posted that answers (_answer_goodbye). Only then, or when the peer is gone or the wait
runs out (config.timeout), does it tear the endpoint down.

The listener binds config.kv_port on all interfaces: ucxx's listener takes a port and
no address, so kv_ip only names the endpoint. Peers that connect but never finish the
handshake are bounded as on the other pipes, except per source address (a ucxx endpoint
does not tell it).

Timeouts bound each step (the header, the metadata, all of a message's tensor bytes),
not the progress within it: size config.timeout for the largest message.
"""

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Coroutine
from concurrent.futures import Future

import numpy as np
import torch

from disagg.pipes import wire
from disagg.pipes.base import Destination, KVPipe, PipeConfig, PipeListener, fill
from disagg.pipes.errors import NoMessage, PipeClosed, PipeError, PipeTimeout
from disagg.pipes.row_scatter import RowScatter

os.environ.setdefault(
    "UCX_WARN_UNUSED_ENV_VARS", "n"
)  # ucxx sets variables this UCX build ignores
try:
    import ucxx
    from ucxx.exceptions import UCXError
except ImportError as e:
    raise ImportError(
        f"the ucx pipe needs ucxx ({e}): pip install ucxx-cu12 (or pip install 'disagg[ucx]')"
    ) from e

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(
                target=_loop.run_forever, name="ucx-loop", daemon=True
            ).start()
    return _loop


def _submit(coro: Coroutine) -> Future:
    return asyncio.run_coroutine_threadsafe(coro, _event_loop())


def _wait(future: Future, what: str, timeout: float) -> object:
    try:
        return future.result(timeout)
    except TimeoutError:
        raise PipeTimeout(
            f"{what}: no progress for {timeout}s (pipe timeout); is the peer alive?"
        ) from None
    except UCXError as e:
        raise PipeClosed(f"{what}: connection lost ({type(e).__name__}: {e})") from None


def _buffer(tensor: torch.Tensor) -> np.ndarray | torch.Tensor:
    """What ucxx sends from or receives into: CUDA tensors as they are, host memory via numpy.
    As uint8, because numpy has no bfloat16."""
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()


async def _send_all(ep: "ucxx.Endpoint", buffers: list) -> None:
    # gather starts the sends in list order, and UCX matches one tag's messages in the
    # order they were posted, so the receiver sees them in this order.
    await _torn_down_is_closed(asyncio.gather(*(ep.send(b) for b in buffers if len(b))))


async def _recv_all(ep: "ucxx.Endpoint", buffers: list) -> None:
    await _torn_down_is_closed(asyncio.gather(*(ep.recv(b) for b in buffers)))


async def _torn_down_is_closed(operation: Awaitable) -> None:
    """ucxx's send and recv use an endpoint's handle before checking that it is open: once the
    endpoint is torn down they raise AttributeError, which would escape as a bug, not a closed pipe."""
    try:
        await operation
    except AttributeError:
        raise PipeClosed("the UCX endpoint is closed: the peer closed the pipe or died") from None


# The close handshake's tags (ucxx hashes them with the endpoint's tag): ints, since ucxx hashes a
# str with Python's hash(), which differs between processes.
_GOODBYE_TAG, _GOODBYE_ANSWER_TAG = 1, 2


async def _answer_goodbye(ep: "ucxx.Endpoint") -> None:
    """Posted for a pipe's life: answers the peer's closing question. It comes on the endpoint after
    every message the peer sent, so when it arrives all of them have (matched, or queued on the worker)."""
    question = np.empty(1, np.uint8)
    try:
        await ep.recv(question, tag=_GOODBYE_TAG)
        await ep.send(question, tag=_GOODBYE_ANSWER_TAG)
    except (UCXError, AttributeError):  # the endpoint closed or failed first: nobody to answer
        pass


async def _delivered(ep: "ucxx.Endpoint") -> None:
    """Returns once the peer has received everything we sent before (see _answer_goodbye)."""
    question, answer = np.zeros(1, np.uint8), np.empty(1, np.uint8)
    await _torn_down_is_closed(
        asyncio.gather(ep.send(question, tag=_GOODBYE_TAG), ep.recv(answer, tag=_GOODBYE_ANSWER_TAG))
    )


async def _recv_bytes(ep: "ucxx.Endpoint", nbytes: int) -> bytes:
    buf = np.empty(nbytes, dtype=np.uint8)
    if nbytes:
        await _torn_down_is_closed(ep.recv(buf))
    return buf.tobytes()


def _handshake(ep: "ucxx.Endpoint", config: PipeConfig, is_listener: bool) -> None:
    deadline = time.monotonic() + config.handshake_timeout

    def wait(future: Future) -> object:
        return _wait(future, "pipe handshake", max(0.0, deadline - time.monotonic()))

    try:
        wire.handshake(
            lambda b: wait(_submit(_send_all(ep, [np.frombuffer(b, np.uint8)]))),
            lambda n: wait(_submit(_recv_bytes(ep, n))),
            config.auth_token,
            is_listener,
        )
    except PipeTimeout:
        raise PipeTimeout(
            f"pipe handshake not done within {config.handshake_timeout}s (handshake_timeout); "
            "is the peer a disagg pipe?"
        ) from None


class UcxPipe(KVPipe):
    def __init__(self, ep: "ucxx.Endpoint", config: PipeConfig):
        super().__init__()
        self._ep = ep
        self._config = config
        # A header recv that timed out stays posted and is awaited again by the next
        # recv(): cancelling it could lose a message that arrives just then.
        self._pending_header: Future | None = None
        self._mid_message = False  # a recv is filling its destinations: close() cuts it off at once
        _submit(_answer_goodbye(ep))

    def _send(self, header: bytes, tensors: list[torch.Tensor] | None, computed: bool) -> None:
        payload = [_buffer(t.contiguous()) for t in tensors or [] if t.numel()]
        buffers = [
            np.frombuffer(header[: wire.HEADER.size], np.uint8),
            np.frombuffer(header[wire.HEADER.size :], np.uint8),
        ]
        _wait(_submit(_send_all(self._ep, buffers + payload)), "sending a message", self._config.timeout)

    def _recv(self, out: list[Destination] | None) -> list[Destination] | None:
        if self._pending_header is None:
            self._pending_header = _submit(_recv_bytes(self._ep, wire.HEADER.size))
        try:
            header_bytes = _wait(self._pending_header, "waiting for a message", self._config.timeout)
        except PipeTimeout as e:
            raise NoMessage(str(e)) from None  # nothing consumed: the header recv stays posted for the next recv()
        except Exception:
            self._pending_header = None
            raise
        self._pending_header = None
        self._mid_message = True
        try:
            return self._recv_message(header_bytes, out)
        finally:
            self._mid_message = False

    def _recv_message(self, header_bytes: bytes, out: list[Destination] | None) -> list[Destination] | None:
        header = wire.decode_header(header_bytes)
        meta = _wait(
            _submit(_recv_bytes(self._ep, header.meta_nbytes)),
            "receiving a message header",
            self._config.timeout,
        )
        metas = wire.decode_meta(meta, header.count, self._config.max_message_bytes)
        metas = wire.message_metas(header.kind, metas, out)
        if metas is None:
            return None
        targets = []
        for i, m in enumerate(metas):
            dest = out[i] if out is not None else None
            if isinstance(dest, torch.Tensor) and dest.is_contiguous():
                targets.append(dest)
            else:  # views (a KV cache's blocks) are filled from one buffer after the message
                device = _device(dest)
                targets.append(torch.empty(m.shape, dtype=m.dtype, device=device))
        buffers = [_buffer(t) for t in targets if t.numel()]
        _wait(
            _submit(_recv_all(self._ep, buffers)),
            "receiving tensor data",
            self._config.timeout,
        )
        if out is None:
            return targets
        for dest, target in zip(out, targets):
            if dest is not target:
                fill(dest, target)
        return out

    def close(self) -> None:
        if self._closed:
            return
        close_msg = np.frombuffer(wire.encode(wire.Kind.CLOSE), np.uint8)

        def goodbye() -> None:
            _wait(_submit(_send_all(self._ep, [close_msg])), "closing", 1.0)
            if not self._mid_message:  # a receive in progress is cut off at once (lookup_buffer/consumer.py)
                _wait(_submit(_delivered(self._ep)), "closing: the peer's answer", self._config.timeout)

        self._say_goodbye(goodbye)
        self._closed = True
        # abort() cancels our own pending recvs, which then raise PipeClosed.
        _submit(_abort(self._ep)).result()


async def _abort(ep: "ucxx.Endpoint") -> None:
    ep.abort()


class UcxListener(PipeListener):
    def __init__(self, config: PipeConfig):
        super().__init__(config)
        try:
            self._listener = _submit(self._create(config.kv_port)).result(
                config.timeout
            )
        except UCXError as e:
            raise PipeError(
                f"cannot listen on port {config.kv_port} with ucx: {e}; pick a free kv_port"
            ) from None
        self._host = config.kv_ip

    async def _create(self, port: int) -> "ucxx.Listener":
        return ucxx.create_listener(self._on_connect, port)

    @property
    def address(self) -> tuple[str, int]:
        return self._host, self._listener.port

    def _on_connect(self, ep: "ucxx.Endpoint") -> None:
        # Runs on the event loop: the blocking handshake must not, so hand it to a thread.
        if not self._start_handshake(None):
            ep.abort()
            return
        threading.Thread(
            target=self._admit, args=(ep,), name="ucx-admit", daemon=True
        ).start()

    def _admit(self, ep: "ucxx.Endpoint") -> None:
        try:
            _handshake(ep, self._config, is_listener=True)
        except Exception as e:  # noqa: BLE001  a bad peer is logged and dropped, never fatal to the listener
            self._rejections.warning(type(e).__name__, f"rejected ucx pipe peer: {e}")
            _submit(_abort(ep))
            return
        finally:
            self._end_handshake(None)
        self._admitted(UcxPipe(ep, self._config))

    def _stop_listening(self) -> None:
        _submit(self._close_listener()).result()

    async def _close_listener(self) -> None:
        self._listener.close()


def listen(config: PipeConfig) -> UcxListener:
    return UcxListener(config)


def connect(config: PipeConfig, host: str, port: int) -> UcxPipe:
    try:
        ep = _wait(
            _submit(ucxx.create_endpoint(host, port, connect_timeout=config.timeout)),
            "ucx connect",
            config.timeout,
        )
    except PipeClosed as e:
        raise PipeError(
            f"cannot connect to ucx pipe listener {host}:{port}: {e}; is the peer up?"
        ) from None
    try:
        _handshake(ep, config, is_listener=False)
    except BaseException:
        _submit(_abort(ep))
        raise
    return UcxPipe(ep, config)


def _device(dest: Destination | None) -> torch.device:
    if isinstance(dest, torch.Tensor):
        return dest.device
    if isinstance(dest, RowScatter):
        return dest.tensor.device
    return dest[0].device if dest else torch.device("cpu")
