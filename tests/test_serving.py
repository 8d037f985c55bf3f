"""Disaggregated serving with real processes: a prefill node and a decode node on loopback,
compared token for token with the colocated server and with transformers."""

import asyncio
import importlib.util
import json
import re
import time

import httpx
import pytest
from prompts import PASSAGE, PROMPTS, hf_greedy
from servers import free_port, read_sse_text, start_node, wait_all_ready, wait_exit, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXTRA_PROMPTS = [
    "List three colors:", "The opposite of hot is", "Once upon a time,", "def add(a, b):",
    "What is 2 + 2?", "Name a planet.", "Water boils at", "The sun rises in the", "A haiku about code:",
]
PROMPTS_20 = PROMPTS + EXTRA_PROMPTS
MAX_TOKENS = 24
NODE_TOKEN = "s3cret-of-16-bytes+"  # the nodes' auth_token (16 bytes at least)
# The module's pair and colocated node hold the 20 prompts at once (about 3,600 tokens with their answers).
KV_20_PROMPTS = ["--kv-cache-memory", "256MiB"]


def greedy_body(prompt, **extra) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


async def complete_all(url: str, prompts: list, stream: bool = False) -> list[str]:
    async with httpx.AsyncClient(timeout=240) as client:
        return await asyncio.gather(*(complete(client, url, p, stream) for p in prompts))


async def complete(client: httpx.AsyncClient, url: str, prompt, stream: bool, **extra) -> str:
    body = greedy_body(prompt, stream=stream, **extra)
    if not stream:
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        return await read_sse_text(r)


