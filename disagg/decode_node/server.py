"""`disagg serve --kv-role consumer` (and the colocated `both`): engine + OpenAI HTTP API,
plus, when disaggregated, the LookupBuffer consumer and the pool of prefill nodes."""

import logging

from disagg import metrics
from disagg.api.app import build_app
from disagg.api.protocol import ServerSamplingOptions
from disagg.api.tool_calls import ToolOptions
from disagg.config import KVTransferConfig
from disagg.decode_node.node import DecodeNode
from disagg.decode_node.prefill_client import PrefillPool
from disagg.decode_node.rank_kv import RankReceivers
from disagg.engine.async_engine import AsyncEngine
from disagg.http_limits import HTTPLimits
from disagg.lookup_buffer import LookupBufferConsumer
from disagg.serving import HTTPOptions, node_info, serve_http

logger = logging.getLogger(__name__)


async def run_decode_node(engine: AsyncEngine, model_name: str, kv: KVTransferConfig, prefill_nodes: list[str],
                          host: str, port: int, http: HTTPOptions, tools: ToolOptions, log_requests: bool,
                          shutdown_timeout: float, log_level: str, limits: HTTPLimits | None = None,
                          sampling: ServerSamplingOptions | None = None) -> None:
    consumer = pool = kv_advertise = ranks = None
    try:
        if kv.kv_role == "consumer":
            consumer = LookupBufferConsumer(kv.kv_connector, kv.pipe_config(), ttl=kv.extra("buffer_ttl"),
                                            kv_buffer_size=int(kv.kv_buffer_size), on_received=count_received,
                                            on_entry=metrics.KV_ENTRY_RECEIVE.observe,
                                            device=engine.device)
            kv_advertise = (kv.kv_ip, consumer.address[1])  # the bound port, where kv_port is 0
            if engine.rank_channels:  # each worker rank's own endpoint (rank_service, started with the engine)
                ranks = RankReceivers(engine.rank_channels, engine.kv_heads_by_rank, kv.kv_ip)
            pool = PrefillPool(prefill_nodes, kv.grpc_token(), node_info(engine, model_name, kv), kv_advertise,
                               kv_rank_ports=tuple(port for _, port in ranks.endpoints) if ranks else ())
            await pool.start(timeout=10.0)
        node = DecodeNode(engine, model_name, consumer, pool, kv_advertise=kv_advertise,
                          prefill_policy=kv.extra("prefill_policy"), prefill_timeout=kv.extra("prefill_timeout"),
                          lookup_timeout=kv.extra("lookup_timeout"), remote_prefill=kv.extra("remote_prefill"),
                          local_prefill_max_tokens=kv.extra("local_prefill_max_tokens"), ranks=ranks)
        where = (f"kv {kv.kv_connector} {kv.kv_ip}:{consumer.address[1]} prefill {','.join(prefill_nodes)}"
                 if consumer else "colocated")
        role = "decode" if consumer else "colocated"
        metrics.register_engine(engine)
        metrics.register_kv_tiers(engine.engine)
        await serve_http(build_app(node, http, model_name, tools, log_requests, sampling), host, port,
                         f"disagg {role} node ready: http://{host}:{port} {where} model {model_name}", log_level,
                         shutdown_timeout, limits)
    finally:
        if pool is not None:
            await pool.close()
        if consumer is not None:
            consumer.close()
        engine.stop()


def count_received(nbytes: int) -> None:
    """Rank 0's consumer's KV bytes (its worker ranks' own are counted by RankReceivers)."""
    metrics.KV_BYTES.labels("received").inc(nbytes)
    metrics.KV_RANK_BYTES.labels("0").inc(nbytes)
