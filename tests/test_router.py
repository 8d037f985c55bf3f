"""xPyD through the router, with real processes: 2 prefill + 2 decode nodes behind `disagg router`.

Greedy answers through the router equal the offline engine's, every node gets work, a prefill
node killed mid-load costs no request, a request id can be followed through every node's log and
comes back on every response, vLLM's other endpoints reach a decode node, the router's metrics
count by route and by decode node (under vLLM's router's names too), a client that disconnects
frees the decode node's blocks, a decode node that is gone is skipped, and one that hangs has its
requests failed.
"""

import asyncio
import http.server
import json
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from servers import (
    KV_CACHE_BYTES,
    Node,
    free_port,
    metric_sum,
    read_sse_text,
    start_node,
    start_router,
    wait_exit,
    wait_for,
    wait_ready,
)

from disagg.engine.loader import resolve_model

pytestmark = pytest.mark.timeout(300)

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 12
PROMPTS = [
    "Hello", "The capital of France is", "1, 2, 3, 4,", "Name a color:", "The opposite of hot is",
    "Once upon a time,", "def add(a, b):", "What is 2 + 2?", "Name a planet.", "Water boils at",
    "The sun rises in the", "A haiku about code:", "Cats are", "My favourite food is", "Paris is in",
    "Red, green and", "The best way to learn is", "Monday, Tuesday,", "Hi there!", "Rain falls from the",
]
KINDS = ("completion", "completion-stream", "chat", "chat-stream")
NUM_REQUESTS = 40
# a prefill node's line for each prompt (decode node ids)
PREFILL_LOG_LINE = re.compile(r"prefill d[0-9a-f]{8}-[0-9a-f]{32}:")


@dataclass
class Cluster:
    prefills: list[Node]
    decodes: list[Node]
    router: Node
    expected: dict[str, list[str]]  # "completion" / "chat" -> the colocated greedy text of each prompt


def colocated_answers() -> dict[str, list[str]]:
    """The offline engine's greedy answers: the colocated reference."""
    from disagg import LLM, SamplingParams

    llm = LLM(device="cpu", kv_cache_memory=KV_CACHE_BYTES)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    completions = [o.text for o in llm.generate(PROMPTS, params)]
    chats = [o.text for o in llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)]
    return {"completion": completions, "chat": chats}


def wait_connected(decode: Node, timeout: float = 60.0) -> None:
    """Until the decode node has handshaken with all its prefill nodes (they may have started after it)."""
    def connected() -> bool:
        prefill_nodes = httpx.get(f"{decode.url}/health", timeout=5).json()["prefill_nodes"]
        return all(prefill_nodes.values())
    wait_for(connected, timeout, f"decode node {decode.port} connects to its prefill nodes")


