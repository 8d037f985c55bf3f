"""`disagg router`: one OpenAI-compatible front door over several decode nodes (xPyD).

Each request goes to the healthy decode node the routing policy picks (router.py: least loaded,
round robin, or cache aware, which tokenizes the prompt to match it against the KV blocks each node
holds). The router never parses a response: it passes the decode node's status, content type and bytes through
chunk by chunk, so streamed tokens reach the client as soon as the decode node sends them.

Every request carries an X-Request-Id (the client's, or a fresh `cmpl-<hex>`): the decode node
uses it as its request id and passes it to the prefill node, so one grep follows a request
through the router's, the decode node's and the prefill node's logs. Every response carries it
back, the router's own answers (401, 413, 503, /health) too.

Besides completions and chat, vLLM's other endpoints that a client of one server calls (/v1/models,
/tokenize, /detokenize, /ping, /load) go to a healthy decode node too.

Closing the upstream connection is how the decode node learns that the client went away (it
then aborts the request on both nodes and frees its blocks), so the router closes it as soon as
the client disconnects, whether the response is streamed or not.
"""

import argparse
import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from yarl import URL

from disagg.engine.model_files import DEFAULT_MODEL_NAME, converted_dir, embedded_gguf_path
from disagg.http_limits import HTTPLimits
from disagg.router.metrics import DURATION, ERRORS, RECEIVED, REGISTRY, RETRIES, UPSTREAM_ERRORS
from disagg.router.prompt_tokens import PromptTokens
from disagg.router.router import DecodeNode, Router, Routing, describe, parse_decode_nodes
from disagg.serving import STATUS_CLIENT_CLOSED, HTTPOptions, make_app, openai_error_response, request_label, serve_http

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
# The prefix of the ids the router makes, by path (vLLM's for completions and chat).
REQUEST_ID_PREFIXES = {"/v1/completions": "cmpl", "/v1/chat/completions": "chatcmpl"}
# vLLM's endpoints other than completions and chat that go to a decode node as they are: path -> methods.
PASSED_ON = {"/v1/models": ["GET"], "/tokenize": ["POST"], "/detokenize": ["POST"], "/ping": ["GET", "POST"],
             "/load": ["GET"]}
# Headers of the client's request the decode node needs; hop-by-hop ones (Host, Content-Length,
# Connection) are aiohttp's business.
FORWARDED_HEADERS = ("content-type", "authorization", "accept")
CONNECT_TIMEOUT_S = 5.0  # a decode node that does not accept within this is tried as unreachable
# Below the decode node's 5 s keep-alive (--timeout-keep-alive's default): an idle connection is
# closed here before the node closes it, so that the router holds no socket the node has closed
# (CLOSE_WAIT) and seldom sends a request down one the node is closing at that very moment.
KEEPALIVE_EXPIRY_S = 2.0
error_response = openai_error_response  # the decode nodes' error shape


async def wait_for_disconnect(receive: Receive) -> None:
    # The request body has been read already: what comes next is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


