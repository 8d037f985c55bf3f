"""torch_dist: torch.distributed point-to-point over a private 2-member group per pipe.

Each connection gets its own groups, never the global default group, so a node can
hold any number of pipes. The listener's endpoint takes a TCP control connection
(connected and handshaken as the tcp pipe's, auth included: sockets.py), then a second
one, handshaken the same way, for the pair's rendezvous store (PairStore), which lives as
long as the pipe (NCCL forms its communicator at the first transfer). No TCPStore: it
would listen on every interface, for anyone's keys. Gloo's own connections check no token,
so once the groups are formed both sides check that gloo reaches the authenticated peer
(_check_pair).

A message's header goes over the control socket, followed by one route byte per
tensor saying how that tensor's bytes travel:
- NCCL: CUDA tensors, when both sides have CUDA. One tensor is one plain send; several
  go in one coalesced group (the benchmark's layer list).
- NCCL_WAITING: the same, for tensors the sender says are still being computed (send's
  computed=False: a layer-wise KV part queued behind the layers that compute it): the receive,
  queued as the header arrives, may then wait on the receiver's GPU, and a waiting NCCL kernel
  holds its CTAs' SMs. So these go through a second communicator of WAITING_MAX_CTAS CTAs
  (benchmarks/nccl_beside_decode.py on an H200 pair: GEMMs of an 8B decode step beside a waiting
  receive 10% slower with NCCL's own 24 CTAs, 5% with 8, 0.4% with 4, whose 512 MiB transfer
  reaches 132 GB/s against 321).
- INLINE: the CPU tensors of a message that also has CUDA tensors, and on a pair with
  CUDA a message of CPU tensors alone up to INLINE_MAX_BYTES (a lookup-buffer header or
  chunk message), follow the header on the control socket: they need neither a
  host-to-device copy nor a device sync on the receiver, nor a gloo rendezvous that
  would hold the sender until the receiver, busy with the parts before, comes to it.
- GLOO: everything else (no CUDA on one side, or larger CPU tensors).
Tensors travel as uint8 views, which sidesteps backends' dtype gaps (bool, bfloat16).

With gloo, send() returns only once the peer's recv() has taken the message (gloo
point-to-point is a rendezvous): a send with no receiver waiting raises PipeTimeout
after config.timeout. With NCCL, send() and recv() return once the transfer is queued
on the GPU, ordered before later work on the caller's current stream (like any NCCL
op); the socket carries the next header meanwhile. One pipe should carry CUDA traffic
in one direction at a time: concurrent NCCL sends in opposite directions on one
communicator can deadlock.
"""

import math
import os
import queue
import socket
import struct
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from disagg.pipes import sockets, wire
from disagg.pipes.base import Destination, KVPipe, PipeConfig, fill
from disagg.pipes.errors import NoMessage, PipeClosed, PipeError, PipeTimeout

INLINE, GLOO, NCCL, NCCL_WAITING = 0, 1, 2, 3  # a tensor's route, one byte per tensor after the header
WAITING_MAX_CTAS = 4  # the NCCL_WAITING communicator's CTAs (see above)
INLINE_MAX_BYTES = 64 << 10  # a message of CPU tensors alone this small goes on the control socket (GPU pairs)
# A connector's first byte on a handshaken connection: a new pipe, or the store connection of one.
PIPE, STORE = b"P", b"S"
PAIR_ID_BYTES = 16
PAIR_NONCE_BYTES = 16  # sent over gloo and over the control socket once the pair is formed (_check_pair)
RENDEZVOUS = struct.Struct(f"!{PAIR_ID_BYTES}sB")  # listener -> connector: the pair's id, has_cuda
HAS_CUDA = struct.Struct("!B")  # connector -> listener
# PairStore's requests (connector -> listener: op, then the keys and the value, with their sizes) and replies.
SET, GET, ADD, CHECK, WAIT = range(5)
REQUEST = struct.Struct("!BII")
REPLY = struct.Struct("!BI")  # ok, then the value (or the error) and its size
MAX_STORE_BYTES = 1 << 20  # keys or value of one request: gloo's and NCCL's are addresses and ids


