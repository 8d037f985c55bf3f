"""torch_dist: torch.distributed point-to-point over a private 2-member group per pipe.

Each connection gets its own groups, never the global default group, so a node can
hold any number of pipes. The listener's endpoint takes a TCP control connection
(the tcp pipe's handshake, auth included); the listener then hosts a TCPStore on a
free port for the pair's rendezvous. Headers travel over the control socket; tensor
bytes go over gloo (CPU tensors) or NCCL (CUDA tensors, when both sides have CUDA),
all tensors of one message in one batch of point-to-point ops (coalesced for NCCL).
Tensors travel as uint8 views, which sidesteps backends' dtype gaps (bool, bfloat16).

Unlike tcp, send() returns only once the peer's recv() has taken the message (gloo and
NCCL point-to-point are rendezvous): a send with no receiver waiting raises PipeTimeout
after config.timeout. With NCCL, one pipe should carry CUDA traffic in one direction at
a time: concurrent NCCL sends in opposite directions on one communicator can deadlock.
"""

import socket
import struct
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from disagg.pipes import tcp, wire
from disagg.pipes.base import KVPipe, PipeClosed, PipeConfig, PipeError, PipeTimeout

GLOO, NCCL = 0, 1  # which group carries a message's bytes, sent after its header
RENDEZVOUS = struct.Struct("!HB")  # listener -> connector: store port, has_cuda
HAS_CUDA = struct.Struct("!B")  # connector -> listener


