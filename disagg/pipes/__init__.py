"""Pipes: FIFOs of tensor lists between two endpoints. Pick one by name:

    listener = listen("tcp", PipeConfig(kv_port=0)); pipe = listener.accept()
    pipe = connect("tcp", config, host, port)

Each transport is one module with `listen(config)` and `connect(config, host, port)`,
imported only when chosen, so a missing optional dependency (ucxx) only matters to
whoever picks that pipe.
"""

import importlib

from disagg.pipes.base import KVPipe, PipeConfig, PipeListener
from disagg.pipes.errors import AuthError, PeerMayWrite, PipeClosed, PipeError, PipeTimeout, ProtocolError
from disagg.pipes.row_scatter import RowScatter

PIPES = ("tcp", "torch_dist", "ucx", "nixl")

__all__ = [
    "PIPES",
    "AuthError",
    "KVPipe",
    "PeerMayWrite",
    "PipeClosed",
    "PipeConfig",
    "PipeError",
    "PipeListener",
    "PipeTimeout",
    "ProtocolError",
    "RowScatter",
    "connect",
    "listen",
]


def _transport(name: str):
    if name not in PIPES:
        raise ValueError(f"unknown pipe {name!r}; known pipes: {', '.join(PIPES)}")
    return importlib.import_module(f"disagg.pipes.{name}")


def listen(name: str, config: PipeConfig) -> PipeListener:
    """Bind config.kv_ip:config.kv_port (port 0 picks a free one) and accept peers."""
    return _transport(name).listen(config)


def connect(name: str, config: PipeConfig, host: str, port: int) -> KVPipe:
    """Connect to a peer's listener at host:port."""
    return _transport(name).connect(config, host, port)