async def chat_all(url: str, conversations: list) -> list[str]:
    async with httpx.AsyncClient(timeout=240) as client:
        async def one(messages):
            r = await client.post(f"{url}/v1/chat/completions", json={
                "model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]
        return await asyncio.gather(*(one(m) for m in conversations))


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    node = start_node("both", tmp_path_factory.mktemp("colocated"), extra_args=KV_20_PROMPTS)
    yield node
    node.kill()


@pytest.fixture(scope="module", params=["tcp", "torch_dist", "ucx", "nixl"])
def pair(request, tmp_path_factory):
    """1 prefill + 1 decode node over the given pipe."""
    if request.param == "ucx":
        pytest.importorskip("ucxx", reason="the ucx pipe needs ucxx-cu12")
    if request.param == "nixl" and importlib.util.find_spec("nixl_cu12") is None:  # found, not imported:
        pytest.skip("the nixl pipe needs nixl-cu12")  # NIXL and grpc_tools abort one process (test_pipes.py)
    tmp = tmp_path_factory.mktemp(f"pair-{request.param}")
    prefill = start_node("producer", tmp, connector=request.param, kv_extra={"auth_token": NODE_TOKEN},
                         extra_args=KV_20_PROMPTS, wait=False)
    decode = start_node("consumer", tmp, connector=request.param, prefill_nodes=[prefill.grpc_address],
                        extra_args=KV_20_PROMPTS, wait=False,
                        kv_extra={"auth_token": NODE_TOKEN, "prefill_policy": "fail", "remote_prefill": "always",
                                  # 20 prompts queue up on one CPU core: the last waits for all the others.
                                  "prefill_timeout": 240.0, "lookup_timeout": 60.0})
    wait_all_ready(prefill, decode)
    yield prefill, decode, request.param
    decode.kill()
    prefill.kill()


@pytest.fixture(scope="module")
def reference_texts(hf_model, hf_tokenizer) -> list[str]:
    texts = []
    for prompt in PROMPTS_20:
        ids = hf_tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
        texts.append(hf_tokenizer.decode(hf_greedy(hf_model, ids, MAX_TOKENS), skip_special_tokens=True))
    return texts


# -- failure semantics, each with its own processes ------------------------------------------



def post_completion(url: str, prompt, timeout: float = 120, **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=greedy_body(prompt, **extra), timeout=timeout)


def test_prefill_node_down_at_start(tmp_path, reference_texts):
    """Decode starts with a dead prefill address: it serves by recomputing; policy fail gets a 503."""
    dead = f"127.0.0.1:{free_port()}"
    decode = start_node("consumer", tmp_path, prefill_nodes=[dead], kv_extra={"remote_prefill": "always"})
    try:
        started = time.monotonic()
        r = post_completion(decode.url, PROMPTS_20[1])
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference_texts[1]
        r = post_completion(decode.url, PROMPTS_20[1], prefill_policy="fail")
        assert r.status_code == 503
        assert "prefill" in r.json()["error"]["message"]
        assert time.monotonic() - started < 60
    finally:
        decode.kill()


def test_prefill_node_killed_between_two_layers(tmp_path, hf_model, hf_tokenizer):
    """SIGKILL the prefill node once the first layers of the prompts' KV have crossed the pipe and
    before the last have (the KV goes layer by layer as the prefill computes it): every request is
    still answered, recomputed, and the decode node holds no block afterwards."""
    prefill = start_node("producer", tmp_path, wait=False)
    decode = start_node("consumer", tmp_path, prefill_nodes=[prefill.grpc_address],
                        kv_extra={"lookup_timeout": 20.0}, wait=False)
    prompts = [PROMPTS[8] + f"\nQuestion {i}: what was the second topic?" for i in range(2)]
    expected = [hf_tokenizer.decode(hf_greedy(hf_model, hf_tokenizer(p).input_ids, MAX_TOKENS),
                                    skip_special_tokens=True) for p in prompts]
    config = hf_model.config  # float32 on the CPU
    kv_bytes = [len(hf_tokenizer(p).input_ids) * config.num_hidden_layers * 2 * config.num_key_value_heads
                * config.head_dim * 4 for p in prompts]

    def received() -> float:
        return decode.labelled("disagg_kv_transfer_bytes_total", "direction").get("received", 0.0)

    try:
        wait_all_ready(prefill, decode)
        async def run():
            async with httpx.AsyncClient(timeout=120) as client:
                tasks = [asyncio.create_task(complete(client, decode.url, p, False)) for p in prompts]
                await asyncio.to_thread(wait_for, lambda: received() > 0, 60, "the first layer's KV")
                at_kill = received()
                prefill.kill()
                return at_kill, await asyncio.gather(*tasks)
        started = time.monotonic()
        at_kill, answers = asyncio.run(run())
        assert 0 < at_kill < min(kv_bytes), "the kill came after a whole prompt's KV had arrived"
        assert answers == expected
        assert time.monotonic() - started < 90
        assert "recomputing" in decode.log()
        wait_for(lambda: decode.metric("disagg_kv_blocks_used") == 0, 20, "decode blocks free")
        # With the prefill node gone for good, later requests are recomputed too.
        assert post_completion(decode.url, PROMPTS_20[2]).status_code == 200
    finally:
        decode.kill()
        prefill.kill()


def test_a_prompt_prefilled_in_chunks_crosses_chunk_by_chunk(tmp_path, hf_model, hf_tokenizer):
    """A prefill node that computes long prompts in chunks of 128 tokens sends each chunk's KV as it
    computes it: a 640-token prompt crosses in 5 chunks of 9 layer parts, and the decode node's
    answer equals transformers'; so does a second prompt whose leading blocks the decode node
    holds already: only its tail crosses, in one part, being shorter than layerwise_min_tokens."""
    prefill = start_node("producer", tmp_path, extra_args=["--max-num-batched-tokens", "128"],
                         kv_extra={"layerwise_min_tokens": 200}, wait=False)
    # "always": the second prompt's tail alone is short enough to be computed on the decode node.
    decode = start_node("consumer", tmp_path, prefill_nodes=[prefill.grpc_address],
                        kv_extra={"prefill_policy": "fail", "remote_prefill": "always"}, wait=False)
    prompts = [PROMPTS[8] + f"\nQuestion {i}: what was the first topic?" for i in range(2)]
    expected = [hf_tokenizer.decode(hf_greedy(hf_model, hf_tokenizer(p).input_ids, MAX_TOKENS),
                                    skip_special_tokens=True) for p in prompts]
    try:
        wait_all_ready(prefill, decode)
        first = post_completion(decode.url, prompts[0])
        assert first.status_code == 200 and first.json()["choices"][0]["text"] == expected[0]
        chunks = -(-first.json()["usage"]["prompt_tokens"] // 128)
        parts = prefill.metric("disagg_kv_part_send_seconds_count")
        assert chunks == 5 and parts >= chunks * 9
        second = post_completion(decode.url, prompts[1])
        assert second.status_code == 200 and second.json()["choices"][0]["text"] == expected[1]
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 600
        assert prefill.metric("disagg_kv_part_send_seconds_count") == parts + 1
    finally:
        decode.kill()
        prefill.kill()


def test_max_num_seqs_caps_remote_requests(tmp_path, reference_texts):
    """12 concurrent remote-prefill requests on a decode node with --max-num-seqs 4: all answered
    token-exact, and never more than 4 running (remote requests once bypassed the cap, and the GPU
    block table, sized by it, ran out of rows)."""
    prefill = start_node("producer", tmp_path, wait=False)
    decode = start_node("consumer", tmp_path, prefill_nodes=[prefill.grpc_address], extra_args=["--max-num-seqs", "4"],
                        kv_extra={"prefill_policy": "fail", "remote_prefill": "always", "prefill_timeout": 240.0,
                                  "lookup_timeout": 120.0}, wait=False)
    try:
        wait_all_ready(prefill, decode)
        # Short prompts: the prefill node computes them together, so their KV arrives together.
        indices = [0, 1, 2, 3, 4, 7, 10, 11, 12, 13, 14, 15]

        async def run() -> tuple[list[str], float]:
            answers = asyncio.ensure_future(complete_all(decode.url, [PROMPTS_20[i] for i in indices]))
            most = 0.0
            async with httpx.AsyncClient(timeout=10) as client:
                while not answers.done():
                    text = (await client.get(f"{decode.url}/metrics")).text
                    most = max(most, float(re.search(r"^disagg_num_requests_running (\S+)", text, re.M).group(1)))
                    await asyncio.sleep(0.02)
            return await answers, most
        texts, most_running = asyncio.run(run())
        assert texts == [reference_texts[i] for i in indices]
        assert 1 <= most_running <= 4
        assert decode.metric("disagg_kv_blocks_used") == 0
    finally:
        decode.kill()
        prefill.kill()


def test_prefill_slower_than_timeout(tmp_path, reference_texts):
    prefill = start_node("producer", tmp_path, wait=False)
    decode = start_node("consumer", tmp_path, prefill_nodes=[prefill.grpc_address],
                        kv_extra={"prefill_timeout": 0.001, "remote_prefill": "always"}, wait=False)
    try:
        wait_all_ready(prefill, decode)
        r = post_completion(decode.url, PROMPTS_20[3])
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference_texts[3]
        r = post_completion(decode.url, PROMPTS_20[3], prefill_policy="fail")
        assert r.status_code == 503 and "within 0.001s" in r.json()["error"]["message"]
        # Whatever the prefill node computed for nobody is expired and freed.
        wait_for(lambda: prefill.metric("disagg_kv_blocks_used") == 0, 30, "prefill blocks free")
    finally:
        decode.kill()
        prefill.kill()


def test_decode_node_killed_entries_expire(tmp_path):
    """KV addressed to a decode node that died is dropped after the TTL; nothing stays pinned."""
    prefill = start_node("producer", tmp_path, kv_extra={"buffer_ttl": 3.0}, wait=False)
    decode = start_node("consumer", tmp_path, prefill_nodes=[prefill.grpc_address], wait=False)
    try:
        wait_all_ready(prefill, decode)
        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                tasks = [asyncio.create_task(complete(client, decode.url, PROMPTS[8] + str(i), False))
                         for i in range(2)]
                await asyncio.sleep(0.5)
                decode.kill()
                await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.run(run())
        wait_for(lambda: prefill.metric("disagg_lookup_buffer_entries") == 0, 30, "buffer drained")
        assert prefill.metric("disagg_lookup_buffer_bytes") == 0
        wait_for(lambda: prefill.metric("disagg_kv_blocks_used") == 0, 30, "prefill blocks free")
        assert httpx.get(f"{prefill.url}/health").status_code == 200
    finally:
        decode.kill()
        prefill.kill()


def test_client_disconnect_mid_stream_frees_both_nodes(tmp_path):
    prefill = start_node("producer", tmp_path, wait=False)
    decode = start_node("consumer", tmp_path, prefill_nodes=[prefill.grpc_address],
                        kv_extra={"remote_prefill": "always"}, wait=False)
    try:
        wait_all_ready(prefill, decode)
        body = greedy_body(PROMPTS_20[2], stream=True, max_tokens=400, ignore_eos=True)
        with httpx.stream("POST", f"{decode.url}/v1/completions", json=body, timeout=60) as r:
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if chunks >= 3:
                    break
        wait_for(lambda: decode.metric("disagg_kv_blocks_used") == 0, 20, "decode blocks free")
        wait_for(lambda: prefill.metric("disagg_kv_blocks_used") == 0, 20, "prefill blocks free")
        assert prefill.metric("disagg_lookup_buffer_entries") == 0
    finally:
        decode.kill()
        prefill.kill()


MISMATCHED_DECODE_NODES = [  # (decode node's flags, its kv_connector_extra_config, what its error names)
    ([], {"auth_token": "wrong-but-16-bytes+"}, "auth"),
    (["--block-size", "32"], {"auth_token": NODE_TOKEN}, "block_size"),
    (["--dtype", "bfloat16"], {"auth_token": NODE_TOKEN}, "dtype"),
]


def test_mismatched_decode_node_is_refused_at_start(tmp_path):
    # One prefill node for the three cases, stopped before the module's pair and colocated node start.
    prefill = start_node("producer", tmp_path, kv_extra={"auth_token": NODE_TOKEN})
    try:
        for decode_args, kv_extra, needle in MISMATCHED_DECODE_NODES:
            decode = start_node("consumer", tmp_path, prefill_nodes=[prefill.grpc_address], kv_extra=kv_extra,
                                extra_args=decode_args, wait=False)
            assert wait_exit(decode) != 0
            assert needle in decode.log().lower(), needle
    finally:
        prefill.kill()


def test_mismatched_model_is_refused_at_start(tmp_path, tiny_llama_dir):
    prefill = start_node("producer", tmp_path, model=str(tiny_llama_dir()))
    try:
        decode = start_node("consumer", tmp_path, prefill_nodes=[prefill.grpc_address], wait=False)
        assert wait_exit(decode) != 0
        assert "model_name" in decode.log()
    finally:
        prefill.kill()


# -- through the module's pair and colocated node, after the tests above: those start nodes of their
# own, and the module's stay up until its end --------------------------------------------------


def prompt_indices(connector: str) -> list[int]:
    """All 20 prompts on the default pipe; the other pipes get a mix of short and long ones."""
    return list(range(len(PROMPTS_20))) if connector == "tcp" else [0, 5, 12]


def test_disaggregated_equals_colocated_and_transformers(pair, colocated, reference_texts):
    prefill, decode, connector = pair
    chosen = prompt_indices(connector)
    prompts = [PROMPTS_20[i] for i in chosen]
    expected = [reference_texts[i] for i in chosen]
    async def both():  # at once: each node computes on its own core
        return await asyncio.gather(complete_all(decode.url, prompts), complete_all(colocated.url, prompts))
    disagg, local = asyncio.run(both())
    assert local == expected
    assert disagg == expected
    # Every prompt really went through the prefill node (policy "fail" would have refused otherwise).
    assert "remote prefill" not in decode.log()
    assert len(re.findall(r"prefill d[0-9a-f]{8}-[0-9a-f]{32}: ", prefill.log())) >= len(prompts)


def test_disaggregated_streaming_equals_non_streaming(pair, reference_texts):
    _, decode, connector = pair
    if connector != "tcp":
        pytest.skip("streaming differs from non-streaming only above the pipe: tested on tcp")
    chosen = prompt_indices(connector)
    texts = asyncio.run(complete_all(decode.url, [PROMPTS_20[i] for i in chosen], stream=True))
    assert texts == [reference_texts[i] for i in chosen]


def test_disaggregated_chat_equals_colocated_and_transformers(pair, colocated, hf_model, hf_tokenizer):
    _, decode, connector = pair
    if connector != "tcp":
        pytest.skip("chat differs from completions only above the pipe: tested on tcp")
    conversations = [[{"role": "user", "content": p}] for p in EXTRA_PROMPTS[:6]]
    expected = []
    for messages in conversations:
        ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        expected.append(hf_tokenizer.decode(hf_greedy(hf_model, list(ids), MAX_TOKENS), skip_special_tokens=True))
    async def both():
        return await asyncio.gather(chat_all(colocated.url, conversations), chat_all(decode.url, conversations))
    local, disagg = asyncio.run(both())
    assert local == expected
    assert disagg == expected


def test_load_100_streaming_requests_then_everything_is_free(pair):
    prefill, decode, connector = pair
    if connector != "tcp":
        pytest.skip("the load test runs on the tcp pair")
    prompts = [f"Request {i}: tell me a fact about the number {i}." for i in range(100)]

    async def run():
        async with httpx.AsyncClient(timeout=240, limits=httpx.Limits(max_connections=100)) as client:
            # complete() asserts each stream answered 200 and ended with [DONE].
            return await asyncio.gather(*(complete(client, decode.url, p, True, max_tokens=8) for p in prompts))
    assert len(asyncio.run(run())) == 100
    wait_for(lambda: decode.metric("disagg_kv_blocks_used") == 0, 20, "decode blocks free")
    assert prefill.metric("disagg_kv_blocks_used") == 0
    assert prefill.metric("disagg_lookup_buffer_entries") == 0
    assert decode.metric("disagg_lookup_buffer_entries") == 0


def test_a_prefix_the_decode_node_holds_does_not_cross_the_pipe_again(pair, colocated):
    prefill, decode, connector = pair
    if connector != "tcp":
        pytest.skip("the skip is the control plane's, the same on every pipe")
    system = "You are a careful assistant who answers in one short sentence. " * 6  # several full blocks
    prompts = [system + "Name a color.", system + "Name a fruit."]

    def received() -> float:
        return decode.labelled("disagg_kv_transfer_bytes_total", "direction").get("received", 0.0)

    async def one(url: str, prompt: str) -> str:
        async with httpx.AsyncClient(timeout=120) as client:
            return await complete(client, url, prompt, stream=False)

    sent = []
    texts = []
    for prompt in prompts:
        before = received()
        texts.append(asyncio.run(one(decode.url, prompt)))
        sent.append(received() - before)
    assert texts == [asyncio.run(one(colocated.url, p)) for p in prompts]
    # The second prompt's shared blocks were in the decode node's prefix cache: only its tail came.
    assert 0 < sent[1] < 0.5 * sent[0], sent
    # Each step of the handoff is timed on the node that does it.
    for node, names in ((decode, ["remote_prefill_call", "kv_lookup_wait", "kv_entry_receive", "kv_load",
                                  "first_token_delay"]),
                        (prefill, ["prefill_compute", "kv_buffer_insert", "kv_part_send", "first_token_send"])):
        for name in names:
            assert node.metric(f"disagg_{name}_seconds_count") >= 2, name


def test_openai_client_streams_from_the_decode_node(pair, reference_texts):
    openai = pytest.importorskip("openai")
    _, decode, connector = pair
    if connector != "tcp":
        pytest.skip("the client differs from httpx only above the pipe: tested on tcp")
    client = openai.OpenAI(base_url=f"{decode.url}/v1", api_key="unused")
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS_20[4], max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == reference_texts[4]


def test_penalties_reach_the_prefill_node_and_prompt_logprobs_are_computed_on_the_decode_node(
        pair, colocated, hf_model, hf_tokenizer):
    prefill, decode, connector = pair
    if connector != "tcp":
        pytest.skip("sampling fields travel over gRPC, not the pipe: tested on tcp")
    ids = hf_tokenizer("1, 2, 3, 4, 5,").input_ids
    first = hf_greedy(hf_model, ids, 1)[0]
    # The bias rules out the first greedy token, which the prefill node samples: it must know the bias.
    body = greedy_body(ids, max_tokens=6, repetition_penalty=1.3, presence_penalty=0.5, min_tokens=2,
                       logit_bias={str(first): -100}, logprobs=0)
    remote, local = (httpx.post(f"{url}/v1/completions", json=body, timeout=60).json() for url in (decode.url,
                                                                                                     colocated.url))
    assert remote["choices"][0]["text"] == local["choices"][0]["text"]
    assert remote["choices"][0]["logprobs"]["tokens"][0] != hf_tokenizer.decode([first])
    echo = greedy_body(ids, max_tokens=1, echo=True, logprobs=1)
    remote, local = (httpx.post(f"{url}/v1/completions", json=echo, timeout=60).json()["choices"][0]["logprobs"]
                     for url in (decode.url, colocated.url))
    assert remote["tokens"] == local["tokens"] and len(remote["tokens"]) == len(ids) + 1
    assert remote["token_logprobs"][1:] == pytest.approx(local["token_logprobs"][1:], abs=1e-4)


def test_structured_output_reaches_the_prefill_node(pair, colocated):
    """The prefill node samples the first token: it must follow the grammar too, or the decode node's
    matcher refuses it. A choice whose first token is not the greedy one without the grammar."""
    _, decode, connector = pair
    if connector != "tcp":
        pytest.skip("sampling fields travel over gRPC, not the pipe: tested on tcp")
    body = {"messages": [{"role": "user", "content": "Which planet is the largest?"}], "max_tokens": 8,
            "temperature": 0, "structured_outputs": {"choice": ["Saturn rings", "Mars", "Jupiter"]}}
    answers = [httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json() for url in (decode.url,
                                                                                                  colocated.url)]
    assert answers[0]["choices"][0]["message"]["content"] in ("Saturn rings", "Mars", "Jupiter"), answers[0]
    assert answers[0]["choices"] == answers[1]["choices"]


async def sse_chunks(client: httpx.AsyncClient, url: str, body: dict) -> list[tuple[str, str | None]]:
    """(text, finish_reason) of every event of a streamed completion, in order."""
    chunks = []
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                chunks.append((choice["text"], choice["finish_reason"]))
    return chunks


def test_first_token_streams_as_before_and_stop_rules_apply_to_it_once(pair, colocated, reference_texts):
    """The first token goes to the client before the engine loads the KV: the stream's events are
    the colocated node's, one by one, also when the first token alone ends the request."""
    _, decode, connector = pair
    if connector != "tcp":
        pytest.skip("the first token's path is above the pipe: tested on tcp")
    first_text = reference_texts[1][: len(reference_texts[1]) - len(reference_texts[1].lstrip()) + 1]
    bodies = [greedy_body(PROMPTS_20[i]) for i in (1, 4, 7)]
    bodies += [greedy_body(PROMPTS_20[1], max_tokens=1),  # ends by length at the first token
               greedy_body(PROMPTS_20[1], stop=[first_text]),  # ends by a stop string at the first token
               greedy_body(PROMPTS_20[4], stop=["."], max_tokens=40)]

    async def run(url: str):
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(sse_chunks(client, url, body) for body in bodies))
    remote, local = asyncio.run(run(decode.url)), asyncio.run(run(colocated.url))
    assert remote == local
    assert [chunks[-1][1] for chunks in remote[3:5]] == ["length", "stop"]
    assert len(remote[3]) == 1 and remote[4] == [("", "stop")]
    wait_for(lambda: decode.metric("disagg_kv_blocks_used") == 0, 20, "decode blocks free")


def test_first_token_does_not_wait_for_the_step_in_flight(pair):
    """A remote request's KV arrives while the decode node runs a long step (a prompt it computes
    itself, for its prompt logprobs): the first token reaches the client before that step ends.
    Waiting for the engine thread (the KV load) would hold it until then."""
    _, decode, connector = pair
    if connector != "tcp":
        pytest.skip("the first token's path is above the pipe: tested on tcp")
    remote = greedy_body(PROMPTS_20[8], stream=True)  # ~750 tokens: the prefill node takes a while
    long_step = greedy_body(PASSAGE * 20, max_tokens=1, echo=True, logprobs=1)  # ~1,500 tokens in one step
    delay = "disagg_first_token_delay_seconds"
    delay_sum, delay_count = decode.metric(f"{delay}_sum"), decode.metric(f"{delay}_count")

    async def run() -> tuple[float, float, float]:
        async with httpx.AsyncClient(timeout=120) as client:
            async def first_token() -> float:
                async with client.stream("POST", f"{decode.url}/v1/completions", json=remote) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            return time.monotonic()
                raise AssertionError("no token")
            start = time.monotonic()
            first = asyncio.create_task(first_token())
            await asyncio.sleep(0.3)  # the remote request has its blocks; its prompt is on the prefill node
            response = await client.post(f"{decode.url}/v1/completions", json=long_step)
            assert response.status_code == 200, response.text
            return start, await first, time.monotonic()
    start, first_token_at, long_done_at = asyncio.run(run())
    assert decode.metric(f"{delay}_count") == delay_count + 1
    assert first_token_at + 0.5 < long_done_at, (first_token_at - start, long_done_at - start)
    assert decode.metric(f"{delay}_sum") - delay_sum < 0.25 * (long_done_at - first_token_at)
