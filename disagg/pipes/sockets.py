"""sockets: the TCP socket machinery of the socket-based pipes. tcp carries whole messages on
the socket; torch_dist and nixl use it as their control connection. All three connect, listen
and handshake the same way, read a message's head the same way and close the same way.

The handshake as a whole must finish within `config.handshake_timeout`; after it, every
socket call waits at most `config.timeout` for progress. Who may handshake at a time is
HandshakeSlots' business.
"""

import select
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagg.pipes import wire
from disagg.pipes.base import Destination, KVPipe, PipeConfig, PipeListener
from disagg.pipes.errors import NoMessage, PipeClosed, PipeError, PipeTimeout
from disagg.rate_limited_log import RateLimitedLog

IOV_MAX = 1024  # sendmsg() takes at most this many buffers per call on Linux
MAX_KNOWN_HOSTS = 256  # addresses that passed a handshake, remembered (least recently passed forgotten)


class socket_errors:
    """Turn socket errors into pipe errors the caller can act on. A class rather than a
    @contextmanager generator: it wraps a socket call of every message, and costs a third."""

    def __init__(self, what: str, timeout: float):
        self.what, self.timeout = what, timeout

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: object) -> None:
        if kind is not None and issubclass(kind, TimeoutError):
            raise PipeTimeout(
                f"{self.what}: no progress for {self.timeout}s (pipe timeout); is the peer alive?"
            ) from None
        if kind is not None and issubclass(kind, OSError):
            raise PipeClosed(f"{self.what}: connection lost ({error})") from None


def send_buffers(sock: socket.socket, buffers: list) -> None:
    """Send all buffers with scatter-gather sendmsg: no copies, few syscalls."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + IOV_MAX])
        while sent:
            if sent >= len(views[i]):
                sent -= len(views[i])
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


def writable(sock: socket.socket) -> bool:
    """The socket would take a small write now without blocking: Linux polls a TCP socket writable
    while at least a third of its send buffer is free, and a write of a few hundred bytes then goes in
    whole (unless the kernel's TCP memory as a whole runs out, when a send waits out the socket's
    timeout). poll, not select: select fails on a descriptor above 1023. A closed socket is not."""
    fd = sock.fileno()
    if fd < 0:
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLOUT for _, events in poller.poll(0))


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise PipeClosed("the peer closed the connection (or died)")
        got += n


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    buf = bytearray(nbytes)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor. Via uint8 because numpy has no bfloat16."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with the same contents; CUDA goes through pinned memory."""
    if tensor.is_cuda:
        staging = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        staging.copy_(tensor)
        return staging
    return tensor.contiguous()


def configure(sock: socket.socket, config: PipeConfig) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(config.timeout)