class PairStore(dist.Store):
    """The pair's rendezvous store, where gloo and NCCL leave what the other side needs to connect
    (addresses, NCCL's unique id). The keys live on the listener's side (`host`), which also answers
    the connector's requests, sent over the pair's store connection: no other process can reach
    them. A key asked for waits up to the pipe's timeout for the other side to set it."""

    def __init__(self, sock: socket.socket, timeout: float, host: bool):
        super().__init__()
        self._sock = sock
        self._timeout = timeout
        self._host = host
        self._keys: dict[str, bytes] = {}  # the host's
        self._changed = threading.Condition()
        self._asking = threading.Lock()  # the connector's: one request at a time
        if host:
            sock.settimeout(None)  # requests may come whenever NCCL connects; close() ends the wait
            threading.Thread(target=self._serve, name="torch-dist-store", daemon=True).start()
        else:
            sock.settimeout(timeout + 5.0)  # a reply may wait the timeout for its key

    def set(self, key: str, value: bytes) -> None:
        self._do(SET, [key], value)

    def get(self, key: str) -> bytes:
        return self._do(GET, [key])

    def add(self, key: str, amount: int) -> int:
        return int(self._do(ADD, [key], str(amount).encode()))

    def check(self, keys: list[str]) -> bool:
        return self._do(CHECK, keys) == b"1"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._do(WAIT, keys)

    def close(self) -> None:
        sockets.shut(self._sock)

    def _do(self, op: int, keys: list[str], value: bytes = b"") -> bytes:
        return self._apply(op, keys, value) if self._host else self._ask(op, keys, value)

    def _apply(self, op: int, keys: list[str], value: bytes) -> bytes:
        """On the host: one operation on the keys, ours or the connector's."""
        with self._changed:
            if op in (SET, ADD):  # a number is kept as text, as TCPStore does: a get of the key reads it
                total = int(self._keys.get(keys[0], b"0")) + int(value) if op == ADD else 0
                self._keys[keys[0]] = value if op == SET else str(total).encode()
                self._changed.notify_all()
                return self._keys[keys[0]]
            there = all(key in self._keys for key in keys)
            if op == CHECK:
                return b"1" if there else b"0"
            if not there and not self._changed.wait_for(lambda: all(k in self._keys for k in keys), self._timeout):
                raise RuntimeError(f"torch_dist rendezvous: the peer did not set {keys} within {self._timeout}s "
                                   "(pipe timeout)")
            return self._keys[keys[0]] if op == GET else b""

    def _serve(self) -> None:
        """On the host's thread: answer the connector's requests until the pipe closes, or one
        makes no sense (the store connection is closed then)."""
        try:
            while True:
                op, key_bytes, value_bytes = REQUEST.unpack(sockets.recv_exact(self._sock, REQUEST.size))
                if op > WAIT or max(key_bytes, value_bytes) > MAX_STORE_BYTES:
                    return
                keys = sockets.recv_exact(self._sock, key_bytes).decode().split("\0")
                value = sockets.recv_exact(self._sock, value_bytes)
                try:
                    ok, reply = 1, self._apply(op, keys, value)
                except (RuntimeError, ValueError) as e:  # a key not set in time, or an add of no number
                    ok, reply = 0, str(e).encode()
                self._sock.sendall(REPLY.pack(ok, len(reply)) + reply)
        except (OSError, PipeError, UnicodeDecodeError):
            return  # the pipe closed
        finally:
            sockets.shut(self._sock)

    def _ask(self, op: int, keys: list[str], value: bytes) -> bytes:
        """On the connector: one operation on the host's keys."""
        key = "\0".join(keys).encode()
        with self._asking:
            try:
                self._sock.sendall(REQUEST.pack(op, len(key), len(value)) + key + value)
                ok, nbytes = REPLY.unpack(sockets.recv_exact(self._sock, REPLY.size))
                reply = sockets.recv_exact(self._sock, nbytes)
            except (OSError, PipeError) as e:
                raise RuntimeError(f"torch_dist rendezvous: the store connection failed: {e}") from None
        if not ok:
            raise RuntimeError(reply.decode(errors="replace"))
        return reply


def _make_groups(
    store: dist.Store, rank: int, local_ip: str, use_nccl: bool, config: PipeConfig
) -> tuple[dist.ProcessGroup, dict[int, dist.ProcessGroup]]:
    """gloo, and with CUDA on both sides the NCCL communicators by route (each formed at its first transfer)."""
    timeout = timedelta(seconds=config.timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # Bind gloo to the address the peer already reached us on, not whatever the hostname resolves to.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip)]
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, 2, options)
    nccl = {}
    if use_nccl:
        for route, prefix, max_ctas in ((NCCL, "nccl", None), (NCCL_WAITING, "nccl-waiting", WAITING_MAX_CTAS)):
            # A high-priority stream: a transfer's few blocks go ahead of the busy engine's queued compute
            # (the prefill or decode steps running beside it), not behind it.
            nccl_options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
            nccl_options._timeout = timeout
            if max_ctas is not None:
                nccl_options.config.max_ctas = max_ctas
            nccl[route] = dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, 2, nccl_options)
    return gloo, nccl