class RequestIdMiddleware:
    """Gives each request its id (request_label: the client's X-Request-Id, or a fresh one), in
    `request.state.request_id`, and puts it on the response, whoever answers. Outermost, so that the
    refusals of the middlewares inside it carry it too."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(REQUEST_ID_HEADER.encode())
        request_id = request_label(None if given is None else given.decode("latin-1"),
                                   REQUEST_ID_PREFIXES.get(scope["path"], "req"))
        scope.setdefault("state", {})["request_id"] = request_id
        header = (REQUEST_ID_HEADER.encode(), request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != header[0]]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class UpstreamResponse(Response):
    """A decode node's response passed through chunk by chunk.

    Not Starlette's StreamingResponse: under ASGI 2.4 that one notices a disconnect only at its
    next send and leaves its iterator to the garbage collector, which would keep the decode node
    generating for nobody. Here a watcher closes the upstream response the moment the client
    leaves, and the node's request count goes down once, however the response ends."""

    def __init__(self, upstream: aiohttp.ClientResponse, request_id: str, route: str, node: DecodeNode, router: Router,
                 start: float):
        self.upstream = upstream
        self.request_id = request_id
        self.route = route
        self.node = node
        self.router = router
        self.start = start  # when the router received the request
        self.complete = False  # the whole body was relayed
        self.started = False  # http.response.start was sent
        self.status_code = upstream.status
        self.background = None
        headers = {}  # X-Request-Id: RequestIdMiddleware's
        if "content-type" in upstream.headers:
            headers["content-type"] = upstream.headers["content-type"]
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        node_down = False
        try:
            async with anyio.create_task_group() as group:
                async def watch() -> None:
                    await wait_for_disconnect(receive)
                    # uvicorn also reports a disconnect once the response is complete.
                    if not self.complete:
                        logger.info("%s: the client disconnected; closing the stream from %s",
                                    self.request_id, self.node.address)
                    group.cancel_scope.cancel()

                async def watch_node() -> None:
                    nonlocal node_down
                    await self.node.down.wait()
                    node_down = True
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                group.start_soon(watch_node)
                await self._relay(send)
                group.cancel_scope.cancel()
            if node_down and not self.complete:
                await self._fail(send, f"decode node {self.node.address} is down ({self.node.reason})")
        finally:
            self.upstream.close()  # a stream cut short closes its connection: the node aborts the request
            self.router.end(self.node)
            elapsed = time.perf_counter() - self.start
            DURATION.labels(self.route).observe(elapsed)
            logger.info("%s <- decode node %s: HTTP %d in %.3fs", self.request_id, self.node.address,
                        self.status_code, elapsed)

    async def _relay(self, send: Send) -> None:
        await self._start(send)
        try:
            async for chunk in self.upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (aiohttp.ClientError, aiohttp.http_exceptions.HttpProcessingError) as e:  # the latter: bad framing
            await self._fail(send, f"decode node {self.node.address} broke off the response: {describe(e)}")
            return
        self.complete = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _start(self, send: Send) -> None:
        self.started = True
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

    async def _fail(self, send: Send, reason: str) -> None:
        """End a response the decode node will not finish; the status is sent, so only the body can say so."""
        UPSTREAM_ERRORS.labels(self.node.address).inc()
        ERRORS.labels(self.route, "upstream").inc()
        logger.warning("%s: %s", self.request_id, reason)
        if not self.started:
            await self._start(send)
        if self.headers.get("content-type", "").startswith("text/event-stream"):
            event = {"error": {"message": reason, "type": "server_error", "param": None, "code": None}}
            tail = f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
            await send({"type": "http.response.body", "body": tail, "more_body": True})
        self.complete = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class NodeDown(Exception):
    """The decode node was declared down while the router waited for its answer."""


class ConnectionTrace:
    """aiohttp's trace context for one request: whether it opened a connection of its own (else it
    went on one the pool kept alive)."""

    def __init__(self) -> None:
        self.opened = False


async def _connection_opened(session: aiohttp.ClientSession, context: SimpleNamespace,
                             params: aiohttp.TraceConnectionCreateStartParams) -> None:
    context.trace_request_ctx.opened = True  # the ConnectionTrace the request was sent with


class ProxyClient:
    """The router's connections to the decode nodes for the requests it passes on: aiohttp's
    keep-alive pool, and fresh connections for a request the pool's connection failed before any
    answer. aiohttp rather than httpx (the router's health checks): every token of every stream
    goes through here, and relaying one costs aiohttp a fraction of httpx's CPU; a busy event loop
    delays every request's first token (BENCHMARKS.md, "The router's share of a TTFT"). A
    connection idle for KEEPALIVE_EXPIRY_S is closed (aiohttp's cleanup, within twice that), and
    one the node closed is closed here at once. Create it inside the running event loop; `aclose` it."""

    def __init__(self) -> None:
        # No read timeout: a non-streamed answer arrives only once the whole generation is done.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        trace = aiohttp.TraceConfig()
        trace.on_connection_create_start.append(_connection_opened)
        self.client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0,
                                                                           keepalive_timeout=KEEPALIVE_EXPIRY_S),
                                            timeout=timeout, trace_configs=[trace])
        self.fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True), timeout=timeout)

    async def send(self, method: str, url: str, params: list[tuple[str, str]], headers: dict[str, str], body: bytes,
                   request_id: str) -> aiohttp.ClientResponse:
        """The decode node's response, its head read and its body to stream.

        A request that fails on a kept-alive connection before any answer (the connection closed,
        or reset, while aiohttp waited for the response's head) is sent once more, on a new
        connection: the keep-alive race, in which the node closes a connection idle at its end
        (its keep-alive timeout, or shedding the one idle longest over its connection cap) just
        as the router sends on it. Safe for a POST: the node closes only connections with no
        request in progress (uvicorn's keep-alive, BoundedH11Protocol), so it never took it; and
        were the connection cut while the node held the request, the node aborts a request whose
        connection closes, so the copy sent again is the only one. Never on a new connection
        (its failure is the node's or the network's: the caller marks the node and tries
        another) nor once a byte of the response's head came (the node took it; the caller
        relays what follows, or fails it)."""
        # The client's Content-Type or none, as it came: aiohttp would add one to a body without. A
        # redirect goes back to the client as it came, as any other answer.
        kwargs = dict(params=params, headers=headers, data=body, skip_auto_headers=("Content-Type",),
                      allow_redirects=False)
        trace = ConnectionTrace()
        try:
            return await self.client.request(method, url, trace_request_ctx=trace, **kwargs)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            # A disconnect after part of the response's head came (aiohttp keeps that part as the
            # message) means the node took the request.
            head_began = isinstance(e, aiohttp.ServerDisconnectedError) and not isinstance(e.message, str)
            if trace.opened or head_began:
                raise
            logger.info("%s: decode node %s closed the kept-alive connection before answering (%s); "
                        "sending it again on a new connection", request_id, URL(url).raw_authority, describe(e))
        return await self.fresh.request(method, url, **kwargs)

    async def aclose(self) -> None:
        await self.client.close()
        await self.fresh.close()