def _make_groups(
    store: dist.Store, rank: int, local_ip: str, use_nccl: bool, config: PipeConfig
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    timeout = timedelta(seconds=config.timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # Bind gloo to the address the peer already reached us on, not whatever the hostname resolves to.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip)]
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, 2, options)
    nccl = None
    if use_nccl:
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = timeout
        nccl = dist.ProcessGroupNCCL(
            dist.PrefixStore("nccl", store), rank, 2, nccl_options
        )
    return gloo, nccl


class TorchDistPipe(KVPipe):
    def __init__(
        self,
        sock: socket.socket,
        config: PipeConfig,
        store: dist.Store,
        gloo: dist.ProcessGroup,
        nccl: dist.ProcessGroup | None,
    ):
        self._sock = sock
        self._config = config
        self._store = (
            store  # the listener side hosts it; keep it alive as long as the pipe
        )
        self._gloo = gloo
        self._nccl = nccl
        self._peer = 1 - gloo.rank()
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._closed = False
        self._broken: str | None = None

    def send(self, tensors: list[torch.Tensor] | None) -> None:
        with self._send_lock:
            self._check_usable()
            try:
                self._send(tensors)
            except PipeError as e:
                self._broken = str(e)
                raise

    def _send(self, tensors: list[torch.Tensor] | None) -> None:
        if tensors is None:
            with tcp.socket_errors("sending a message header", self._config.timeout):
                tcp.send_buffers(
                    self._sock, [wire.encode(wire.Kind.NONE), bytes([GLOO])]
                )
            return
        metas = [wire.TensorMeta.of(t) for t in tensors]
        on_cuda = any(t.is_cuda for t in tensors)
        if on_cuda and self._nccl is not None:
            backend, device = NCCL, next(t.device for t in tensors if t.is_cuda)
            tensors = [t.to(device).contiguous() for t in tensors]
        else:
            backend, tensors = GLOO, [tcp.to_host(t) for t in tensors]
        with tcp.socket_errors("sending a message header", self._config.timeout):
            tcp.send_buffers(
                self._sock, [wire.encode(wire.Kind.TENSORS, metas), bytes([backend])]
            )
        self._transfer(
            backend,
            [t.reshape(-1).view(torch.uint8) for t in tensors if t.numel()],
            send=True,
        )

    def recv(self, out: list[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
        with self._recv_lock:
            self._check_usable()
            try:
                return self._recv(out)
            except tcp.NoMessage:
                raise
            except PipeError as e:
                if self._closed:
                    raise PipeClosed("the pipe was closed locally") from None
                self._broken = str(e)
                raise

    def _recv(self, out: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        kind, metas = tcp.recv_header(self._sock, self._config)
        with tcp.socket_errors("receiving a message header", self._config.timeout):
            backend = tcp.recv_exact(self._sock, 1)[0]
        if kind == wire.Kind.CLOSE:
            raise PipeClosed("the peer closed the pipe")
        if kind == wire.Kind.NONE:
            return None
        if backend not in (GLOO, NCCL) or (backend == NCCL and self._nccl is None):
            raise wire.ProtocolError(
                f"peer chose backend {backend}, which this pipe did not set up"
            )
        if out is not None:
            wire.check_out(out, metas)
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == NCCL
            else torch.device("cpu")
        )
        targets = []
        for i, meta in enumerate(metas):
            dest = out[i] if out is not None else None
            if dest is not None and dest.device == device and dest.is_contiguous():
                targets.append(dest)
            else:
                targets.append(torch.empty(meta.shape, dtype=meta.dtype, device=device))
        self._transfer(
            backend,
            [t.reshape(-1).view(torch.uint8) for t in targets if t.numel()],
            send=False,
        )
        if out is None:
            return targets
        for dest, target in zip(out, targets):
            if dest is not target:
                dest.copy_(target)
        return out

    def _transfer(self, backend: int, buffers: list[torch.Tensor], send: bool) -> None:
        """All of one message's tensors in one batch of p2p ops, then wait for all of them."""
        if not buffers:
            return
        op = "send" if send else "recv"
        try:
            if backend == NCCL:
                # What batch_isend_irecv does for NCCL, on our private group: one grouped call.
                self._nccl._start_coalescing()
                for tag, buf in enumerate(buffers):
                    getattr(self._nccl, op)([buf], self._peer, tag)
                self._nccl._end_coalescing().wait()
            else:
                works = [
                    getattr(self._gloo, op)([buf], self._peer, tag)
                    for tag, buf in enumerate(buffers)
                ]
                for work in works:
                    work.wait()
        except RuntimeError as e:
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                raise PipeTimeout(
                    f"torch.distributed {op} made no progress for {self._config.timeout}s: {e}"
                ) from None
            raise PipeClosed(
                f"torch.distributed {op} failed, the peer is gone: {e}"
            ) from None

    def _check_usable(self) -> None:
        if self._closed:
            raise PipeClosed("the pipe was closed")
        if self._broken:
            raise PipeError(
                f"the pipe is broken and must be reconnected: {self._broken}"
            )

    def close(self) -> None:
        if self._closed:
            return
        if not self._broken and self._send_lock.acquire(timeout=1.0):
            try:
                self._sock.settimeout(1.0)
                self._sock.sendall(wire.encode(wire.Kind.CLOSE) + bytes([GLOO]))
            except OSError:
                pass
            finally:
                self._send_lock.release()
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._nccl is not None:
            self._nccl.abort()  # frees the communicator's GPU buffers now, not at exit


def _accept_pipe(sock: socket.socket, config: PipeConfig) -> TorchDistPipe:
    """Runs on the listener's admit thread after the handshake: host the pair's store."""
    local_ip = sock.getsockname()[0]
    store = dist.TCPStore(
        local_ip,
        0,
        world_size=2,
        is_master=True,
        timeout=timedelta(seconds=config.timeout),
        wait_for_workers=False,
    )
    with tcp.socket_errors("torch_dist rendezvous", config.timeout):
        sock.sendall(RENDEZVOUS.pack(store.port, torch.cuda.is_available()))
        (peer_cuda,) = HAS_CUDA.unpack(tcp.recv_exact(sock, HAS_CUDA.size))
    gloo, nccl = _make_groups(
        store, 0, local_ip, bool(peer_cuda) and torch.cuda.is_available(), config
    )
    return TorchDistPipe(sock, config, store, gloo, nccl)


def listen(config: PipeConfig) -> tcp.TcpListener:
    return tcp.TcpListener(config, make_pipe=_accept_pipe)


def connect(config: PipeConfig, host: str, port: int) -> TorchDistPipe:
    sock = tcp.connect_socket(config, host, port)
    try:
        with tcp.socket_errors("torch_dist rendezvous", config.timeout):
            store_port, peer_cuda = RENDEZVOUS.unpack(
                tcp.recv_exact(sock, RENDEZVOUS.size)
            )
            sock.sendall(HAS_CUDA.pack(torch.cuda.is_available()))
        try:
            store = dist.TCPStore(
                host,
                store_port,
                world_size=2,
                is_master=False,
                timeout=timedelta(seconds=config.timeout),
            )
            gloo, nccl = _make_groups(
                store,
                1,
                sock.getsockname()[0],
                bool(peer_cuda) and torch.cuda.is_available(),
                config,
            )
        except RuntimeError as e:
            raise PipeError(
                f"torch_dist: could not form the pair's process group with {host}: {e}"
            ) from None
    except BaseException:
        sock.close()
        raise
    return TorchDistPipe(sock, config, store, gloo, nccl)