def _check_pair(sock: socket.socket, gloo: dist.ProcessGroup, config: PipeConfig) -> None:
    """Gloo's own connections check no token: a stranger that reaches a gloo listener between its
    address reaching the store and the peer's connect could take the peer's place. So each side sends
    a nonce both over gloo and over the (authenticated) control socket, and compares the two it gets:
    a pair whose gloo does not reach the peer that authenticated is refused (PipeError)."""
    mine, theirs = os.urandom(PAIR_NONCE_BYTES), torch.empty(PAIR_NONCE_BYTES, dtype=torch.uint8)
    with sockets.socket_errors("torch_dist pair check", config.timeout):
        sock.sendall(mine)
        told = sockets.recv_exact(sock, PAIR_NONCE_BYTES)
    peer = 1 - gloo.rank()
    try:
        works = [gloo.send([torch.frombuffer(bytearray(mine), dtype=torch.uint8)], peer, 0),
                 gloo.recv([theirs], peer, 0)]
        for work in works:
            work.wait()
    except RuntimeError as e:
        raise PipeError(f"torch_dist pair check: gloo did not reach the peer: {e}") from None
    if theirs.numpy().tobytes() != told:
        raise PipeError("torch_dist pair check: gloo's connection does not reach the peer that authenticated "
                        "(someone else connected to a gloo listener first); the pipe is refused")


class ControlReader:
    """The control socket, read through a buffer. Headers are a few dozen bytes and a
    sender that runs ahead queues several, so one recv() usually serves many messages:
    at 16 MiB NCCL needs ~60 us a message, and the receiver's CPU must keep up."""

    def __init__(self, sock: socket.socket, config: PipeConfig):
        self._sock = sock
        self._timeout = config.timeout
        self._max_message_bytes = config.max_message_bytes
        self._buf = bytearray(1 << 16)
        self._start = self._end = 0  # unread bytes are _buf[_start:_end]

    def message_head(self) -> tuple[wire.Kind, list[wire.TensorMeta], bytes]:
        """Kind, tensor metadata and route bytes of the next message."""
        if self._start == self._end:
            try:
                self._fill()
            except PipeTimeout as e:
                raise NoMessage(str(e)) from None
        header = wire.decode_header(self._take(wire.HEADER.size))
        metas = wire.decode_meta(self._take(header.meta_nbytes), header.count, self._max_message_bytes)
        return header.kind, metas, self._take(header.count)

    def read_into(self, view: memoryview) -> None:
        buffered = min(len(view), self._end - self._start)
        view[:buffered] = self._buf[self._start : self._start + buffered]
        self._start += buffered
        with sockets.socket_errors("receiving inline tensor data", self._timeout):
            sockets.recv_exact_into(self._sock, view[buffered:])

    def _take(self, n: int) -> bytes:
        while self._end - self._start < n:
            self._fill(n)
        data = bytes(self._buf[self._start : self._start + n])
        self._start += n
        return data

    def _fill(self, need: int = 1) -> None:
        if len(self._buf) - self._start < need:  # make room: move what is unread to the front
            unread = self._buf[self._start : self._end]
            self._buf = bytearray(max(len(self._buf), need))
            self._buf[: len(unread)] = unread
            self._start, self._end = 0, len(unread)
        with sockets.socket_errors("waiting for a message", self._timeout):
            got = self._sock.recv_into(memoryview(self._buf)[self._end :])
        if got == 0:
            raise PipeClosed("the peer closed the connection (or died)")
        self._end += got


