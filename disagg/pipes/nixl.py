"""nixl: one-sided NIXL writes (UCX backend), the transfer library vLLM, SGLang and Dynamo use.

Each connection is a TCP control socket (connected and handshaken as the tcp pipe's, auth
included: sockets.py) and a NIXL agent of its own on each side; the two agents' metadata cross
the control socket right after the handshake. A message:

    sender   -> its header (wire format) on the control socket
    receiver -> where each non-empty tensor goes: NIXL metadata blobs for the sender to load, then
                regions (address, bytes, device) per tensor. A destination inside memory the
                receiver registered once (`register`: a KV cache; a RowScatter's runs of rows, a view)
                needs no blob: that memory's metadata went with the first message after it was
                registered, once. Any other destination (new tensors, other `out` memory, some heads
                of each row) gets a place in the pipe's staging memory, which is registered once
                too: a buffer per device and power-of-two size, kept for the connection's life (at
                most about twice its largest message), its metadata with the first message that uses it.
    sender   -> one NIXL WRITE per tensor from its registered tensor into those regions, each
                with the notification "<message number>:<tensor>"
    receiver -> waits for all of the message's notifications, then copies what landed in staging to
                its destinations.
Nothing the receiver hands out is ever registered for one message and freed: the allocator would
hand the same addresses out again, and the peer's agent, which still holds them under the old keys,
refuses to load them anew (NIXL_ERR_NOT_ALLOWED).

A peer writes only into regions the receiver handed out for the message being received, and a
message is received only once notifications naming it have come for each of its tensors. Memory
registered once stays writable by the peer's agent for the connection's life: the peer's code, not
the hardware, keeps to the regions it was handed. CPU tensors travel as DRAM, CUDA tensors as
VRAM. Like gloo, a send waits for the receiver to take the message. A dead peer is noticed by its
control socket closing while we wait, and any wait ends after config.timeout without progress
(PipeTimeout).

Writes outlive nothing they may land in (docs/ARCHITECTURE.md, "Pipes"): a pipe's control socket
closes only once none of its own writes is in flight (close waits for them, a bounded time), so a
peer's socket closing means its writes have ended, or its process has. A receive that is cut off
(a local close, a timeout) waits up to DRAIN_S for its writes to end or the peer's socket to
close; if neither happens, memory the pipe allocated is kept aside for good, memory registered
once stays registered and alive for good, and a receive into the caller's destinations (registered
ones included) raises PeerMayWrite: the caller must never reuse them.
"""

import contextlib
import logging
import os
import select
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass

import torch

from disagg.pipes import sockets, wire
from disagg.pipes.base import Destination, KVPipe, PipeConfig, fill
from disagg.pipes.errors import PeerMayWrite, PipeClosed, PipeError, PipeTimeout, ProtocolError
from disagg.pipes.row_scatter import RowScatter

# NIXL logs each agent's creation at INFO on stdout: keep stdout for the program.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
try:
    from nixl_cu12._api import nixl_agent, nixl_agent_config
except ImportError:
    try:  # the CUDA 13 wheel
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise ImportError(
                f"the nixl pipe needs NIXL ({e}): pip install nixl-cu12 or nixl-cu13 (or pip install 'disagg[nixl]')"
            ) from e

log = logging.getLogger(__name__)

METADATA_LEN = struct.Struct("!I")
MAX_METADATA_BYTES = 1 << 20  # an agent's metadata is a few KiB
BLOBS = struct.Struct("!I")  # metadata blobs that answer a header: as long as wire.MAGIC, to tell a goodbye
MAX_BLOBS = 64  # a blob per memory registered once since the last message (staging included)
STAGING_BLOBS = 4  # of those, kept for a message's staging: its destinations lie on at most this many devices
STAGING_ALIGN = 256  # bytes: each view's place in staging starts at a multiple of this
TENSOR_REGIONS = struct.Struct("!IB")  # regions of one tensor, is VRAM
REGION = struct.Struct("!QQQ")  # address, bytes, device id
MAX_REGIONS = 1 << 20  # per tensor: a KV cache's views are layers x 2 x runs of blocks
# Between checks of a transfer's state or of new notifications: from FIRST_POLL_S, doubling up to
# POLL_S. A message's writes often end within a few hundred microseconds (16 MiB over NVLink takes
# 60 us), so a fixed 200 us pause on each side was most of a message's time.
FIRST_POLL_S = 0.00001
POLL_S = 0.0002
DRAIN_S = 5.0  # a cut-off receive waits this long for the peer's writes in flight to end
# Memory of receives cut off while the peer could still write into it: kept (registered, alive)
# for the life of the process rather than handed back for reuse.
_quarantined: list = []