async def prompt_token_ids(prompts: PromptTokens, path: str, body: bytes) -> list[int] | None:
    """The prompt's token ids for cache-aware routing, in a worker thread (a long prompt must not
    hold up the event loop); None for a body the router cannot read: the decode node judges it."""
    def tokenize() -> list[int] | None:
        return prompts.token_ids(path, json.loads(body))

    try:
        return await asyncio.to_thread(tokenize)
    except (ValueError, TypeError, AttributeError) as e:
        logger.debug("routing a %s request by load: its prompt could not be read (%s)", path, describe(e))
        return None


def build_app(router: Router, client: ProxyClient, options: HTTPOptions,
              prompts: PromptTokens | None = None) -> FastAPI:
    """The router's HTTP app; `client` carries the proxied requests to the decode nodes; `prompts`
    (cache_aware routing) reads their prompts' token ids."""
    app = make_app("disagg router", options, error_response)
    app.add_middleware(RequestIdMiddleware)  # added last: outermost

    async def send_upstream(request: Request, node: DecodeNode, request_id: str,
                            body: bytes) -> aiohttp.ClientResponse | None:
        """The decode node's response (headers read, body not), or None if the client left first."""
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        headers[REQUEST_ID_HEADER] = request_id
        sending = asyncio.create_task(client.send(request.method, f"{node.url}{request.url.path}",
                                                  request.query_params.multi_items(), headers, body, request_id))
        disconnect = asyncio.create_task(wait_for_disconnect(request.receive))
        down = asyncio.create_task(node.down.wait())
        try:
            await asyncio.wait([sending, disconnect, down], return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            down.cancel()
            # The client left while the decode node was still working on a non-streamed answer
            # (or the router is shutting down): cancelling the send closes the connection, which
            # is what tells the node to abort.
            given_up = sending.cancel()
        if not given_up:
            return sending.result()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            upstream = await sending  # it may have got its answer just before the cancel
            upstream.close()
        if node.down.is_set():
            raise NodeDown(f"decode node {node.address} is down ({node.reason})")
        return None

    async def proxy(request: Request) -> Response:
        """The request to the least busy healthy decode node, or the next if that one cannot take it."""
        request_id, route = request.state.request_id, request.url.path
        RECEIVED.labels(route).inc()
        body = await request.body()
        start = time.perf_counter()
        token_ids = None
        if prompts is not None and route in REQUEST_ID_PREFIXES:
            token_ids = await prompt_token_ids(prompts, route, body)
        tried: set[str] = set()
        while (node := router.pick(exclude=tried, token_ids=token_ids)) is not None:
            if tried:
                RETRIES.labels(route).inc()
            tried.add(node.address)
            router.begin(node)
            logger.info("%s -> decode node %s (%s %s)", request_id, node.address, request.method, request.url.path)
            try:
                upstream = await send_upstream(request, node, request_id, body)
            except aiohttp.ClientError as e:
                # Nothing reached the client yet: the next healthy node can still take it.
                router.end(node)
                UPSTREAM_ERRORS.labels(node.address).inc()
                node.mark_unhealthy(f"{request.url.path} failed: {describe(e)}")
                logger.warning("%s: decode node %s is unreachable (%s); trying another", request_id, node.address,
                               type(e).__name__)
                continue
            except NodeDown as e:
                router.end(node)
                UPSTREAM_ERRORS.labels(node.address).inc()
                logger.warning("%s: %s before it answered; trying another", request_id, e)
                continue
            except BaseException:
                router.end(node)
                raise
            if upstream is None:
                router.end(node)
                logger.info("%s: the client disconnected before %s answered; request aborted", request_id,
                            node.address)
                DURATION.labels(route).observe(time.perf_counter() - start)
                return Response(status_code=STATUS_CLIENT_CLOSED)
            return UpstreamResponse(upstream, request_id, route, node, router, start)
        ERRORS.labels(route, "no_healthy_node").inc()
        DURATION.labels(route).observe(time.perf_counter() - start)
        reason = router.unavailable_reason()
        logger.warning("%s: no decode node can take it: %s", request_id, reason)
        return error_response(503, f"no healthy decode node: {reason}; check the decode nodes' logs and "
                                   "the router's /health")

    app.add_api_route("/v1/completions", proxy, methods=["POST"])
    app.add_api_route("/v1/chat/completions", proxy, methods=["POST"])
    for path, methods in PASSED_ON.items():
        app.add_api_route(path, proxy, methods=methods)

    @app.get("/health")
    async def health() -> JSONResponse:
        nodes = {n.address: {"healthy": n.healthy, "reason": n.reason, "outstanding": n.outstanding,
                             "routed": n.routed} for n in router.nodes}
        if router.routing.policy == "cache_aware":
            for n in router.nodes:
                nodes[n.address]["kv_events"] = {"live": n.cache.live, "reason": n.cache.reason,
                                                 "cached_blocks": {medium: len(held) for medium, held
                                                                   in n.cache.hashes.items()}}
        ok = any(n.healthy for n in router.nodes)
        return JSONResponse({"status": "ok" if ok else "no healthy decode node", "role": "router",
                             "decode_nodes": nodes}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version_info() -> dict:
        return {"version": app.version}

    return app


async def run_router(decode_nodes: list[str], host: str, port: int, options: HTTPOptions, health_interval: float,
                     log_level: str, limits: HTTPLimits | None, routing: Routing, tokenizer: str | None) -> None:
    """`tokenizer`: --tokenizer, the directory cache_aware routing hashes prompts with (None: the served model's)."""
    router = Router(decode_nodes, health_interval, routing, options.api_key)
    client = ProxyClient()
    try:
        await router.start()
        prompts = None
        if routing.policy == "cache_aware":
            directory, learned = await routing_tokenizer_dir(router, tokenizer)
            prompts = PromptTokens(directory)
            if not learned:  # no node said at start: the first to say replaces the fallback
                router.tasks.append(asyncio.create_task(learn_tokenizer(router, prompts), name="learn-tokenizer"))
        healthy = sum(n.healthy for n in router.nodes)
        if not healthy:
            logger.warning("no decode node is healthy yet (%s); answering 503 until one is",
                           router.unavailable_reason())
        await serve_http(build_app(router, client, options, prompts), host, port,
                         f"disagg router ready: http://{host}:{port} decode {','.join(decode_nodes)} "
                         f"({healthy} healthy, routing {routing.policy})", log_level, limits=limits)
    finally:
        await client.aclose()
        await router.close()


def embedded_tokenizer_dir() -> Path:
    """The embedded model's directory, the default of `disagg serve` and so of --tokenizer: found
    without torch once a node has converted it, else converted here (once, as a node would)."""
    try:
        target = converted_dir(embedded_gguf_path(), DEFAULT_MODEL_NAME)
    except ValueError as e:  # no embedded model here: say what else to do
        raise ValueError(f"{e}; or pass --tokenizer: the served model's Hugging Face directory") from None
    if (target / "tokenizer.json").is_file():
        return target
    from disagg.engine.loader import resolve_model  # torch: only on a machine that never ran a node

    return resolve_model(None)


async def served_tokenizer_root(router: Router, node: DecodeNode) -> str:
    """The directory of the tokenizer the node loaded, from the first model its GET /v1/models lists:
    `tokenizer` (ours), else `root` (vLLM's: the model's directory). A ValueError says why there is none."""
    try:
        response = await router.client.get(f"{node.url}/v1/models", headers=router.auth_headers)
    except httpx.HTTPError as e:
        raise ValueError(f"GET /v1/models failed: {describe(e)}") from None
    if response.status_code != 200:
        raise ValueError(f"GET /v1/models answered {response.status_code}")
    try:
        card = response.json()["data"][0]
        root = card.get("tokenizer") or card["root"]
    except (ValueError, LookupError, TypeError) as e:
        raise ValueError(f"GET /v1/models names no model root ({describe(e)})") from None
    if not isinstance(root, str):
        raise ValueError(f"GET /v1/models names no model root ({root!r})")
    return root


async def served_tokenizer_dir(router: Router) -> tuple[Path | None, list[str]]:
    """The model directory the first healthy decode node that says serves (its tokenizer's), or None
    and why none said. ValueError if that directory is not on this machine: another model's hashes
    would silently never match."""
    reasons = []
    for node in (n for n in router.nodes if n.healthy):
        try:
            root = await served_tokenizer_root(router, node)
        except ValueError as e:
            reasons.append(f"{node.address}: {e}")
            continue
        if not (Path(root) / "tokenizer.json").is_file():
            raise ValueError(f"decode node {node.address} serves the model in {root!r}, which is no directory with a "
                             "tokenizer.json on this machine (a node on another host?), and cache_aware routing "
                             "hashes prompts with the served model's tokenizer: pass --tokenizer (the served model's "
                             "Hugging Face directory) or --routing least_loaded")
        logger.info("cache_aware routing hashes prompts with the tokenizer in %s, the model decode node %s serves",
                    root, node.address)
        return Path(root), reasons
    return None, reasons


async def routing_tokenizer_dir(router: Router, given: str | None) -> tuple[Path | None, bool]:
    """The tokenizer directory cache_aware routing starts with, and whether it is the served model's:
    --tokenizer (`given`), else the served model's (served_tokenizer_dir). When no node says (they may
    start after the router), the embedded model's, `disagg serve`'s default, with a warning, or none
    (prompts routed by load) where it is not installed; learn_tokenizer then waits for a node to say."""
    if given:
        logger.info("cache_aware routing hashes prompts with the tokenizer in %s (--tokenizer)", given)
        return Path(given), True
    directory, reasons = await served_tokenizer_dir(router)
    if directory is not None:
        return directory, True
    why = "; ".join(reasons) or "none is healthy yet"
    try:
        directory = embedded_tokenizer_dir()
    except ValueError as e:
        logger.warning("no decode node said which model it serves (%s), and %s: cache_aware routing routes by load "
                       "until one does", why, e)
        return None, False
    logger.warning("no decode node said which model it serves (%s): cache_aware routing hashes prompts with the "
                   "tokenizer in %s, the embedded model's, until one does (pass --tokenizer to say it)", why, directory)
    return directory, False


async def learn_tokenizer(router: Router, prompts: PromptTokens) -> None:
    """Until a healthy decode node says which model it serves: then its tokenizer replaces the one
    cache_aware routing started with. One on another host, or a tokenizer that does not load, leaves
    it, with an error in the log; each new reason why no node can say yet is logged once."""
    said = set()
    while True:
        await asyncio.sleep(router.health_interval)
        try:
            directory, reasons = await served_tokenizer_dir(router)
            if directory is not None:
                if directory != prompts.directory:
                    await asyncio.to_thread(prompts.use, directory)  # loading a tokenizer takes a while
                return
        except Exception as e:  # noqa: BLE001 - any failure here must leave routing as it is, and say why
            logger.error("%s; cache_aware routing goes on hashing with %s", describe(e),
                         prompts.directory or "no tokenizer (every prompt routed by load)")
            return
        for reason in set(reasons) - said:
            logger.warning("cache_aware routing still waits for the served model's tokenizer: %s", reason)
        said |= set(reasons)


def main(args: argparse.Namespace) -> None:
    """`disagg router ...`, parsed by disagg.router.add_router_parser."""
    if args.health_interval <= 0:
        raise ValueError(f"--health-interval must be > 0 seconds, got {args.health_interval}")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be at least 1, got {args.max_request_body_bytes}")
    # httpx logs every request at INFO: the health checks would drown the router's own lines.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    if args.load_weight < 0:
        raise ValueError(f"--load-weight must be >= 0, got {args.load_weight}")
    if not 0 <= args.cache_threshold <= 1:
        raise ValueError(f"--cache-threshold must be between 0 and 1, got {args.cache_threshold}")
    if args.balance_abs_threshold < 0:
        raise ValueError(f"--balance-abs-threshold must be >= 0, got {args.balance_abs_threshold}")
    options = HTTPOptions(args.api_key, args.max_request_body_bytes, args.enable_docs)
    limits = HTTPLimits.from_args(args)
    routing = Routing(args.routing, args.load_weight, args.cache_threshold, args.balance_abs_threshold)
    asyncio.run(run_router(parse_decode_nodes(args.decode_nodes), args.host, args.port, options,
                           args.health_interval, args.log_level, limits, routing, args.tokenizer))