class TorchDistPipe(KVPipe):
    def __init__(
        self,
        sock: socket.socket,
        config: PipeConfig,
        store: PairStore,
        gloo: dist.ProcessGroup,
        nccl: dict[int, dist.ProcessGroup],
    ):
        super().__init__()
        self._sock = sock
        self._reader = ControlReader(sock, config)
        self._config = config
        self._store = store  # as long as the pipe: NCCL asks it when it connects, at the first transfer
        self._gloo = gloo
        self._nccl = nccl  # by route; empty without CUDA on both sides
        self._peer = 1 - gloo.rank()

    def _send(self, header: bytes, tensors: list[torch.Tensor] | None, computed: bool) -> None:
        if tensors is None:
            self._send_control([header])
            return
        # Lean on purpose: at 16 MiB NCCL needs ~60 us a message, and this runs per message.
        cuda = [t for t in tensors if t.is_cuda]
        small = not cuda and sum(t.nbytes for t in tensors) <= INLINE_MAX_BYTES
        if self._nccl and (cuda or small):
            device = cuda[0].get_device() if cuda else -1  # the whole message goes through one GPU's communicator
            backend = NCCL if computed or not cuda else NCCL_WAITING
            routes = bytes(backend if t.is_cuda else INLINE for t in tensors)
            inline = [sockets.byte_view(t.contiguous()) for t in tensors if not t.is_cuda and t.numel()]
            bulk = [_flat_bytes(t if t.get_device() == device else t.to(device)) for t in cuda if t.numel()]
        else:
            routes, inline, backend = bytes([GLOO]) * len(tensors), [], GLOO
            bulk = [_flat_bytes(sockets.to_host(t)) for t in tensors if t.numel()]
        self._send_control([header, routes, *inline])
        self._transfer(backend, bulk, send=True)

    def _takes_at_once(self) -> bool:
        # Only on the control socket: without NCCL (gloo, on CPUs) a message's bytes wait for the peer's receive.
        return bool(self._nccl) and sockets.writable(self._sock)

    def _send_control(self, buffers: list) -> None:
        with sockets.socket_errors("sending a message header", self._config.timeout):
            sockets.send_buffers(self._sock, buffers)

    def _recv(self, out: list[Destination] | None) -> list[Destination] | None:
        kind, metas, routes = self._reader.message_head()
        metas = wire.message_metas(kind, metas, out)
        if metas is None:
            return None
        backend = next((route for route in (NCCL, NCCL_WAITING) if route in routes), GLOO)
        if not set(routes) <= {INLINE, backend} or (backend != GLOO and not self._nccl):
            raise wire.ProtocolError(f"peer chose routes {sorted(set(routes))}, which this pipe cannot take")
        # Where each tensor lands, as get_device() numbers it: the current GPU, or -1 for the CPU.
        gpu = torch.cuda.current_device() if backend != GLOO else -1
        targets, bulk = [], []
        for i, (meta, route) in enumerate(zip(metas, routes)):
            device = gpu if route in (NCCL, NCCL_WAITING) else -1
            dest = out[i] if out is not None else None
            if isinstance(dest, torch.Tensor) and dest.get_device() == device and dest.is_contiguous():
                target = dest  # else a buffer; views (a KV cache's blocks) are filled from it after the message
            else:  # flat for views: fill then needs no reshape
                shape = (math.prod(meta.shape),) if isinstance(dest, list) else meta.shape
                target = torch.empty(shape, dtype=meta.dtype, device=device if device >= 0 else "cpu")
            targets.append(target)
            if not target.numel():
                continue
            if route == INLINE:
                self._reader.read_into(sockets.byte_view(target))
            else:
                bulk.append(_flat_bytes(target))
        self._transfer(backend, bulk, send=False)
        if out is None:
            return targets
        for dest, target in zip(out, targets):
            if dest is not target:
                fill(dest, target)
        return out

    def _transfer(self, backend: int, buffers: list[torch.Tensor], send: bool) -> None:
        """All of one message's tensors on one backend as one batch of p2p ops."""
        if not buffers:
            return
        op = "send" if send else "recv"
        nccl = self._nccl.get(backend)
        try:
            if nccl is not None and len(buffers) == 1:
                # A plain p2p op, as raw NCCL does: less CPU per message than a group of one.
                getattr(nccl, op)(buffers, self._peer, 0).wait()
            elif nccl is not None:
                # What batch_isend_irecv does for NCCL, on our private group: one grouped call.
                nccl._start_coalescing()
                for tag, buf in enumerate(buffers):
                    getattr(nccl, op)([buf], self._peer, tag)
                nccl._end_coalescing().wait()
            else:
                works = [getattr(self._gloo, op)([buf], self._peer, tag) for tag, buf in enumerate(buffers)]
                for work in works:
                    work.wait()
        except RuntimeError as e:
            if "Duplicate GPU" in str(e):  # NCCL pairs no two processes on one GPU; its own words name no way out
                raise PipeError("torch_dist cannot carry KV between two processes on the same GPU (NCCL refuses "
                                "such a pair): use the nixl or tcp connector where a prefill and a decode "
                                "process share a GPU") from None
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                raise PipeTimeout(f"torch.distributed {op} made no progress for {self._config.timeout}s: {e}") from None
            raise PipeClosed(f"torch.distributed {op} failed, the peer is gone: {e}") from None

    def close(self) -> None:
        if self._closed:
            return
        self._say_goodbye(lambda: sockets.send_close(self._sock))
        self._closed = True
        sockets.shut(self._sock)
        self._store.close()
        for nccl in self._nccl.values():
            nccl.abort()  # frees the communicator's GPU buffers now, not at exit


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a tensor's bytes (any shape will do for a p2p op, a 0-d one is made 1-d)."""
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)


