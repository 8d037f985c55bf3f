"""Running a node: its HTTP server (and gRPC server) in one event loop, one ready line, clean shutdown,
and the ASGI middlewares its API and the router's share."""

import importlib.metadata
import logging
import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from disagg.config import KVTransferConfig
from disagg.control_plane import NodeInfo

if TYPE_CHECKING:  # a type only: the router serves with this module and never loads torch
    from disagg.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

STATUS_CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the metrics do


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape, as vLLM answers it; the decode nodes and the router share it."""
    kind = "authentication_error" if status == 401 else "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def openai_error_response(status: int, message: str, param: str | None = None,
                          code: str | None = None) -> JSONResponse:
    return JSONResponse(openai_error(status, message, param, code), status_code=status)


async def serve_http(app: FastAPI, host: str, port: int, ready_line: str, log_level: str,
                     shutdown_timeout: float = 5.0) -> None:
    """Serve until SIGINT/SIGTERM; print `ready_line` once the socket listens. On the signal the
    socket closes (new connections are refused) and requests in flight get `shutdown_timeout`
    seconds to finish before they are cancelled."""
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                    access_log=False, timeout_graceful_shutdown=shutdown_timeout), ready_line)
    try:
        await server.serve()
    except SystemExit:  # it could not start (a port in use, say); uvicorn has logged why
        raise SystemExit(f"disagg: error: cannot serve HTTP on {host}:{port}") from None


class _Server(uvicorn.Server):
    """Prints its ready line as soon as the socket listens, before it has answered anything (a line
    printed later could land in the middle of what a first client prints to the same terminal)."""

    def __init__(self, config: uvicorn.Config, ready_line: str):
        super().__init__(config)
        self.ready_line = ready_line

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.ready_line, flush=True)


MAX_REQUEST_ID_CHARS = 128


@dataclass
class HTTPOptions:
    """What the decode node's API and the router's share: `--api-key`, `--max-request-body-bytes`,
    `--enable-docs`."""

    api_key: str | None
    max_request_body_bytes: int
    enable_docs: bool = False


def package_version() -> str:
    try:
        return importlib.metadata.version("disagg")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree on PYTHONPATH, not installed
        return "0+source"


def make_app(title: str, options: HTTPOptions, error_response: Callable[..., Response]) -> FastAPI:
    """A FastAPI app with the body limit and API key checks. /docs and /openapi.json are off unless
    asked for: they map the whole API for anyone who can reach the port, key or not."""
    docs = dict(docs_url="/docs", redoc_url="/redoc", openapi_url="/openapi.json") if options.enable_docs \
        else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title=title, version=package_version(), **docs)
    app.add_middleware(BodyLimitMiddleware, max_bytes=options.max_request_body_bytes, error_response=error_response)
    if options.api_key:  # added last, so it runs first: a request without the key is refused before its body is read
        app.add_middleware(APIKeyMiddleware, api_key=options.api_key, error_response=error_response)
    return app


def request_label(given: str | None, prefix: str) -> str:
    """The client's X-Request-Id when it makes a sane log label (at most 128 printable ASCII
    characters), else a fresh `prefix-<hex>`. It only labels logs and answers: nodes make their
    own request ids."""
    if given and len(given) <= MAX_REQUEST_ID_CHARS and given.isascii() and given.isprintable():
        return given
    return f"{prefix}-{uuid.uuid4().hex}"


def node_info(engine: "AsyncEngine", model_name: str, kv: KVTransferConfig) -> NodeInfo:
    """What this node tells its peers at the handshake (and expects of them)."""
    e = engine.engine
    return NodeInfo(model_name=model_name, dtype=str(e.dtype).removeprefix("torch."),
                    num_layers=e.model_config.num_hidden_layers, num_kv_heads=e.model_config.num_key_value_heads,
                    head_dim=e.model_config.head_dim, block_size=e.config.block_size,
                    kv_connector=kv.kv_connector, kv_ip=kv.kv_ip, kv_port=kv.kv_port)


class APIKeyMiddleware:
    """`Authorization: Bearer KEY` on /v1/*; /health, /metrics and /version stay open for probes.

    A plain ASGI middleware: Starlette's BaseHTTPMiddleware would wrap streamed responses and
    hide the client's disconnect from them. `error_response(status, message, code)` builds the
    refusal, so each app answers in its own error shape and counts it in its own metrics."""

    def __init__(self, app: ASGIApp, api_key: str, error_response: Callable[..., Response]):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.error_response = error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                message = ("missing API key: send the header 'Authorization: Bearer <key>'" if not given
                           else "invalid API key in the Authorization header")
                await self.error_response(401, message, code="invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses a request body over `max_bytes` with 413 before the app sees any of it.

    A declared Content-Length over the limit is refused unread; a chunked body is counted while it
    arrives and refused as soon as it passes the limit. A body within the limit is read whole here
    and handed to the app as one message (the JSON APIs behind this read it whole anyway), then
    `receive` goes on to the client's disconnect as usual."""

    def __init__(self, app: ASGIApp, max_bytes: int, error_response: Callable[..., Response]):
        self.app = app
        self.max_bytes = max_bytes
        self.error_response = error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was complete: nobody to answer
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                   "(--max-request-body-bytes); send a shorter prompt")
        await self.error_response(413, message, code="request_too_large")(scope, receive, send)
