"""Running a node: its HTTP server (and gRPC server) in one event loop, one ready line, clean shutdown,
and the ASGI middlewares its API and the router's share."""

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import resource
import secrets
import signal
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import h11
import uvicorn
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from disagg.config import KVTransferConfig
from disagg.control_plane import NodeInfo
from disagg.hosts import is_loopback
from disagg.http_limits import HTTPLimits
from disagg.rate_limited_log import RateLimitedLog

if TYPE_CHECKING:  # a type only: the router serves with this module and never loads torch
    from disagg.engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

STATUS_CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the metrics do


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape, as vLLM answers it; the decode nodes and the router share it."""
    kind = "authentication_error" if status == 401 else "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def openai_error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                          headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(openai_error(status, message, param, code), status_code=status, headers=headers)


def add_profiler_routes(app: FastAPI, engine: "AsyncEngine") -> None:
    """vLLM's POST /start_profile and /stop_profile, on a node started with a profiler (--profiler-config)
    only, as vLLM serves them: a development setting, which every node kind takes."""
    if engine.profiler is None:
        return

    @app.post("/start_profile")
    async def start_profile() -> Response:
        try:
            await engine.start_profile()
        except RuntimeError as e:
            return openai_error_response(409, str(e))
        return JSONResponse({"status": "started", "trace_dir": str(engine.profiler.trace_dir)})

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        try:
            trace = await engine.stop_profile()
        except RuntimeError as e:
            return openai_error_response(409, str(e))
        return JSONResponse({"status": "stopped", "trace": trace})


def add_error_handlers(app: FastAPI, error_response: Callable[..., Response]) -> None:
    """Starlette's own refusals (404 no such path, 405 wrong method) and an unexpected exception in
    `error_response`'s shape (OpenAI's), where Starlette would answer {"detail": ...} or plain text."""

    async def on_http_error(request: Request, e: StarletteHTTPException) -> Response:
        return error_response(e.status_code, f"{e.detail}: {request.method} {request.url.path}", headers=e.headers)

    async def on_unexpected_error(_: Request, e: Exception) -> Response:
        # A bug, not bad input; uvicorn logs the traceback.
        return error_response(500, f"internal server error: {e!r}")

    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected_error)


async def serve_http(app: FastAPI, host: str, port: int, ready_line: str, log_level: str,
                     shutdown_timeout: float = 5.0, limits: HTTPLimits | None = None) -> None:
    """Serve until SIGINT/SIGTERM; print `ready_line` ("<what> ready: ...") once the socket listens.
    On the signal the socket closes (new connections are refused), requests in flight get
    `shutdown_timeout` seconds to finish before they are cancelled, "<what> stopped (SIGINT)" is
    printed and this returns, so that the caller's cleanup runs and the process exits 0.
    Connections are bounded by `limits` (BoundedH11Protocol)."""
    warn_if_open(app, host, port)
    limits = limits or HTTPLimits()
    cap, backlog = connection_bounds(limits)
    protocol = type("BoundedH11Protocol", (BoundedH11Protocol,), {"pool": ConnectionPool(cap, limits)})
    asyncio.get_running_loop().set_exception_handler(rate_limited_accept_errors)
    # lifespan off: the apps have no startup or shutdown handlers, and a Ctrl-C that lands while uvicorn
    # waits for the lifespan's startup would have it log that task's cancellation as a traceback.
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), access_log=False,
                                    timeout_graceful_shutdown=shutdown_timeout, http=protocol,
                                    backlog=backlog, timeout_keep_alive=limits.timeout_keep_alive,
                                    lifespan="off"),
                     ready_line)
    try:
        await server.serve()
    except SystemExit:  # it could not start (a port in use, say); uvicorn has logged why
        raise SystemExit(f"disagg: error: cannot serve HTTP on {host}:{port}") from None
    if server.stopped_by is not None:
        print(f"{ready_line.partition(' ready')[0]} stopped ({server.stopped_by.name})", flush=True)


def warn_if_open(app: FastAPI, host: str, port: int) -> None:
    """One warning line when the API (decode, colocated node or router) listens beyond loopback
    with no --api-key. Not a refusal: vLLM serves every interface by default and asks for no key,
    and deployments that keep their network private (a compose network, a Kubernetes service
    behind its own auth) start it that way; refusing would break them for a line of advice."""
    if getattr(app.state, "api_key_required", True) or is_loopback(host):
        return
    logger.warning("the API on %s:%d takes requests from anyone who reaches it: no --api-key (or $DISAGG_API_KEY) "
                   "is set; pass one, or bind --host 127.0.0.1 to serve this machine only", host, port)


class _Server(uvicorn.Server):
    """Prints its ready line as soon as the socket listens, before it has answered anything (a line
    printed later could land in the middle of what a first client prints to the same terminal).

    Stops on SIGINT or SIGTERM as uvicorn does (a second SIGINT cuts the grace period short), but
    does not raise the signal again once it has shut down, as uvicorn would: SIGINT would then
    reach asyncio.run's own handler, which cancels the node's cleanup (gRPC server, pipes) half
    way and ends in a CancelledError and KeyboardInterrupt traceback (issue 25)."""

    def __init__(self, config: uvicorn.Config, ready_line: str):
        super().__init__(config)
        self.ready_line = ready_line
        self.stopped_by: signal.Signals | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.ready_line, flush=True)

    async def shutdown(self, sockets=None) -> None:
        # Streams that never end by themselves (GET /kv_events) read this and end, instead of
        # holding the shutdown for its whole timeout.
        self.config.app.state.shutting_down = True
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # only there can signals be caught
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        self.stopped_by = self.stopped_by or signal.Signals(sig)
        super().handle_exit(sig, frame)


# Descriptors left for what is not an HTTP connection: KV pipes, gRPC, model and log files.
FD_RESERVE = 256
MAX_OPEN_FILES = 65536  # the soft limit is raised to this, within the hard one (vLLM does the same)


def connection_bounds(limits: HTTPLimits) -> tuple[int, int]:
    """(connections, backlog): --limit-concurrency and --backlog, lowered so that HTTP
    connections never use up the open-file limit (raised first, as far as the hard limit allows):
    past it, accept() fails for every socket of the process, /health included. asyncio accepts up
    to `backlog` connections at once before any of them is handled, and the ones over the cap are
    closed only in the loop's next turn, by when a second batch may have come: two backlogs count
    too (one let a loaded CI machine reach the limit of 1,024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        soft = wanted
    if soft == resource.RLIM_INFINITY:
        return limits.limit_concurrency, limits.backlog
    room = max(2, soft - FD_RESERVE)
    backlog = min(limits.backlog, max(1, room // 8))
    cap = min(limits.limit_concurrency, room - 2 * backlog)
    if (cap, backlog) != (limits.limit_concurrency, limits.backlog):
        logger.warning("the open-file limit (%d) leaves room for %d HTTP connections and a backlog of %d "
                       "(--limit-concurrency %d, --backlog %d); raise it with ulimit -n", soft, cap, backlog,
                       limits.limit_concurrency, limits.backlog)
    return cap, backlog


class ConnectionPool:
    """One server's connections that have no request in progress, the longest idle first, and
    the log lines about connections it closed (at most one per reason every 10 s)."""

    def __init__(self, cap: int, limits: HTTPLimits):
        self.cap = cap
        self.limits = limits
        self.idle: OrderedDict[BoundedH11Protocol, None] = OrderedDict()
        self.log = RateLimitedLog(logger)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with bounds on what a client holds (issue 24):

    - at most `pool.cap` connections: a new one past it closes the connection idle longest (no
      request in progress), or itself if every other has one, so that a flood of idle
      connections cannot lock out a probe, and descriptors never run out;
    - a request's headers must arrive within `timeout_request_headers` of the connection's opening
      or, on a kept-alive connection, of their first byte (uvicorn's `timeout_keep_alive` covers
      the silence before), and its body within `timeout_request_body` of its headers; else the
      connection is closed (a request in progress sees the client disconnect).

    h11's view of the client (`conn.their_state`) says which deadline applies: IDLE (headers to
    come), SEND_BODY, or DONE (none: the app has the request)."""

    pool: ConnectionPool  # one per server (serve_http)

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.deadline: asyncio.TimerHandle | None = None
        self.waiting_for: str | None = None  # "headers" or "body"
        pool = self.pool
        pool.idle[self] = None
        if len(self.connections) > pool.cap:
            victim = next(iter(pool.idle))  # self, when every other connection has a request in progress
            closed = "the new one (every other has a request in progress)" if victim is self else "the one idle longest"
            pool.log.warning("cap", f"{len(self.connections)} HTTP connections, over --limit-concurrency={pool.cap}: "
                                    f"closed {closed}")
            victim.close_now()
            if victim is self:
                return
        self.expect("headers")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE:  # headers still to come (a kept-alive connection's first byte starts them)
            if self.waiting_for != "headers":
                self.expect("headers")
            return
        self.pool.idle.pop(self, None)
        if state is h11.SEND_BODY:
            if self.waiting_for != "body":
                self.expect("body")
        else:  # the request is whole (or the connection is closing)
            self.stop_waiting()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # uvicorn's keep-alive timer runs until the next byte
        self.stop_waiting()
        if not self.transport.is_closing():
            self.pool.idle[self] = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.stop_waiting()
        self.pool.idle.pop(self, None)
        super().connection_lost(exc)

    def expect(self, what: str) -> None:
        self.stop_waiting()
        limits = self.pool.limits
        timeout = limits.timeout_request_headers if what == "headers" else limits.timeout_request_body
        self.waiting_for = what
        self.deadline = self.loop.call_later(timeout, self.expired, what, timeout)

    def stop_waiting(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = self.waiting_for = None

    def expired(self, what: str, timeout: float) -> None:
        self.deadline = None
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        self.pool.log.warning(what, f"closed the HTTP connection of {client}: its request {what} did not arrive "
                                    f"within {timeout:g}s (--timeout-request-{what})")
        self.close_now()

    def close_now(self) -> None:
        self.pool.idle.pop(self, None)
        self.stop_waiting()
        if not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (malformed request line, headers or chunked body): uvicorn's
        400 in OpenAI's shape instead of plain text, and the connection closed."""
        body = json.dumps(openai_error(400, "invalid HTTP request: its request line, headers or chunked body do not "
                                            "parse as HTTP/1.1")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        with contextlib.suppress(h11.LocalProtocolError):  # a response already started: closing is all that is left
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()


ACCEPT_ERRORS = RateLimitedLog(logger)


def rate_limited_accept_errors(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """asyncio logs a traceback for every failed accept(); out of descriptors that is thousands
    a second (issue 24: 219 MB of log in 45 s). One line every 10 s instead; other errors as usual."""
    message = context.get("message", "")
    if "out of system resource" in message:
        ACCEPT_ERRORS.warning("accept", f"{message}: {context.get('exception')!r}; lower --limit-concurrency "
                                        "or raise the open-file limit (ulimit -n)")
    else:
        loop.default_exception_handler(context)


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
    """A FastAPI app with the body limit and API key checks, its errors in `error_response`'s shape.
    /docs and /openapi.json are off unless asked for: they map the whole API for anyone who can
    reach the port, key or not."""
    docs = dict(docs_url="/docs", redoc_url="/redoc", openapi_url="/openapi.json") if options.enable_docs \
        else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title=title, version=package_version(), **docs)
    add_error_handlers(app, error_response)
    app.add_middleware(BodyLimitMiddleware, max_bytes=options.max_request_body_bytes, error_response=error_response)
    app.state.api_key_required = bool(options.api_key)  # serve_http warns when it is not, beyond loopback
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
    mc = engine.model_config
    return NodeInfo(model_name=model_name, dtype=str(engine.dtype).removeprefix("torch."),
                    num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads,
                    head_dim=mc.head_dim, block_size=engine.block_size,
                    kv_connector=kv.kv_connector, kv_ip=kv.kv_ip, kv_port=kv.kv_port,
                    kv_rank_heads=list(engine.kv_heads_by_rank))


# What load balancers, probes and scrapers call without a key; every other path needs it when
# --api-key is set (issue 24: /tokenize, unguarded, let anyone feed the node chat templates).
OPEN_PATHS = frozenset({"/health", "/metrics", "/ping"})


class APIKeyMiddleware:
    """`Authorization: Bearer KEY` on every path but OPEN_PATHS.

    A plain ASGI middleware: Starlette's BaseHTTPMiddleware would wrap streamed responses and
    hide the client's disconnect from them. `error_response(status, message, code)` builds the
    refusal, so each app answers in its own error shape and counts it in its own metrics."""

    def __init__(self, app: ASGIApp, api_key: str, error_response: Callable[..., Response]):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.error_response = error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
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