class PairSetup:
    """A listener's half of setting pipes up: each pipe's control connection, then its store
    connection, matched by the pair's id (random, and sent over the control connection alone)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[bytes, queue.Queue[socket.socket]] = {}  # pair id -> where its store connection goes

    def accept(self, sock: socket.socket, config: PipeConfig) -> TorchDistPipe | None:
        """On the listener's admit thread, after the handshake: the new pipe, or None for a store
        connection (handed to its pipe's setup)."""
        with sockets.socket_errors("torch_dist rendezvous", config.timeout):
            kind = sockets.recv_exact(sock, 1)
            if kind == STORE:
                pair_id = sockets.recv_exact(sock, PAIR_ID_BYTES)
                with self._lock:
                    handoff = self._waiting.pop(pair_id, None)
                if handoff is None:
                    raise wire.ProtocolError("a torch_dist store connection for no pipe being set up")
                handoff.put(sock)
                return None
            if kind != PIPE:
                raise wire.ProtocolError(f"unknown torch_dist connection kind {kind!r}")
            pair_id, handoff = os.urandom(PAIR_ID_BYTES), queue.Queue(maxsize=1)
            with self._lock:
                self._waiting[pair_id] = handoff
            try:
                sock.sendall(RENDEZVOUS.pack(pair_id, torch.cuda.is_available()))
                (peer_cuda,) = HAS_CUDA.unpack(sockets.recv_exact(sock, HAS_CUDA.size))
                store_sock = handoff.get(timeout=config.timeout)
            except queue.Empty:
                raise PipeTimeout(f"torch_dist rendezvous: the peer's store connection did not come within "
                                  f"{config.timeout}s (pipe timeout)") from None
            finally:
                with self._lock:
                    self._waiting.pop(pair_id, None)
        store = PairStore(store_sock, config.timeout, host=True)
        local_ip = sock.getsockname()[0]
        try:
            gloo, nccl = _make_groups(store, 0, local_ip, bool(peer_cuda) and torch.cuda.is_available(), config)
            _check_pair(sock, gloo, config)
        except BaseException:
            store.close()
            raise
        return TorchDistPipe(sock, config, store, gloo, nccl)


def listen(config: PipeConfig) -> sockets.Listener:
    return sockets.Listener(config, PairSetup().accept)


def connect(config: PipeConfig, host: str, port: int) -> TorchDistPipe:
    sock = sockets.connect_socket(config, host, port)
    store_sock = None
    try:
        with sockets.socket_errors("torch_dist rendezvous", config.timeout):
            sock.sendall(PIPE)
            pair_id, peer_cuda = RENDEZVOUS.unpack(sockets.recv_exact(sock, RENDEZVOUS.size))
            sock.sendall(HAS_CUDA.pack(torch.cuda.is_available()))
        store_sock = sockets.connect_socket(config, host, port)  # handshaken (authenticated) as the first
        with sockets.socket_errors("torch_dist rendezvous", config.timeout):
            store_sock.sendall(STORE + pair_id)
        store = PairStore(store_sock, config.timeout, host=False)
        try:
            gloo, nccl = _make_groups(
                store,
                1,
                sock.getsockname()[0],
                bool(peer_cuda) and torch.cuda.is_available(),
                config,
            )
            _check_pair(sock, gloo, config)
        except PipeError:
            raise
        except RuntimeError as e:
            raise PipeError(f"torch_dist: could not form the pair's process group with {host}: {e}") from None
    except BaseException:
        sock.close()
        if store_sock is not None:
            store_sock.close()
        raise
    return TorchDistPipe(sock, config, store, gloo, nccl)
