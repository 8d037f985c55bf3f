"""tcp: the embedded default pipe. Plain sockets, zero-copy sends, receives straight
into the destination tensor's memory.

Timeouts: every socket call waits at most `config.timeout` for progress. A recv
that times out before the first byte of a message leaves the pipe usable (the
caller may simply recv again); a timeout or error mid-message breaks the pipe,
because the byte stream can no longer be trusted. The handshake as a whole must
finish within `config.handshake_timeout`. The socket machinery (connect, listen,
handshake, exact reads, closing) is sockets.py, shared with torch_dist and nixl.
"""

import socket

import torch

from disagg.pipes import wire
from disagg.pipes.base import Destination, KVPipe, PipeConfig, fill
from disagg.pipes.row_scatter import RowScatter
from disagg.pipes.sockets import (
    Listener,
    byte_view,
    connect_socket,
    recv_exact_into,
    recv_tensor_metas,
    send_buffers,
    send_close,
    shut,
    socket_errors,
    to_host,
    writable,
)

STAGE_BYTES = 64 << 20  # each of the two pinned buffers CUDA views are received through


def _stage_groups(views: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive views in groups of at most STAGE_BYTES (a larger view is a group of its own)."""
    groups: list[list[torch.Tensor]] = []
    size = STAGE_BYTES
    for view in views:
        if size + view.nbytes > STAGE_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(view)
        size += view.nbytes
    return groups


def host_target(meta: wire.TensorMeta, out: torch.Tensor | None) -> torch.Tensor:
    """Where to receive a tensor's bytes: `out` itself when possible, else a host buffer."""
    if out is not None and out.device.type == "cpu" and out.is_contiguous():
        return out
    return torch.empty(
        meta.shape, dtype=meta.dtype, pin_memory=out is not None and out.is_cuda
    )


class TcpPipe(KVPipe):
    def __init__(self, sock: socket.socket, config: PipeConfig):
        super().__init__()
        self._sock = sock
        self._config = config
        self._stages: list[list] = []  # [pinned buffer, CUDA event] x 2, made by the first CUDA receive
        self._turn = 0

    def _send(self, header: bytes, tensors: list[torch.Tensor] | None, computed: bool) -> None:
        payload = [byte_view(to_host(t)) for t in tensors or []]
        with socket_errors("sending a message", self._config.timeout):
            send_buffers(self._sock, [header, *payload])

    def _takes_at_once(self) -> bool:
        return writable(self._sock)

    def _recv(self, out: list[Destination] | None) -> list[Destination] | None:
        metas = recv_tensor_metas(self._sock, self._config, out)
        if metas is None:
            return None
        received = []
        with socket_errors("receiving tensor data", self._config.timeout):
            for i, meta in enumerate(metas):
                dest = out[i] if out is not None else None
                if isinstance(dest, list) or (isinstance(dest, RowScatter) and dest.whole_rows):
                    self._recv_views(dest if isinstance(dest, list) else dest.views())  # bytes where they land
                    received.append(dest)
                elif isinstance(dest, RowScatter):  # some heads of each row: through one buffer
                    dest.fill(self._recv_tensor(meta, None))
                    received.append(dest)
                else:
                    received.append(self._recv_tensor(meta, dest))
        return received

    def _recv_views(self, views: list[torch.Tensor]) -> None:
        """View by view, with no buffer the size of the whole tensor: CPU views directly, CUDA
        views through pinned staging buffers (_recv_cuda_views)."""
        if views and views[0].is_cuda:
            self._recv_cuda_views(views)
            return
        for view in views:
            recv_exact_into(self._sock, byte_view(view))

    def _recv_cuda_views(self, views: list[torch.Tensor]) -> None:
        """Through two pinned buffers in turn: the socket fills one while the GPU copies out of the
        other, one multi-tensor copy per buffer (a KV cache's views number thousands, and a
        synchronous copy each cost more than the socket). Done when it returns, even by an error."""
        # The views' GPU, not the thread's current one: the events must be on the copies' stream.
        with torch.cuda.device(views[0].device):
            try:
                for group in _stage_groups(views):
                    nbytes = sum(view.nbytes for view in group)
                    buffer, copied = self._staging(nbytes)
                    copied.synchronize()  # the copies out of its previous contents are done
                    recv_exact_into(self._sock, byte_view(buffer[:nbytes]))
                    # one tensor's views: one dtype
                    fill(group, buffer[:nbytes].view(group[0].dtype), non_blocking=True)
                    copied.record()
            finally:
                for _, copied in self._stages:
                    copied.synchronize()

    def _staging(self, nbytes: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The next of the two pinned buffers (grown to nbytes) and the event after its last copies."""
        if not self._stages:
            self._stages = [[torch.empty(0, dtype=torch.uint8), torch.cuda.Event()] for _ in range(2)]
        self._turn = 1 - self._turn
        stage = self._stages[self._turn]
        if stage[0].numel() < nbytes:
            stage[1].synchronize()
            stage[0] = torch.empty(max(nbytes, STAGE_BYTES), dtype=torch.uint8, pin_memory=True)
        return stage[0], stage[1]

    def _recv_tensor(self, meta: wire.TensorMeta, dest: torch.Tensor | None) -> torch.Tensor:
        target = host_target(meta, dest)
        recv_exact_into(self._sock, byte_view(target))
        if dest is not None and dest is not target:
            dest.copy_(target)
        return dest if dest is not None else target

    def close(self) -> None:
        if self._closed:
            return
        self._say_goodbye(lambda: send_close(self._sock))
        self._closed = True
        shut(self._sock)


def listen(config: PipeConfig) -> Listener:
    return Listener(config, TcpPipe)


def connect(config: PipeConfig, host: str, port: int) -> TcpPipe:
    return TcpPipe(connect_socket(config, host, port), config)