@dataclass
class _Registration:
    """Memory registered once (NixlPipe.register), for the connection's life."""
    tensor: torch.Tensor  # holds the memory while it is registered
    descs: object  # the agent's registration (nixlRegDList)
    device: int  # CUDA device, -1 on the CPU
    start: int  # address range [start, end)
    end: int
    announced: bool = False  # its metadata went to the peer

    def holds(self, view: torch.Tensor) -> bool:
        start = view.data_ptr()
        return view.get_device() == self.device and self.start <= start and start + view.nbytes <= self.end


class NixlPipe(KVPipe):
    def __init__(self, sock: socket.socket, config: PipeConfig, agent: nixl_agent, peer: str):
        super().__init__()
        self._sock = sock
        self._config = config
        self._agent = agent
        self._peer = peer  # the peer agent's name
        self._sent = 0  # tensor messages sent, which number their notifications
        self._received = 0
        # Messages whose writes (ours, or the peer's into our memory) may be in flight: close()
        # waits for them before the socket closes, and once it has begun no new one starts.
        self._writing = 0
        self._unsettled = False  # a write of ours never ended: the socket stays open for good
        self._writes_done = threading.Condition()  # guards the two above and the setting of _closed
        self._cut_off = False  # a send ended mid-message: no goodbye may follow its header
        # Memory registered once; added and dropped under _writes_done, never while a receive uses it.
        self._registered: list[_Registration] = []
        # (device, bytes) -> staging memory (registered once) for what lands outside the above (_staged)
        self._staging: dict[tuple[torch.device, int], torch.Tensor] = {}

    def register(self, tensor: torch.Tensor) -> None:
        """Receive into `tensor` (a KV cache), or send from it, from now on with no registration and
        no metadata per message: registered with our agent now, its metadata sent with the next
        message's answer, once; deregistered when the pipe closes (kept registered for good if a
        receive into it was cut off while the peer may still write). A no-op for memory inside memory
        registered already, and for a tensor that is not contiguous (it is registered per message)."""
        if not tensor.is_contiguous() or not tensor.numel():
            return
        with self._recv_lock:
            self._check_usable()
            self._register_once(tensor, MAX_BLOBS - STAGING_BLOBS)

    def _register_once(self, tensor: torch.Tensor, most: int = MAX_BLOBS) -> None:
        """Under the receive lock; `most`: registrations not yet announced to the peer, this one included."""
        with self._writes_done:
            if any(reg.holds(tensor) for reg in self._registered):
                return
            if sum(not reg.announced for reg in self._registered) >= most:
                raise ValueError(f"at most {most} tensors may be registered between two messages")
        descs = self._agent.register_memory(tensor)
        start = tensor.data_ptr()
        registration = _Registration(tensor, descs, tensor.get_device(), start, start + tensor.nbytes)
        with self._writes_done:
            if not self._closed:
                self._registered.append(registration)
                return
        self._agent.deregister_memory(descs)
        raise PipeClosed("the pipe was closed locally")

    def _send(self, header: bytes, tensors: list[torch.Tensor] | None, computed: bool) -> None:
        self._send_control(header)
        try:
            self._send_tensors(tensors)
        except BaseException:
            self._cut_off = True
            raise

    def _send_tensors(self, tensors: list[torch.Tensor] | None) -> None:
        if tensors is None:
            return
        sources = [t.contiguous() for t in tensors if t.numel()]
        number, self._sent = self._sent, self._sent + 1
        if not sources:
            return
        self._load_blobs()
        regions = [self._read_regions() for _ in sources]
        with self._writes_in_flight():
            self._write_all(number, sources, regions)

    def _write_all(self, number: int, sources: list[torch.Tensor], regions: list) -> None:
        """Write each source into its regions of the peer's memory and wait until all are done.
        Sources outside memory registered once are registered for this message alone."""
        with self._writes_done:
            own = [s for s in sources if not any(reg.holds(s) for reg in self._registered)]
        registered = self._register_per_device(own)
        handles = []
        try:
            for i, (source, (vram, dest)) in enumerate(zip(sources, regions)):
                handles.append(self._write(source, vram, dest, f"{number}:{i}".encode()))
            deadline, pause = time.monotonic() + self._config.timeout, FIRST_POLL_S
            for handle in handles:
                while (state := self._agent.check_xfer_state(handle)) != "DONE":
                    if state == "ERR":
                        raise PipeClosed("a NIXL write failed: the peer is gone")
                    pause = self._wait(deadline, "sending tensor data", pause)
        except BaseException:
            if not self._settle(handles):  # still writing: neither the handles nor the sources may go
                self._unsettled = True
                _quarantined.append((registered, sources, handles))
                log.warning("a cut-off NIXL send's writes did not end within %ss; its memory is kept aside", DRAIN_S)
                handles = registered = None
            raise
        finally:
            for handle in handles or []:
                self._agent.release_xfer_handle(handle)
            for descs in registered or []:
                self._agent.deregister_memory(descs)

    def _register_per_device(self, tensors: list[torch.Tensor]) -> list:
        """Register the sources of one message (local memory: the peer loads no metadata of it): a
        descriptor list per device, as NIXL registers a list of tensors only if they share one."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for tensor in tensors:
            by_device.setdefault(tensor.device, []).append(tensor)
        registered = []
        try:
            for group in by_device.values():
                registered.append(self._agent.register_memory(group))
        except BaseException:
            for descs in registered:
                self._agent.deregister_memory(descs)
            raise
        return registered

    def _load_blobs(self) -> None:
        """Load the metadata blobs of the receiver's memory that answer our header."""
        with sockets.socket_errors("receiving the receiver's answer", self._config.timeout):
            raw = sockets.recv_exact(self._sock, BLOBS.size)
        if raw == wire.MAGIC:  # a header where the answer should be: the peer's goodbye
            raise PipeClosed("receiving the receiver's answer: the peer closed the pipe")
        (count,) = BLOBS.unpack(raw)
        if count > MAX_BLOBS:
            raise ProtocolError(f"the peer sent {count} NIXL metadata blobs for one message; at most {MAX_BLOBS}")
        for _ in range(count):
            name = self._agent.add_remote_agent(_read_metadata(self._sock, self._config, "the receiver's memory"))
            if (name.decode() if isinstance(name, bytes) else name) != self._peer:
                raise ProtocolError(f"the peer sent NIXL metadata of another agent ({name!r})")

    def _settle(self, handles: list) -> bool:
        """After a cut-off send: wait a bounded time for its writes in flight to end."""
        deadline = time.monotonic() + min(self._config.timeout, DRAIN_S)
        while any(self._agent.check_xfer_state(handle) == "PROC" for handle in handles):
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    @contextlib.contextmanager
    def _writes_in_flight(self):
        """Around a message's writes, ours or the peer's: close() waits for them to end."""
        with self._writes_done:
            if self._closed:
                raise PipeClosed("the pipe was closed locally")
            self._writing += 1
        try:
            yield
        finally:
            with self._writes_done:
                self._writing -= 1
                self._writes_done.notify_all()

    def _write(self, source: torch.Tensor, vram: bool, dest: list[tuple[int, int, int]], notif: bytes):
        """Start a WRITE of `source`'s bytes, in order, into the peer's regions `dest`."""
        if sum(nbytes for _, nbytes, _ in dest) != source.numel() * source.element_size():
            raise ProtocolError("the peer's regions do not add up to the tensor's bytes")
        device = max(source.get_device(), 0)
        local, offset = [], source.data_ptr()
        for _, nbytes, _ in dest:
            local.append((offset, nbytes, device))
            offset += nbytes
        handle = self._agent.initialize_xfer(
            "WRITE",
            self._agent.get_xfer_descs(local, "VRAM" if source.is_cuda else "DRAM"),
            self._agent.get_xfer_descs(dest, "VRAM" if vram else "DRAM"),
            self._peer,
            notif,
        )
        if self._agent.transfer(handle) == "ERR":
            raise PipeClosed("a NIXL write failed to start: the peer is gone")
        return handle

    def _read_regions(self) -> tuple[bool, list[tuple[int, int, int]]]:
        with sockets.socket_errors("receiving the peer's memory regions", self._config.timeout):
            count, vram = TENSOR_REGIONS.unpack(sockets.recv_exact(self._sock, TENSOR_REGIONS.size))
            if count > MAX_REGIONS:
                raise ProtocolError(f"the peer named {count} memory regions for one tensor; at most {MAX_REGIONS}")
            data = sockets.recv_exact(self._sock, count * REGION.size)
        return bool(vram), list(REGION.iter_unpack(data))

    def _send_control(self, data: bytes) -> None:
        with sockets.socket_errors("sending on the control socket", self._config.timeout):
            self._sock.sendall(data)

    def _recv(self, out: list[Destination] | None) -> list[Destination] | None:
        metas = sockets.recv_tensor_metas(self._sock, self._config, out)
        if metas is None:
            return None
        number, self._received = self._received, self._received + 1
        targets = [_target(meta, out[i] if out is not None else None) for i, meta in enumerate(metas)]
        written = [[v for v in target if v.numel()] for target in targets]
        written = [views for views in written if views]  # the tensors the sender writes, in order
        if written:
            _copy_out(self._receive_writes(number, written, into_callers=out is not None))
        if out is None:
            return [target[0] for target in targets]
        for dest, target in zip(out, targets):
            staged = isinstance(dest, RowScatter) and not dest.whole_rows
            if staged or (isinstance(dest, torch.Tensor) and target[0] is not dest):  # else written where it lands
                fill(dest, target[0])
        return out

    def _receive_writes(self, number: int, written: list[list[torch.Tensor]],
                        into_callers: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Hand the peer the regions message `number` goes to and wait for every write's notification.
        Views outside memory registered once land in this pipe's staging memory instead: returns
        (view, where it landed) for each, to be copied once the message is in."""
        expected = {f"{number}:{i}".encode() for i in range(len(written))}
        with self._writes_in_flight():  # close() waits for it
            with self._writes_done:
                own = [v for views in written for v in views if not any(reg.holds(v) for reg in self._registered)]
            landed = self._staged(own)
            staged = {id(view): where for view, where in landed}
            regions = b"".join(_regions([staged.get(id(v), v) for v in views]) for views in written)
            try:
                new = [reg for reg in self._registered if not reg.announced]
                blobs = [self._agent.get_partial_agent_metadata(reg.descs, False) for reg in new]
                answer = [BLOBS.pack(len(blobs)), *(METADATA_LEN.pack(len(blob)) + blob for blob in blobs), regions]
                self._send_control(b"".join(answer))
                for reg in new:
                    reg.announced = True
                self._await_notifs(expected)
            except BaseException as e:
                if self._drain_notifs(expected):
                    raise
                # Never deregistered, never freed: the memory registered once, staging included.
                _quarantined.append(self._registered)
                with self._writes_done:
                    self._registered, self._staging = [], {}
                nbytes = sum(v.nbytes for views in written for v in views)
                if into_callers and len(own) < sum(map(len, written)):
                    raise PeerMayWrite(f"{e}; the peer may still write into the {nbytes} bytes of the receive's "
                                       "destinations: they must not be reused") from None
                log.warning("a cut-off NIXL receive keeps %d bytes aside: the peer may still write there", nbytes)
                raise
        return landed

    def _staged(self, views: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A place in staging memory for each view, (view, place). Staging is registered once, a buffer
        per device and power-of-two size, kept for the connection's life: memory registered per message
        and freed after would come back at the same addresses, which the peer's agent already holds
        under the old registration's keys, and NIXL refuses such a load (NIXL_ERR_NOT_ALLOWED)."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for view in views:
            by_device.setdefault(view.device, []).append(view)
        landed = []
        for device, group in by_device.items():
            offsets, total = [], 0
            for view in group:
                offsets.append(total)
                total += -(-view.nbytes // STAGING_ALIGN) * STAGING_ALIGN
            size = 1 << (total - 1).bit_length()
            buffer = self._staging.get((device, size))
            if buffer is None:
                buffer = torch.empty(size, dtype=torch.uint8, device=device)
                self._register_once(buffer)
                self._staging[(device, size)] = buffer
            for view, offset in zip(group, offsets):
                place = buffer[offset:offset + view.nbytes].view(view.dtype).view(view.shape)
                landed.append((view, place))
        return landed

    def _await_notifs(self, expected: set[bytes]) -> None:
        deadline, pause = time.monotonic() + self._config.timeout, FIRST_POLL_S
        while True:
            for notif in self._agent.get_new_notifs().get(self._peer, []):
                expected.discard(notif)
                deadline = time.monotonic() + self._config.timeout  # progress
            if not expected:
                return
            pause = self._wait(deadline, "receiving tensor data", pause)

    def _drain_notifs(self, expected: set[bytes]) -> bool:
        """After a cut-off receive: wait a bounded time for the writes already started to end, or
        for the peer's socket to close (its writes have then ended, or its process has)."""
        deadline = time.monotonic() + min(self._config.timeout, DRAIN_S)
        while expected and time.monotonic() < deadline:
            for notif in self._agent.get_new_notifs().get(self._peer, []):
                expected.discard(notif)
            if self._peer_gone():
                return True
        return not expected

    def _wait(self, deadline: float, what: str, pause: float) -> float:
        """Between two polls, `pause` long: raise if the time is up, the pipe was closed here or the
        peer's control socket closed. Returns the pause before the next poll (twice this one, at
        most POLL_S)."""
        if self._closed:
            raise PipeClosed(f"{what}: the pipe was closed locally")
        if time.monotonic() > deadline:
            raise PipeTimeout(f"{what}: no progress for {self._config.timeout}s (pipe timeout); is the peer alive?")
        try:
            if self._peer_gone(pause):
                raise PipeClosed(f"{what}: the peer closed the connection (or died)")
        except OSError as e:
            raise PipeClosed(f"{what}: connection lost ({e})") from None
        return min(2 * pause, POLL_S)

    def _peer_gone(self, pause: float = POLL_S) -> bool:
        """Wait up to `pause` for the control socket: True if the peer has closed it."""
        # select first: a socket with a timeout waits that long in recv, even with MSG_DONTWAIT.
        readable, _, _ = select.select([self._sock], [], [], pause)
        if not readable:
            return False
        try:
            if self._sock.recv(1, socket.MSG_PEEK) == b"":
                return True
        except OSError:
            return True
        time.sleep(pause)  # the peer's next header may wait there: poll on
        return False

    def close(self) -> None:
        """Close; a send or receive under way stops at its next poll, and the socket closes once
        their writes have ended (at most DRAIN_S and a poll later). If ours never end, it stays open
        for good: the peer must not take our writes for ended."""
        with self._writes_done:
            if self._closed:
                return
            self._closed = True
            self._writes_done.wait_for(lambda: not self._writing, DRAIN_S + 1.0)
            settled = not self._writing and not self._unsettled
            registered, self._registered = self._registered, []
        if not settled:
            _quarantined.append((self._sock, registered))
            log.warning("a NIXL connection whose writes did not end is left open for good")
            return
        for reg in registered:  # no write of the peer's is in flight: none can land there any more
            self._agent.deregister_memory(reg.descs)
        # Under the send lock, so that a send cut off meanwhile is seen: no goodbye after its header.
        self._say_goodbye(lambda: None if self._cut_off else sockets.send_close(self._sock))
        sockets.shut(self._sock)


def _copy_out(landed: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each view's bytes out of staging; done when it returns (as tcp's receive), since the next
    message may land in the same staging memory."""
    for view, staged in landed:
        view.copy_(staged)
    for device in {view.device for view, _ in landed if view.is_cuda}:
        with torch.cuda.device(device):  # the copies went on this device's current stream
            done = torch.cuda.Event()
            done.record()
            done.synchronize()


def _target(meta: wire.TensorMeta, dest: Destination | None) -> list[torch.Tensor]:
    """The contiguous tensors that receive one tensor's bytes, in order."""
    if isinstance(dest, list):
        return dest  # check_out made sure they are contiguous
    if isinstance(dest, RowScatter) and dest.whole_rows:
        return dest.views()
    if isinstance(dest, RowScatter):  # some heads of each row: the peer writes into one buffer, then filled
        return [torch.empty(meta.shape, dtype=meta.dtype, device=dest.tensor.device)]
    if dest is not None and dest.is_contiguous():
        return [dest]
    device = dest.device if dest is not None else torch.device("cpu")
    return [torch.empty(meta.shape, dtype=meta.dtype, device=device)]


def _regions(views: list[torch.Tensor]) -> bytes:
    vram = views[0].is_cuda
    parts = [TENSOR_REGIONS.pack(len(views), vram)]
    for view in views:
        if view.is_cuda != vram:
            raise ProtocolError("the views of one tensor must all be on the CPU or all on GPUs")
        parts.append(REGION.pack(view.data_ptr(), view.numel() * view.element_size(), max(view.get_device(), 0)))
    return b"".join(parts)


def _read_metadata(sock: socket.socket, config: PipeConfig, what: str) -> bytes:
    with sockets.socket_errors(f"receiving NIXL metadata of {what}", config.timeout):
        raw = sockets.recv_exact(sock, METADATA_LEN.size)
        if raw == wire.MAGIC:  # a header where the answer should be: the peer's goodbye
            raise PipeClosed(f"receiving NIXL metadata of {what}: the peer closed the pipe")
        (length,) = METADATA_LEN.unpack(raw)
        if length > MAX_METADATA_BYTES:
            raise ProtocolError(f"NIXL metadata of {what} claims {length} bytes; at most {MAX_METADATA_BYTES}")
        return sockets.recv_exact(sock, length)


def _agent_pair(sock: socket.socket, config: PipeConfig) -> tuple[nixl_agent, str]:
    """After the handshake: a new agent for this connection, with the peer's agent added to it."""
    agent = nixl_agent(f"disagg-{uuid.uuid4().hex}", nixl_agent_config(backends=["UCX"]))
    metadata = agent.get_agent_metadata()
    with sockets.socket_errors("sending NIXL agent metadata", config.timeout):
        sock.sendall(METADATA_LEN.pack(len(metadata)) + metadata)
    try:
        peer = agent.add_remote_agent(_read_metadata(sock, config, "the peer's agent"))
    except PipeError:
        raise
    except Exception as e:  # noqa: BLE001  NIXL raises its own types: name the cause, never crash the listener
        raise ProtocolError(f"the peer's NIXL agent metadata was refused: {e!r:.300}") from None
    return agent, peer.decode() if isinstance(peer, bytes) else peer


def _accept_pipe(sock: socket.socket, config: PipeConfig) -> NixlPipe:
    return NixlPipe(sock, config, *_agent_pair(sock, config))


def listen(config: PipeConfig) -> sockets.Listener:
    return sockets.Listener(config, _accept_pipe)


def connect(config: PipeConfig, host: str, port: int) -> NixlPipe:
    sock = sockets.connect_socket(config, host, port)
    try:
        return NixlPipe(sock, config, *_agent_pair(sock, config))
    except BaseException:
        sock.close()
        raise