def healthy_decode_nodes(router: Node) -> set[str]:
    nodes = httpx.get(f"{router.url}/health", timeout=5).json()["decode_nodes"]
    return {address for address, state in nodes.items() if state["healthy"]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """2 prefill + 2 decode nodes (each decode node given both prefill nodes) + the router, all
    booted at once; the reference answers are computed meanwhile."""
    tmp = tmp_path_factory.mktemp("xpyd")
    nodes: list[Node] = []
    try:
        prefills = [start_node("producer", tmp, wait=False) for _ in range(2)]
        nodes += prefills
        # A short lookup timeout: KV cut off by the killed prefill node is recomputed soon.
        # Their request lines (--enable-log-requests) say which decode node took a request and how it ended.
        decodes = [start_node("consumer", tmp, prefill_nodes=[p.grpc_address for p in prefills],
                              kv_extra={"lookup_timeout": 10.0, "remote_prefill": "always"},
                              extra_args=["--enable-log-requests"], wait=False)
                   for _ in range(2)]
        nodes += decodes
        # One node as a URL, as users of SGLang's router write them: the router takes its host and port.
        router = start_router(tmp, [f"127.0.0.1:{decodes[0].port}", f"http://127.0.0.1:{decodes[1].port}/"],
                              wait=False)
        nodes.append(router)
        expected = colocated_answers()
        for node in nodes:
            wait_ready(node)
        for node in decodes:
            wait_connected(node)
        wait_for(lambda: healthy_decode_nodes(router) == {f"127.0.0.1:{d.port}" for d in decodes}, 30,
                 "the router sees both decode nodes healthy")
        yield Cluster(prefills, decodes, router, expected)
    finally:
        for node in nodes:
            node.kill()


def request_kind(i: int) -> str:
    # Each prompt is sent twice (i and i + 20), as two different kinds.
    return KINDS[(i + i // len(PROMPTS)) % len(KINDS)]


async def ask(client: httpx.AsyncClient, url: str, i: int, request_id: str | None) -> tuple[str, str]:
    """Request i through the router: (its text, the X-Request-Id it went by)."""
    kind = request_kind(i)
    prompt = PROMPTS[i % len(PROMPTS)]
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": kind.endswith("stream")}
    if kind.startswith("chat"):
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    headers = {"X-Request-Id": request_id} if request_id else {}
    if not body["stream"]:
        r = await client.post(url + path, json=body, headers=headers)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return (choice["message"]["content"] if kind == "chat" else choice["text"]), r.headers["x-request-id"]
    async with client.stream("POST", url + path, json=body, headers=headers) as r:
        assert r.status_code == 200
        return await read_sse_text(r), r.headers["x-request-id"]


@pytest.mark.slow
def test_xpyd_spreads_load_survives_a_dead_prefill_node_and_matches_colocated(cluster: Cluster):
    prefills, decodes, router, expected = cluster.prefills, cluster.decodes, cluster.router, cluster.expected
    victim = prefills[0]

    async def run() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(timeout=180) as client:
            # Even requests bring their own id (kept), odd ones get the router's.
            tasks = [asyncio.create_task(ask(client, router.url, i, f"test-xpyd-{i}" if i % 2 == 0 else None))
                     for i in range(NUM_REQUESTS)]
            # Kill one prefill node once it has taken work, while the rest is still in flight.
            deadline = time.monotonic() + 60
            while not PREFILL_LOG_LINE.search(victim.log()):
                assert time.monotonic() < deadline, "the first prefill node got no work"
                await asyncio.sleep(0.1)
            victim.kill()
            unfinished = sum(not t.done() for t in tasks)
            results = await asyncio.gather(*tasks)
            assert unfinished > 0, "every request finished before the prefill node was killed"
            return results

    results = asyncio.run(run())
    # Once both decode nodes have marked the dead node down, a prompt sent to each is computed by the
    # survivor. During the run a decode node's pick (by cache and load) may have kept to the node that
    # held its prompts until the end.
    wait_for(lambda: not any(httpx.get(f"{d.url}/health", timeout=5).json()["prefill_nodes"][victim.grpc_address]
                             for d in decodes), 30, "both decode nodes mark the dead prefill node down")

    async def one_each() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(timeout=180) as client:
            return [await ask(client, d.url, k, None) for k, d in enumerate(decodes)]

    after = asyncio.run(one_each())
    for k, (text, _) in enumerate(after):
        assert text == expected[request_kind(k).removesuffix("-stream")][k], f"request {k} after the kill differs"
    for i, (text, _) in enumerate(results):
        kind = request_kind(i).removesuffix("-stream")
        assert text == expected[kind][i % len(PROMPTS)], f"request {i} ({request_kind(i)}) differs"

    # The router kept the clients' ids and gave the others its own.
    ids = [request_id for _, request_id in results]
    assert ids[0::2] == [f"test-xpyd-{i}" for i in range(0, NUM_REQUESTS, 2)]
    assert all(re.fullmatch(r"(chat)?cmpl-[0-9a-f]{32}", rid) for rid in ids[1::2]), ids[1::2]

    # Both decode nodes and both prefill nodes got work.
    routed = router.labelled("disagg_router_requests_total", "decode_node")
    assert sorted(routed) == sorted(f"127.0.0.1:{d.port}" for d in decodes)
    assert all(count >= 5 for count in routed.values()), routed
    assert sum(routed.values()) == NUM_REQUESTS
    for node in prefills:
        assert PREFILL_LOG_LINE.search(node.log()), f"prefill node {node.port} got no work"
    # The surviving prefill node pushed KV to both decode nodes (at the latest for the prompts after
    # the kill), which used it (not recomputed).
    survivor = prefills[1]
    for decode in decodes:
        assert f"KV to 127.0.0.1:{decode.kv_port} " in survivor.log(), f"no KV pushed to decode node {decode.port}"
        assert decode.labelled("disagg_remote_prefill_total", "outcome").get("ok", 0) >= 1

    # One request followed by its id through the router and a decode node, and by the decode
    # node's own id for it (a client's id is only a label) into a prefill node.
    decode_logs = "".join(d.log() for d in decodes)
    prefill_logs = "".join(p.log() for p in prefills)
    internal = {rid: re.search(rf"{re.escape(rid)} runs as (\S+)", decode_logs) for rid in ids}
    assert all(internal.values()), "a request's own id is not in the decode nodes' logs"
    assert len({m.group(1) for m in internal.values()}) == len(ids)
    followed = [rid for rid, m in internal.items() if f"prefill {m.group(1)}:" in prefill_logs]
    assert followed, "no request shows up in a prefill node's log"
    rid = followed[0]
    assert re.search(rf"{rid} -> decode node 127\.0\.0\.1:\d+", router.log())
    assert f"{rid} started" in decode_logs and f"{rid} finished" in decode_logs
    assert "the client disconnected" not in router.log()  # every client read its answer to the end

    # The router answers later requests too, with the prefill node gone for good.
    text, _ = asyncio.run(_ask_once(router.url, 1))
    assert text == expected["completion"][1]


async def _ask_once(url: str, i: int) -> tuple[str, str]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await ask(client, url, i, None)


@pytest.mark.slow
def test_router_health_and_models(cluster: Cluster):
    health = httpx.get(f"{cluster.router.url}/health", timeout=10).json()
    assert health["status"] == "ok"
    assert healthy_decode_nodes(cluster.router) == {f"127.0.0.1:{d.port}" for d in cluster.decodes}
    models = httpx.get(f"{cluster.router.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    # The node names the directory it serves. The router (no --tokenizer) hashes with it: learned from a
    # node, or, started with the nodes and so most likely before they were up, the embedded model's, the same.
    root = models["data"][0]["root"]
    assert root == models["data"][0]["tokenizer"] == str(resolve_model(None))
    assert f"hashes prompts with the tokenizer in {root}," in cluster.router.log()


@pytest.mark.slow
def test_vllms_other_endpoints_reach_a_decode_node(cluster: Cluster):
    url = cluster.router.url
    tokenized = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": PROMPTS[1]}, timeout=30).json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 0 and tokenized["max_model_len"] > 0
    detokenized = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": tokenized["tokens"]}, timeout=30)
    assert detokenized.json() == {"prompt": PROMPTS[1]}
    for method in ("GET", "POST"):
        ping = httpx.request(method, f"{url}/ping", timeout=30)
        assert ping.status_code == 200 and ping.json()["role"] == "consumer", ping.text  # a decode node's answer
    assert httpx.get(f"{url}/load", timeout=30).json() == {"server_load": 0}
    assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"] == MODEL


@pytest.mark.slow
def test_every_response_carries_the_request_id(cluster: Cluster):
    """The client's X-Request-Id comes back, once, on whatever the router answers; without one, the
    router's own does."""
    url = cluster.router.url
    calls = [("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
             ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                               "max_tokens": 2, "stream": True}),
             ("POST", "/tokenize", {"prompt": "Hi"}), ("GET", "/ping", None), ("GET", "/health", None),
             ("GET", "/metrics", None), ("GET", "/no-such-path", None),
             ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": -1})]  # the node's 400
    for i, (method, path, body) in enumerate(calls):
        given = httpx.request(method, url + path, json=body, headers={"X-Request-Id": f"test-id-{i}"}, timeout=60)
        assert given.headers.get_list("x-request-id") == [f"test-id-{i}"], (path, given.headers)
        made = httpx.request(method, url + path, json=body, timeout=60)
        prefix = {"/v1/completions": "cmpl", "/v1/chat/completions": "chatcmpl"}.get(path, "req")
        assert re.fullmatch(rf"{prefix}-[0-9a-f]{{32}}", made.headers["x-request-id"]), (path, made.headers)
    assert "test-id-0 started" in "".join(d.log() for d in cluster.decodes)  # and the decode node went by it


@pytest.mark.slow
def test_router_metrics_count_by_route_and_decode_node(cluster: Cluster):
    """vLLM's router's families, read from the same numbers as ours."""
    router, decodes = cluster.router, cluster.decodes
    before = router.samples()
    for i in range(4):
        text, _ = asyncio.run(_ask_once(router.url, i))
        assert text == cluster.expected["completion" if request_kind(i).startswith("completion") else "chat"][i]
    assert httpx.post(f"{router.url}/tokenize", json={"prompt": "Hi"}, timeout=30).status_code == 200
    after = router.samples()

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    routes = {path: sum(request_kind(i).startswith(kind) for i in range(4))
              for path, kind in (("/v1/completions", "completion"), ("/v1/chat/completions", "chat"))}
    for route, count in {**routes, "/tokenize": 1}.items():
        assert delta("vllm_router_requests_total", route=route) == count, route
        assert delta("vllm_router_request_duration_seconds_count", route=route) == count, route
        assert delta("vllm_router_request_duration_seconds_bucket", route=route, le="240.0") == count, route
    assert delta("vllm_router_processed_requests_total") == 5
    assert delta("vllm_router_retries_total") == delta("vllm_router_request_errors_total") == 0
    assert metric_sum(after, "vllm_router_active_workers") == len(decodes)
    for decode in decodes:
        worker = f"http://127.0.0.1:{decode.port}"
        assert metric_sum(after, "vllm_router_worker_health", worker=worker) == 1
        assert metric_sum(after, "vllm_router_running_requests", worker=worker) == 0
        assert metric_sum(after, "vllm_router_worker_load", worker=worker) == 0
        assert metric_sum(after, "vllm_router_processed_requests_total", worker=worker) == metric_sum(
            after, "disagg_router_requests_total", decode_node=f"127.0.0.1:{decode.port}")
    for theirs, ours in (("vllm_router_requests_total", "disagg_router_received_requests_total"),
                         ("vllm_router_request_duration_seconds_sum", "disagg_router_request_duration_seconds_sum")):
        assert metric_sum(after, theirs) == metric_sum(after, ours) > 0


@pytest.mark.slow
def test_decode_node_errors_pass_through(cluster: Cluster):
    """The decode node's 400 for a sampling parameter out of range comes back as it is, status and body."""
    r = httpx.post(f"{cluster.router.url}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 1e-300})
    assert r.status_code == 400
    assert "temperature" in r.json()["error"]["message"] and r.headers["x-request-id"].startswith("cmpl-")


@pytest.mark.slow
def test_bad_request_ids_are_replaced_and_docs_are_off(cluster: Cluster):
    router = cluster.router
    for bad in (b"x" * 5000, "caf\u00e9-id".encode()):
        r = httpx.post(f"{router.url}/v1/completions", timeout=120, headers={"X-Request-Id": bad},
                       json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == cluster.expected["completion"][1]
        assert re.fullmatch(r"cmpl-[0-9a-f]{32}", r.headers["x-request-id"]), r.headers["x-request-id"]
    assert "x" * 200 not in router.log()
    for path in ("/docs", "/openapi.json"):
        assert httpx.get(router.url + path, timeout=10).status_code == 404


@pytest.mark.slow
def test_a_huge_body_is_refused_by_the_router_itself(cluster: Cluster):
    huge = json.dumps({"model": MODEL, "prompt": "word " * (12 * 2**20 // 5), "max_tokens": 2}).encode()

    async def chunked():  # no Content-Length: the router has to count
        for i in range(0, len(huge), 2**16):
            yield huge[i:i + 2**16]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.router.url, timeout=60,
                                     headers={"Content-Type": "application/json"}) as client:
            return await asyncio.gather(client.post("/v1/completions", content=huge),
                                        client.post("/v1/completions", content=chunked()),
                                        client.get("/health"))

    *refused, health = asyncio.run(run())
    for response in refused:
        assert response.status_code == 413, response.text
        assert "--max-request-body-bytes" in response.json()["error"]["message"]
        # Answered by the router, under its own id: nothing was forwarded.
        assert f"{response.headers['x-request-id']} -> decode node" not in cluster.router.log()
    assert health.status_code == 200
    text, _ = asyncio.run(_ask_once(cluster.router.url, 1))
    assert text == cluster.expected["completion"][1]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_the_decode_nodes_blocks(cluster: Cluster, stream: bool):
    decodes, router = cluster.decodes, cluster.router
    request_id = f"test-disconnect-{'stream' if stream else 'full'}"
    body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0, "stream": stream}
    headers = {"X-Request-Id": request_id}
    if stream:
        # Chunks arrive long before the 1500 tokens are done: the router does not buffer the stream.
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, headers=headers, timeout=60) as r:
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 3:
                    break
    else:
        # The answer would take minutes: give up after the decode node has started on it.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{router.url}/v1/completions", json=body, headers=headers, timeout=httpx.Timeout(60, read=3))
    wait_for(lambda: all(d.metric("disagg_kv_blocks_used") == 0 for d in decodes), 30, "decode blocks free")
    decode_logs = "".join(d.log() for d in decodes)
    assert re.search(rf"{request_id} finished: .* finish reason abort", decode_logs), "the decode node did not abort"
    wait_for(lambda: f"{request_id}: the client disconnected" in router.log(), 10, "the router logs the disconnect")


class FakeDecodeNode:
    """Answers /health 200 until closed, then refuses connections: a decode node that died
    between two health checks."""

    def __init__(self):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"status": "ok"}')

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
def test_unreachable_decode_node_is_skipped(cluster: Cluster, tmp_path: Path):
    fake = FakeDecodeNode()
    # Health checks far apart: the router still believes the fake node healthy when it is gone.
    router = start_router(tmp_path, [fake.address, f"127.0.0.1:{cluster.decodes[0].port}"],
                          extra_args=["--health-interval", "600"])
    try:
        fake.close()
        text, _ = asyncio.run(_ask_once(router.url, 1))  # ties go to the first node: the dead one
        assert text == cluster.expected["completion"][1]
        assert f"decode node {fake.address} is unreachable" in router.log()
        errors = router.labelled("disagg_router_upstream_errors_total", "decode_node")
        assert errors.get(fake.address) == 1
        samples = router.samples()  # the request was tried again on the other node
        for name in ("disagg_router_retries_total", "vllm_router_retries_total"):
            assert metric_sum(samples, name, route="/v1/completions") == 1, name
        health = httpx.get(f"{router.url}/health", timeout=10).json()
        assert health["decode_nodes"][fake.address]["healthy"] is False
    finally:
        router.kill()


class StandInNode:
    """A decode node's stand-in: `handler` served on loopback, a thread a connection."""

    def __init__(self, handler: type[http.server.BaseHTTPRequestHandler]):
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def send_json(handler: http.server.BaseHTTPRequestHandler, body: dict) -> None:
    """A stand-in node's 200 answer."""
    data = json.dumps(body).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class HungDecodeNode(StandInNode):
    """Answers /health until a completion request arrives; then hangs on everything, having sent
    the stream's first chunk: a decode node frozen mid-request (stopped, or its GPU wedged)."""

    def __init__(self):
        frozen, self.release = threading.Event(), threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if frozen.is_set():
                    self.release.wait()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"status": "ok"}')

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    self.wfile.write(b'data: {"choices": [{"index": 0, "text": "Hi", "finish_reason": null}]}\n\n')
                    self.wfile.flush()
                frozen.set()
                self.release.wait()

            def log_message(self, *args):
                pass

        Handler.release = self.release
        super().__init__(Handler)

    def close(self) -> None:
        self.release.set()
        super().close()


@pytest.mark.slow
def test_a_hung_decode_node_fails_its_requests_instead_of_holding_them(tmp_path: Path):
    """Health checks time out, the node is declared down, and both a stream already under way and
    a request waiting for a whole answer end with an error, long before any client timeout."""
    node = HungDecodeNode()
    router = start_router(tmp_path, [node.address])
    url = f"{router.url}/v1/completions"

    async def streamed(client: httpx.AsyncClient) -> list[str]:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 100, "stream": True}
        async with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            return [line async for line in r.aiter_lines() if line]

    async def whole(client: httpx.AsyncClient) -> httpx.Response:
        await asyncio.sleep(0.5)  # after the stream has frozen the node
        return await client.post(url, json={"model": MODEL, "prompt": "Hi", "max_tokens": 100})

    async def both() -> tuple[list[str], httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(streamed(client), whole(client))

    try:
        start = time.monotonic()
        lines, response = asyncio.run(both())
        elapsed = time.monotonic() - start
        assert lines[0].startswith('data: {"choices"'), lines  # the chunk sent before the hang was relayed
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][len("data: "):])["error"]
        assert f"decode node {node.address} is down" in error["message"], error
        assert response.status_code == 503, response.text
        assert "no healthy decode node" in response.json()["error"]["message"]
        assert elapsed < 60, f"took {elapsed:.0f}s"
        health = httpx.get(f"{router.url}/health", timeout=10).json()
        assert health["decode_nodes"][node.address]["outstanding"] == 0
        assert "is down after 3 failures in a row; failing its 2 requests in flight" in router.log()
        samples = router.samples()  # the stream broken off, the whole answer with no node left to ask
        for error_type in ("upstream", "no_healthy_node"):
            assert metric_sum(samples, "vllm_router_request_errors_total", error_type=error_type) == 1, error_type
    finally:
        node.close()
        router.kill()


class KeepAliveClosingNode(StandInNode):
    """Answers /health, and the first completion on each connection, kept alive; closes a
    connection that brings a second one without answering it (a reset, not a FIN, if `reset`), and
    any that brings the prompt "drop": a decode node that closes an idle kept-alive connection just
    as the router sends a request on it (its keep-alive timeout, or shedding over its connection
    cap). `posts`: (the client's port, the request's number on its connection, prompt, answered)."""

    def __init__(self, reset: bool):
        posts = self.posts = []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive

            def setup(self):
                super().setup()
                self.served = 0

            def answer(self, body: dict) -> None:
                send_json(self, body)

            def do_GET(self):
                self.answer({"status": "ok"})

            def do_POST(self):
                prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
                answered = self.served == 0 and prompt != "drop"
                posts.append((self.client_address[1], self.served, prompt, answered))
                self.served += 1
                if answered:
                    self.answer({"choices": [{"index": 0, "text": f"{prompt}!", "finish_reason": "stop"}]})
                    return
                self.close_connection = True
                if reset:  # closed at once, no FIN first: the router's read fails with a reset
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()

            def log_message(self, *args):
                pass

        super().__init__(Handler)


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_a_request_on_a_kept_alive_connection_the_node_just_closed_is_sent_again(tmp_path: Path, reset: bool):
    """The keep-alive race (issue 24's soak): sent again once, on a new connection, and answered;
    a request that fails on a new connection is not sent to the node again."""
    node = KeepAliveClosingNode(reset)
    router = start_router(tmp_path, [node.address])
    url = f"{router.url}/v1/completions"
    try:
        with httpx.Client(timeout=30) as client:
            answers = [client.post(url, json={"prompt": prompt}) for prompt in ("one", "two")]
            assert [a.status_code for a in answers] == [200, 200], answers[1].text
            assert answers[1].json()["choices"][0]["text"] == "two!"
            # "two" came on the connection that answered "one", was closed unanswered, and came again on a new one.
            (port_one, *one), (port_two, *two), (port_again, *again) = node.posts
            assert (one, two, again) == ([0, "one", True], [1, "two", False], [0, "two", True]), node.posts
            assert port_two == port_one and port_again != port_one
            error = "ClientOSError" if reset else "ServerDisconnectedError"
            assert f"closed the kept-alive connection before answering ({error}" in router.log()
            # On a new connection the same failure is the node's: not sent to it again.
            dropped = client.post(url, json={"prompt": "drop"})
        assert dropped.status_code == 503, dropped.text  # no other decode node to try
        assert [post[1:] for post in node.posts[3:]] == [(0, "drop", False)], node.posts
    finally:
        router.kill()
        node.close()


class HalfAnsweringNode(StandInNode):
    """Answers /health, and the first completion on each connection, kept alive; to a second on the
    same connection it sends half a response head and closes: a node that took the request and
    failed while answering it. With `redirect`, every completion is answered 307 instead, to
    another path. `posts`: as KeepAliveClosingNode's."""

    def __init__(self, redirect: bool = False):
        posts = self.posts = []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                self.served = 0

            def do_GET(self):
                send_json(self, {"status": "ok"})

            def do_POST(self):
                prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
                answered = self.served == 0 and not redirect
                posts.append((self.client_address[1], self.served, prompt, answered))
                self.served += 1
                if redirect:
                    self.send_response(307)
                    self.send_header("Location", "/elsewhere")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif answered:
                    send_json(self, {"choices": [{"index": 0, "text": f"{prompt}!", "finish_reason": "stop"}]})
                else:
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: appl")
                    self.close_connection = True

            def log_message(self, *args):
                pass

        super().__init__(Handler)


def test_a_request_the_node_began_to_answer_is_not_sent_again(tmp_path: Path):
    """Half a response head, then the connection closed: the node took the request, so the router
    does not send it again (it would run twice); it answers 503, there being no other node."""
    node = HalfAnsweringNode()
    router = start_router(tmp_path, [node.address])
    try:
        with httpx.Client(timeout=30) as client:
            answers = [client.post(f"{router.url}/v1/completions", json={"prompt": p}) for p in ("one", "two")]
        assert [a.status_code for a in answers] == [200, 503], answers[1].text
        assert [post[1:] for post in node.posts] == [(0, "one", True), (1, "two", False)], node.posts
    finally:
        router.kill()
        node.close()


def test_a_redirect_goes_back_to_the_client(tmp_path: Path):
    """The router passes a node's 307 on as it came, and does not follow it."""
    node = HalfAnsweringNode(redirect=True)
    router = start_router(tmp_path, [node.address])
    try:
        answer = httpx.post(f"{router.url}/v1/completions", json={"prompt": "one"}, timeout=30)
        assert answer.status_code == 307, answer.text
        assert [post[2] for post in node.posts] == ["one"], node.posts
    finally:
        router.kill()
        node.close()


class ElsewhereNode(StandInNode):
    """Healthy, serving a model whose directory (its /v1/models root) is not on this machine: a
    decode node on another host."""

    ROOT = "/models/on-another-host"

    def __init__(self):
        root = self.ROOT

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                send_json(self, {"object": "list", "data": [{"id": MODEL, "root": root}]} if self.path == "/v1/models"
                          else {"status": "ok"})

            def log_message(self, *args):
                pass

        super().__init__(Handler)


def test_a_router_without_tokenizer_refuses_a_served_model_that_is_not_here(tmp_path: Path):
    node = ElsewhereNode()
    router = start_router(tmp_path, [node.address], wait=False)
    try:
        assert wait_exit(router, 60) == 2
        log = router.log()
        assert f"decode node {node.address} serves the model in {ElsewhereNode.ROOT!r}" in log, log
        assert "pass --tokenizer (the served model's Hugging Face directory) or --routing least_loaded" in log
    finally:
        router.kill()
        node.close()


@pytest.mark.slow
def test_no_healthy_decode_node_answers_503_and_the_api_key_is_checked(tmp_path: Path):
    router = start_router(tmp_path, [f"127.0.0.1:{free_port()}"], extra_args=["--api-key", "k3y"], wait=False)
    try:
        wait_for(lambda: "disagg router ready" in router.log(), 60, "the router starts")
        assert httpx.get(f"{router.url}/health", timeout=10).status_code == 503
        body = {"model": MODEL, "prompt": "Hi"}
        r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["x-request-id"].startswith("cmpl-")
        r = httpx.post(f"{router.url}/v1/completions", json=body, headers={"Authorization": "Bearer k3y"}, timeout=10)
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["type"] == "server_error" and "no healthy decode node" in error["message"]
        assert httpx.get(f"{router.url}/ping", timeout=10).status_code == 503  # no key needed; no node to ask
        samples = router.samples()
        assert metric_sum(samples, "vllm_router_request_errors_total", route="/v1/completions",
                          error_type="no_healthy_node") == 1
        assert metric_sum(samples, "vllm_router_active_workers") == 0
    finally:
        router.kill()


def test_pick_is_least_outstanding_among_healthy_nodes():
    from disagg.router.router import Router, Routing

    async def run() -> None:
        router = Router(["a:1", "b:2", "c:3"], routing=Routing("least_loaded"))
        a, b, c = router.nodes
        assert router.pick() is None  # nothing checked yet
        a.mark_healthy()
        b.mark_healthy()
        router.begin(router.pick())  # a: ties go to the node sent fewer requests, then list order
        assert router.pick() is b
        router.begin(b)
        router.end(a)
        assert router.pick() is a  # a: 0 in flight
        assert router.pick(exclude={"a:1"}) is b
        c.mark_healthy()
        assert router.pick() is c  # never used yet
        b.mark_unhealthy("test")
        assert router.pick(exclude={"a:1", "c:3"}) is None
        await router.close()

    asyncio.run(run())