def handshake_socket(
    sock: socket.socket, config: PipeConfig, is_listener: bool
) -> None:
    """The handshake under one deadline: a peer trickling a byte at a time cannot stretch it."""
    deadline = time.monotonic() + config.handshake_timeout

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return left

    def send(data: bytes) -> None:
        sock.settimeout(remaining())  # bounds all of sendall, not each chunk
        sock.sendall(data)

    def recv(nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        view, got = memoryview(buf), 0
        while got < nbytes:
            sock.settimeout(remaining())
            n = sock.recv_into(view[got:])
            if n == 0:
                raise PipeClosed("the peer closed the connection (or died)")
            got += n
        return bytes(buf)

    try:
        with socket_errors("pipe handshake", config.handshake_timeout):
            wire.handshake(send, recv, config.auth_token, is_listener)
    except PipeTimeout:
        raise PipeTimeout(
            f"pipe handshake not done within {config.handshake_timeout}s (handshake_timeout); "
            "is the peer a disagg pipe?"
        ) from None
    except PipeClosed as e:
        raise PipeClosed(
            f"{e}; the peer may have refused us: check kv_auth_token and versions on both, "
            "or it had too many handshakes in progress (retry)"
        ) from None
    sock.settimeout(config.timeout)


def recv_tensor_metas(sock: socket.socket, config: PipeConfig,
                      out: list[Destination] | None) -> list[wire.TensorMeta] | None:
    """The next message's tensor metadata (checked against `out`), None for a None message;
    PipeClosed if the peer closed the pipe."""
    kind, metas = recv_header(sock, config)
    return wire.message_metas(kind, metas, out)


def recv_header(
    sock: socket.socket, config: PipeConfig
) -> tuple[wire.Kind, list[wire.TensorMeta]]:
    """Header and metadata of the next message. PipeTimeout before its first byte is harmless."""
    buf = bytearray(wire.HEADER.size)
    view = memoryview(buf)
    try:
        with socket_errors("waiting for a message", config.timeout):
            got = sock.recv_into(view)
    except PipeTimeout as e:
        raise NoMessage(str(e)) from None
    if got == 0:
        raise PipeClosed("the peer closed the connection (or died)")
    with socket_errors("receiving a message header", config.timeout):
        recv_exact_into(sock, view[got:])
        header = wire.decode_header(bytes(buf))
        metas = wire.decode_meta(
            recv_exact(sock, header.meta_nbytes), header.count, config.max_message_bytes
        )
    return header.kind, metas


def send_close(sock: socket.socket) -> None:
    sock.settimeout(1.0)
    sock.sendall(wire.encode(wire.Kind.CLOSE))


def shut(sock: socket.socket) -> None:
    """Close a socket so that a recv blocked on it, ours included, wakes up at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


@dataclass(eq=False)  # each handshake is itself
class Handshake:
    """A peer in its handshake, holding one slot until it passes or fails."""
    host: str
    sock: socket.socket
    known: bool  # its address passed a handshake here before
    evicted: bool = False  # its slot was given to a newer peer, and its socket shut


class HandshakeSlots:
    """Which peers may handshake at a time. Strangers (addresses that never passed a handshake here)
    share `max_handshakes` slots, `max_handshakes_per_host` from one address; addresses that did (the
    peers this listener serves, reconnecting) have as many again of their own, which strangers
    cannot take, however many addresses they come from. A peer that finds its share full is not
    refused: it takes the slot of the oldest handshake in progress there (of the address holding
    the most), whose socket is shut. A real peer's handshake takes a round trip and an idle one
    seconds, so holding slots costs an attacker a steady flood of connections, never a few idle
    sockets; from the address of a known peer itself it must outpace that peer's round trip."""

    def __init__(self, config: PipeConfig, rejections: RateLimitedLog):
        self._config = config
        self._rejections = rejections
        self._lock = threading.Lock()
        self._pending: list[Handshake] = []  # oldest first
        self._known: OrderedDict[str, None] = OrderedDict()

    def take(self, host: str, sock: socket.socket) -> Handshake:
        with self._lock:
            known = host in self._known
            share = [h for h in self._pending if h.known == known]
            same_host = [h for h in share if h.host == host]
            victim, limit = None, ""
            if len(same_host) >= self._config.max_handshakes_per_host:
                victim, limit = same_host[0], "max_handshakes_per_host"
            elif len(share) >= self._config.max_handshakes:
                most, _ = Counter(h.host for h in share).most_common(1)[0]
                victim, limit = next(h for h in share if h.host == most), "max_handshakes"
            if victim is not None:
                victim.evicted = True
                self._pending.remove(victim)
            handshake = Handshake(host, sock, known)
            self._pending.append(handshake)
        if victim is not None:
            try:
                victim.sock.shutdown(socket.SHUT_RDWR)  # its thread wakes up and closes it
            except OSError:
                pass  # it ended meanwhile
            who = "known peers'" if known else "strangers'"
            self._rejections.warning(limit, f"dropped the oldest pipe handshake from {victim.host} for a new peer "
                                            f"from {host}: the {who} slots were full ({limit})")
        return handshake

    def give_back(self, handshake: Handshake, passed: bool) -> None:
        with self._lock:
            if not handshake.evicted:
                self._pending.remove(handshake)
            if passed:
                self._known[handshake.host] = None
                self._known.move_to_end(handshake.host)
                if len(self._known) > MAX_KNOWN_HOSTS:
                    self._known.popitem(last=False)


class Listener(PipeListener):
    """Accepts peers on a background thread; each one is handshaken on its own thread,
    so a slow or bad peer never blocks the others and never stops the listener.
    `make_pipe` turns a handshaken socket into the transport's pipe, on that thread too, or
    returns None for a connection that is not a pipe of its own (torch_dist's store connection)."""

    def __init__(
        self,
        config: PipeConfig,
        make_pipe: Callable[[socket.socket, PipeConfig], KVPipe | None],
    ):
        super().__init__(config)
        self._make_pipe = make_pipe
        self._slots = HandshakeSlots(config, self._rejections)
        try:
            self._sock = socket.create_server(
                (config.kv_ip, config.kv_port), backlog=128
            )
        except OSError as e:
            raise PipeError(
                f"cannot listen on {config.kv_ip}:{config.kv_port}: {e}; pick a free kv_port"
            ) from None
        self._sock.settimeout(0.2)  # lets the accept loop notice close()
        threading.Thread(
            target=self._accept_loop, name="pipe-accept", daemon=True
        ).start()

    @property
    def address(self) -> tuple[str, int]:
        return self._sock.getsockname()[:2]

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._closed.is_set():
                    return
                # Out of file descriptors or memory, for now: keep listening, slowly.
                self._rejections.warning("accept", f"pipe listener: accept failed: {e}")
                time.sleep(0.1)
                continue
            handshake = self._slots.take(peer[0], sock)
            threading.Thread(
                target=self._admit, args=(handshake, peer), name="pipe-admit", daemon=True
            ).start()

    def _admit(self, handshake: Handshake, peer: tuple) -> None:
        sock, passed = handshake.sock, False
        try:
            try:
                configure(sock, self._config)
                handshake_socket(sock, self._config, is_listener=True)
                passed = True
            finally:
                self._slots.give_back(handshake, passed)
            pipe = self._make_pipe(sock, self._config)
        except Exception as e:  # noqa: BLE001  a bad peer is logged and dropped, never fatal to the listener
            if passed or not handshake.evicted:  # an eviction was logged as it happened
                self._rejections.warning(type(e).__name__, f"rejected pipe peer {peer[0]}:{peer[1]}: {e}")
            sock.close()
            return
        if pipe is not None:
            self._admitted(pipe)

    def _stop_listening(self) -> None:
        self._sock.close()


def connect_socket(config: PipeConfig, host: str, port: int) -> socket.socket:
    """A handshaken TCP connection to a listener."""
    try:
        sock = socket.create_connection((host, port), timeout=config.timeout)
    except OSError as e:
        raise PipeError(
            f"cannot connect to pipe listener {host}:{port}: {e}; is the peer up?"
        ) from None
    try:
        configure(sock, config)
        handshake_socket(sock, config, is_listener=False)
    except BaseException:
        sock.close()
        raise
    return sock
