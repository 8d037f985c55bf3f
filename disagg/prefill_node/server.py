"""`disagg serve --kv-role producer`: engine + LookupBuffer producer + gRPC PrefillService + HTTP health/metrics."""

import logging

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest

from disagg import metrics
from disagg.config import KVTransferConfig
from disagg.engine.async_engine import AsyncEngine
from disagg.http_limits import HTTPLimits
from disagg.lookup_buffer import LookupBufferConsumer, LookupBufferProducer
from disagg.pipes.errors import PipeError
from disagg.prefill_node.node import PrefillNode
from disagg.prefill_node.pull import PrefixPuller
from disagg.prefill_node.rank_send import RankSenders
from disagg.prefill_node.service import start_grpc_server
from disagg.serving import add_error_handlers, add_profiler_routes, node_info, openai_error_response, serve_http

logger = logging.getLogger(__name__)


def build_health_app(node: PrefillNode) -> FastAPI:
    # No /docs, /redoc or /openapi.json: they would map the node for anyone who reaches the port.
    app = FastAPI(title="disagg prefill node", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app, openai_error_response)  # 404, 405 in the decode nodes' shape

    @app.get("/health")
    async def health() -> JSONResponse:
        stats = node.producer.stats()
        return JSONResponse({"status": "ok", "role": "producer", "model": node.info.model_name,
                             "buffer_entries": stats.entries, "buffer_bytes": stats.bytes})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        metrics.engine_gauges(node.engine.stats)
        stats = node.producer.stats()
        metrics.BUFFER_ENTRIES.set(stats.entries)
        metrics.BUFFER_BYTES.set(stats.bytes)
        return PlainTextResponse(generate_latest(), media_type="text/plain; version=0.0.4")

    add_profiler_routes(app, node.engine)
    return app


async def run_prefill_node(engine: AsyncEngine, model_name: str, kv: KVTransferConfig, host: str, port: int,
                           grpc_port: int, log_level: str, limits: HTTPLimits | None = None) -> None:
    producer = LookupBufferProducer(kv.kv_connector, kv.pipe_config(), int(kv.kv_buffer_size),
                                    kv.extra("buffer_ttl"), kv.extra("insert_timeout"),
                                    on_sent=metrics.kv_sent, on_first_token_sent=metrics.FIRST_TOKEN_SEND.observe)
    # Each worker rank's own sender (rank_service, started with the engine): each rank sends its own KV heads.
    ranks = RankSenders(engine.rank_channels, engine.kv_heads_by_rank, kv.extra("insert_timeout")) \
        if engine.rank_channels else None
    node = PrefillNode(engine, producer, node_info(engine, model_name, kv), kv.kv_buffer_device,
                       kv.extra("layerwise"), kv.layerwise_min_tokens(engine.device.type), ranks)
    if kv.extra("prefix_pull") and engine.engine.prefix_blocks is not None:
        # Pulled prefix blocks arrive on this node's own pipe endpoint (its producer only connects out).
        try:
            consumer = LookupBufferConsumer(kv.kv_connector, kv.pipe_config(), ttl=kv.extra("buffer_ttl"),
                                            kv_buffer_size=int(kv.kv_buffer_size),
                                            on_received=metrics.KV_BYTES.labels("received").inc, device=engine.device)
        except PipeError as e:
            raise PipeError(f"{e}; a prefill node listens there for the prefix blocks it pulls from other prefill "
                            "nodes (kv_connector_extra_config.prefix_pull false: it does not)") from None
        node.puller = PrefixPuller(engine, consumer, (kv.kv_ip, consumer.address[1]), node.info, kv.grpc_token(),
                                   node.cost)
    grpc_server = await start_grpc_server(node, host, grpc_port, kv.grpc_token())
    metrics.register_engine(engine)
    metrics.register_kv_tiers(engine.engine)
    try:
        await serve_http(build_health_app(node), host, port,
                         f"disagg prefill node ready: http://{host}:{port} grpc {host}:{grpc_port} "
                         f"kv {kv.kv_connector} {kv.kv_ip}:{kv.kv_port} model {model_name}", log_level,
                         limits=limits)
    finally:
        await grpc_server.stop(grace=2)
        if node.puller is not None:
            await node.puller.close()
        producer.close()
        engine.stop()
