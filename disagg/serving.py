"""Running a node: its HTTP server (and gRPC server) in one event loop, one ready line, clean shutdown."""

import asyncio
import logging

import uvicorn
from fastapi import FastAPI

from disagg.config import KVTransferConfig
from disagg.control_plane import NodeInfo
from disagg.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)


async def serve_http(app: FastAPI, host: str, port: int, ready_line: str, log_level: str) -> None:
    """Serve until SIGINT/SIGTERM; print `ready_line` once the socket listens."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                           access_log=False, timeout_graceful_shutdown=5))
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if task.done():  # it could not bind; uvicorn has logged why
        await task
        raise SystemExit(f"disagg: error: cannot serve HTTP on {host}:{port}")
    print(ready_line, flush=True)
    await task


def node_info(engine: AsyncEngine, model_name: str, kv: KVTransferConfig) -> NodeInfo:
    """What this node tells its peers at the handshake (and expects of them)."""
    e = engine.engine
    return NodeInfo(model_name=model_name, dtype=str(e.dtype).removeprefix("torch."),
                    num_layers=e.model_config.num_hidden_layers, num_kv_heads=e.model_config.num_key_value_heads,
                    head_dim=e.model_config.head_dim, block_size=e.config.block_size,
                    kv_connector=kv.kv_connector, kv_ip=kv.kv_ip, kv_port=kv.kv_port)
