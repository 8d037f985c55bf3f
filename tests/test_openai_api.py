"""The OpenAI API of a real colocated node (`disagg serve --kv-role both`), checked against the
offline engine: same greedy tokens, streamed or not, plus errors, the API key and disconnects."""

import asyncio
import json
import re
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from prompts import PROMPTS, hf_greedy, penalized_reference
from servers import KV_CACHE_BYTES, Node, read_sse_text, start_node

from disagg import LLM, SamplingParams
from disagg.engine.sampling_params import SamplingParamError, StructuredOutputSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 16
CHAT = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three primary colors."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Node:
    """One colocated node for the module, started with an API key that every request sends. Some
    flags come from a --config YAML file, as vLLM takes them."""
    tmp = tmp_path_factory.mktemp("openai-api")
    (tmp / "config.yaml").write_text("enable-auto-tool-choice: true\ntool-call-parser: hermes\n"
                                     "disable-log-requests: true\n")
    # The model's whole context (8,192 tokens; the tests' default cache holds 2,912): the long prompts of
    # test_huge_bodies_get_413_and_long_prompts_leave_health_answering are as long as it lets them be.
    node = start_node("both", tmp, extra_args=["--api-key", API_KEY, "--config", str(tmp / "config.yaml"),
                                               "--kv-cache-memory", "384MiB"])
    yield node
    node.kill()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", kv_cache_memory=KV_CACHE_BYTES)


@pytest.fixture(scope="module")
def model_name(server: Node) -> str:
    return httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def post(server: Node, path: str, body: dict | str, headers: dict = AUTH) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, timeout=60,
                      headers={**headers, "Content-Type": "application/json"})


def sse_events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.startswith("data: ")]


def assert_openai_error(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words.lower() in error["message"].lower(), error["message"]


def kv_blocks_used(server: Node) -> float:
    return server.metric("disagg_kv_blocks_used")


def test_concurrent_greedy_completions_match_offline_engine(server, llm, model_name):
    prompts = PROMPTS[:6]
    expected = llm.generate(prompts, greedy(logprobs=0))

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            return await asyncio.gather(*[
                client.post("/v1/completions", json={"model": model_name, "prompt": p, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0, "logprobs": 0})
                for p in prompts])

    for prompt, want, response in zip(prompts, expected, asyncio.run(send_all())):
        assert response.status_code == 200, response.text
        body = response.json()
        choice = body["choices"][0]
        assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
        assert choice["text"] == want.text, prompt
        # Token for token: the logprobs name every output token.
        tokens = [llm.tokenizer.decode([t], skip_special_tokens=False) for t in want.token_ids]
        assert choice["logprobs"]["tokens"] == tokens
        assert choice["finish_reason"] == want.finish_reason
        assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        assert body["usage"]["completion_tokens"] == len(want.token_ids)


def test_clients_reusing_one_request_id_each_get_their_own_answer(server, llm):
    """X-Request-Id labels a request; the node's own ids keep two requests that share it apart."""
    prompts = PROMPTS[:3]
    expected = [out.text for out in llm.generate(prompts, greedy())]

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers={**AUTH, "X-Request-Id": "same-id"},
                                     timeout=60) as client:
            return await asyncio.gather(*[client.post("/v1/completions", json={
                "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": i % 2 == 0})
                for i, p in enumerate(prompts)])

    responses = asyncio.run(send_all())
    texts = []
    for i, response in enumerate(responses):
        assert response.status_code == 200, response.text
        if i % 2 == 0:
            texts.append("".join(json.loads(e)["choices"][0]["text"] for e in sse_events(response)[:-1]))
        else:
            texts.append(response.json()["choices"][0]["text"])
    assert texts == expected


def test_stream_concatenates_to_the_non_stream_text(server, llm):
    body = {"prompt": PROMPTS[4], "max_tokens": MAX_TOKENS, "temperature": 0}
    plain = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    response = post(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == plain
    assert plain == llm.generate(PROMPTS[4], greedy())[0].text
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == MAX_TOKENS


def test_chat_matches_offline_chat(server, llm, model_name):
    want = llm.chat(CHAT, greedy(32))[0]
    response = post(server, "/v1/chat/completions",
                    {"model": model_name, "messages": CHAT, "max_tokens": 32, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": want.text, "tool_calls": []}  # as vLLM
    assert body["choices"][0]["finish_reason"] == want.finish_reason
    assert body["usage"]["completion_tokens"] == len(want.token_ids)


def test_openai_client_streams_chat(server, llm, model_name):
    want = llm.chat(CHAT, greedy(24))[0]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    stream = client.chat.completions.create(model=model_name, messages=CHAT, max_completion_tokens=24,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == want.text
    assert content_chunks[-1].choices[0].finish_reason == want.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_prompt_as_token_ids(server, llm):
    ids = llm.tokenizer.encode(PROMPTS[1])
    want = llm.generate(ids, greedy())[0].text
    for prompt in (ids, [ids]):
        response = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == want


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, "does not exist"),
    ("/v1/completions", {"prompt": "word " * 9000}, 400, "max_model_len"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "hi",', 400, "not valid JSON"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n must be"),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "0 only with echo"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": ["one", ""]}, 400, "empty"),
    # Found by schemathesis: token ids outside the vocabulary were decoded before validation (500).
    ("/v1/completions", {"prompt": [1, 2**70]}, 400, "token ids must be"),
    ("/v1/completions", {"prompt": [[5, -3], [7]]}, 400, "token ids must be"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema"}}, 400, "json_schema"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs needs logprobs"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, 400, "needs content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{}],
                              "tool_choice": "required"}, 400, "each tool must be"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {
            "name": "g"}}}, 400, "not among the tools"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404,
     "does not exist"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, path, body, status, words):
    assert_openai_error(post(server, path, body), status, words)
    response = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_docs_are_off_by_default(server):
    for path in ("/docs", "/redoc", "/openapi.json"):  # even to a client with the key (without it: 401)
        assert httpx.get(server.url + path, headers=AUTH, timeout=10).status_code == 404
        assert httpx.get(server.url + path, timeout=10).status_code == 401


def test_api_key_is_required_everywhere_but_the_probes(server):
    body = {"prompt": "Hello", "max_tokens": 2}
    assert_openai_error(post(server, "/v1/completions", body, headers={}), 401, "missing API key")
    assert_openai_error(post(server, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401,
                        "invalid API key")
    for path in ("/tokenize", "/detokenize"):
        assert_openai_error(post(server, path, {"prompt": "Hello", "tokens": [1]}, headers={}), 401, "missing API key")
    for path in ("/v1/models", "/version", "/load"):
        assert httpx.get(f"{server.url}{path}").status_code == 401, path
    assert "version" in httpx.get(f"{server.url}/version", headers=AUTH).json()
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    assert httpx.get(f"{server.url}/ping").status_code == 200


def wait_for_free_blocks(server: Node, timeout: float = 5.0) -> float:
    deadline = time.monotonic() + timeout
    while (used := kv_blocks_used(server)) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    return used


def test_client_disconnect_mid_stream_frees_every_block(server):
    body = {"prompt": PROMPTS[6], "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        # Not `break` out of a for loop over the lines: that closes the generator, and the connection with it.
        lines = response.iter_lines()
        events = 0
        while events < 3:
            events += next(lines).startswith("data: ")
        assert kv_blocks_used(server) > 0  # still generating while we hold the connection
    assert wait_for_free_blocks(server) == 0, server.log()[-2000:]


def test_client_disconnect_without_stream_frees_every_block(server):
    body = {"prompt": PROMPTS[6], "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after a second and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=1.0)
    assert wait_for_free_blocks(server) == 0, server.log()[-2000:]


def test_completion_logprobs_shape(server, llm):
    want = llm.generate(PROMPTS[1], greedy(8, logprobs=2))[0]
    response = post(server, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "logprobs": 2})
    logprobs = response.json()["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 8
    assert logprobs["token_logprobs"] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    # Greedy: the chosen token is the most likely one.
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"]))


def test_chat_logprobs_shape(server):
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    content = post(server, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 6
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert set(entry["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    streamed = post(server, "/v1/chat/completions", {**body, "stream": True})
    chunks = [json.loads(e) for e in sse_events(streamed)[:-1]]
    streamed_content = [entry for c in chunks if c["choices"][0]["logprobs"]
                        for entry in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed_content] == [e["token"] for e in content]


# Each of these used to pass validation and then make the engine step raise, failing every request
# in flight, or to slow every step down; now each is refused, naming the field.
HOSTILE = [
    ({"temperature": 1e-300}, "temperature"),
    ({"seed": 2**70}, "seed"),
    ({"top_k": 2**70}, "top_k"),
    ({"max_tokens": 2**70}, "max_tokens"),
    ({"stop": [f"stop {i}" for i in range(10_000)]}, "stop"),
    ({"stop": "x" * 100_000}, "stop"),
    ({"stop_token_ids": list(range(10_000))}, "stop_token_ids"),
]


def test_hostile_sampling_params_are_refused_while_another_stream_goes_on(server, llm):
    want = llm.generate(PROMPTS[6], greedy(48))[0].text
    assert wait_for_free_blocks(server) == 0

    async def run() -> tuple[str, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            streaming = asyncio.Event()

            async def stream() -> str:
                text = ""
                body = {"prompt": PROMPTS[6], "max_tokens": 48, "temperature": 0, "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            text += json.loads(line[6:])["choices"][0]["text"]
                            streaming.set()
                return text

            normal = asyncio.create_task(stream())
            await streaming.wait()
            hostile = [await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, **fields})
                       for fields, _ in HOSTILE]
            assert not normal.done(), "the normal stream ended before the hostile requests were sent"
            return await normal, hostile

    text, hostile = asyncio.run(run())
    for (_, field), response in zip(HOSTILE, hostile):
        assert_openai_error(response, 400, field)
        assert response.json()["error"]["param"] == field
    assert text == want
    assert wait_for_free_blocks(server) == 0
    assert server.metric("disagg_engine_request_errors_total") == 0


def poll_health(url: str, stop: threading.Event, latencies: list[float]) -> None:
    with httpx.Client(timeout=10) as client:
        while not stop.is_set():
            start = time.perf_counter()
            assert client.get(f"{url}/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.01)


def test_huge_bodies_get_413_and_long_prompts_leave_health_answering(server, llm, model_name):
    max_model_len = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["max_model_len"]
    huge = json.dumps({"prompt": "word " * (12 * 2**20 // 5), "max_tokens": 2}).encode()
    # Within the character limit (32 per token), so tokenized, then refused for its 50k tokens:
    # a tenth of a second of tokenizing each, which used to hold up the event loop.
    char_limit = max_model_len * 32
    long_prompt = json.dumps({"prompt": "word " * (char_limit // 5), "max_tokens": 2}).encode()

    async def chunked(body: bytes):  # no Content-Length: the server has to count
        for i in range(0, len(body), 2**16):
            yield body[i:i + 2**16]

    async def send_all() -> list[httpx.Response]:
        headers = {**AUTH, "Content-Type": "application/json"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as client:
            return await asyncio.gather(client.post("/v1/completions", content=huge),
                                        client.post("/v1/completions", content=chunked(huge)),
                                        *(client.post("/v1/completions", content=long_prompt) for _ in range(24)))

    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=poll_health, args=(server.url, stop, latencies))
    poller.start()
    try:
        whole, streamed, *long_ones = asyncio.run(send_all())
    finally:
        stop.set()
        poller.join()
    for response in (whole, streamed):
        assert_openai_error(response, 413, "--max-request-body-bytes")
    for response in long_ones:
        assert_openai_error(response, 400, "max_model_len")
    # Tokenized on the event loop, the 24 prompts held /health up for seconds; off it, a poll waits
    # at most for a GIL switch and body parsing (well under a second even on a loaded 2-core CI box).
    assert latencies and max(latencies) < 1.0, latencies

    over = post(server, "/v1/completions", {"prompt": "a" * (char_limit + 1), "max_tokens": 2})
    assert_openai_error(over, 400, f"at most {char_limit}")
    assert over.json()["error"]["param"] == "prompt"
    chat = post(server, "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "a" * char_limit}], "max_tokens": 2})
    assert_openai_error(chat, 400, f"at most {char_limit}")
    response = post(server, "/v1/completions", {"model": model_name, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
                                                "temperature": 0})
    assert response.json()["choices"][0]["text"] == llm.generate(PROMPTS[1], greedy())[0].text


DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).parent.parent


def sdk(server: Node) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)


# Every field this change added, at the value that asks for nothing, plus one no server knows.
NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {},
           "min_tokens": 0, "skip_special_tokens": True, "spaces_between_special_tokens": True,
           "include_stop_str_in_output": False, "n": 1, "response_format": {"type": "text"},
           "not_a_field_anywhere": 1}


def test_new_fields_at_neutral_values_are_token_exact_to_transformers(server, hf_model, hf_tokenizer, model_name):
    ids = hf_tokenizer(PROMPTS[4]).input_ids
    want = hf_tokenizer.decode(hf_greedy(hf_model, ids, MAX_TOKENS), skip_special_tokens=True)
    client = sdk(server)
    plain = client.completions.create(model=model_name, prompt=PROMPTS[4], max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body=NEUTRAL)
    assert plain.choices[0].text == want
    stream = client.completions.create(model=model_name, prompt=PROMPTS[4], max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True}, extra_body=NEUTRAL)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want
    # Unknown fields are ignored with one warning per field name, not one per request.
    assert server.log().count("'not_a_field_anywhere'") == 1


def test_n_with_a_seed_gives_reproducible_choices(server, model_name):
    client = sdk(server)
    body = dict(model=model_name, prompt="Once upon a time,", max_tokens=8, temperature=1.0, seed=7,
                extra_body={"ignore_eos": True})
    first, again = (client.completions.create(n=4, **body) for _ in range(2))
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1
    # vLLM's per-choice seeds: choice j samples with seed + j.
    assert client.completions.create(**{**body, "seed": 9}).choices[0].text == first.choices[2].text
    assert first.usage.completion_tokens == 32
    chunks = list(client.chat.completions.create(model=model_name, messages=CHAT, n=2, max_tokens=4, temperature=1.0,
                                                 seed=3, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_a_list_of_prompts_times_n(server, llm):
    prompts = [PROMPTS[1], PROMPTS[3]]
    singles = [llm.generate(p, greedy(6))[0].text for p in prompts]
    body = post(server, "/v1/completions", {"prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]  # prompt index * n + choice
    assert [c["text"] for c in body["choices"]] == [singles[0], singles[0], singles[1], singles[1]]
    prompt_tokens = len(llm.tokenizer.encode(PROMPTS[1])) + len(llm.tokenizer.encode(PROMPTS[3]))
    assert body["usage"]["prompt_tokens"] == prompt_tokens and body["usage"]["completion_tokens"] == 24


def test_echo_logprobs_are_transformers_prompt_logprobs(server, hf_model, llm):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs 1, max_tokens 1 (or 0), token ids, a batch."""
    prompts = [llm.tokenizer.encode(p) for p in (PROMPTS[1], PROMPTS[7], PROMPTS[4], PROMPTS[3])]
    body = post(server, "/v1/completions", {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
                                            "temperature": 0, "seed": 1234}).json()
    zero = post(server, "/v1/completions", {"prompt": prompts[0], "echo": True, "logprobs": 1, "max_tokens": 0,
                                            "temperature": 0}).json()
    for ids, choice in zip(prompts, body["choices"]):
        with torch.no_grad():
            want = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        expected = [want[i - 1, ids[i]].item() for i in range(1, len(ids))] + [want[-1].max().item()]
        assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
        for i in range(1, len(ids)):  # the most likely token is in top_logprobs, as lm-eval's is_greedy reads it
            assert max(lp["top_logprobs"][i].values()) == pytest.approx(want[i - 1].max().item(), abs=1e-4)
        assert choice["text"].startswith(llm.tokenizer.decode(ids, skip_special_tokens=False))
        assert lp["text_offset"][0] == 0
    first = body["choices"][0]["logprobs"]
    only = zero["choices"][0]
    assert only["logprobs"]["token_logprobs"][0] is None and len(only["logprobs"]["tokens"]) == len(prompts[0])
    assert only["logprobs"]["token_logprobs"][1:] == pytest.approx(first["token_logprobs"][1:-1], abs=1e-4)
    assert only["text"] == llm.tokenizer.decode(prompts[0], skip_special_tokens=False)
    assert only["finish_reason"] == "length" and zero["usage"]["completion_tokens"] == 0
    streamed = post(server, "/v1/completions", {"prompt": PROMPTS[1], "echo": True, "logprobs": 0, "max_tokens": 3,
                                                "temperature": 0, "stream": True})
    chunks = [json.loads(e) for e in sse_events(streamed)[:-1]]
    assert chunks[0]["choices"][0]["text"] == PROMPTS[1]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None


def test_penalties_and_logit_bias_match_a_reference(server, hf_model, llm, model_name):
    prompt = "1, 2, 3, 4, 5,"
    ids = llm.tokenizer.encode(prompt)
    plain = llm.generate(prompt, greedy(6)).pop().token_ids
    bias = {plain[0]: -100.0, plain[1]: 3.0}
    want = penalized_reference(hf_model, ids, 6, 1.3, 0.5, 0.7, bias)
    out = sdk(server).completions.create(
        model=model_name, prompt=prompt, max_tokens=6, temperature=0, presence_penalty=0.5, frequency_penalty=0.7,
        logit_bias={str(t): v for t, v in bias.items()}, logprobs=0,
        extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
    assert out.choices[0].logprobs.tokens == [llm.tokenizer.decode([t], skip_special_tokens=False) for t in want]


def test_vllm_bench_serve_request_bodies_are_served(server):
    for name, path in (("vllm_bench_completions.json", "/v1/completions"),
                       ("vllm_bench_chat.json", "/v1/chat/completions")):
        body = json.loads((DATA / name).read_text())
        response = post(server, path, body)
        assert response.status_code == 200, response.text
        events = sse_events(response)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 8  # ignore_eos: every token


def test_chat_as_current_clients_send_it(server, hf_tokenizer, model_name):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "developer", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    out = sdk(server).chat.completions.create(model=model_name, messages=messages, tools=tools, tool_choice="auto",
                                              response_format={"type": "text"}, max_tokens=6, temperature=0)
    assert out.choices[0].message.content and out.usage.completion_tokens <= 6
    # /tokenize renders the same prompt: developer as system, the arguments parsed, as transformers renders it.
    rendered = post(server, "/tokenize", {"messages": messages, "tools": tools}).json()
    template = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    template[2] = {**template[2], "content": "", "tool_calls": [{**template[2]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}
    want = hf_tokenizer.apply_chat_template(template, tools=tools, add_generation_prompt=True, tokenize=False)
    assert rendered["tokens"] == hf_tokenizer(want, add_special_tokens=False).input_ids
    assert out.usage.prompt_tokens == rendered["count"]
    assert out.choices[0].finish_reason in ("stop", "length") and out.choices[0].message.tool_calls == []


def test_tokenize_detokenize_ping_load_and_vllm_metrics(server, llm, model_name):
    tokenized = post(server, "/tokenize", {"model": model_name, "prompt": PROMPTS[1], "return_token_strs": True}).json()
    assert tokenized["tokens"] == llm.tokenizer.encode(PROMPTS[1]) and tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["max_model_len"] > 0 and len(tokenized["token_strs"]) == tokenized["count"]
    assert post(server, "/detokenize", {"tokens": tokenized["tokens"]}).json() == {"prompt": PROMPTS[1]}
    assert_openai_error(post(server, "/detokenize", {"tokens": [10**9]}), 400, "tokens")
    assert httpx.get(f"{server.url}/ping").status_code == 200 and httpx.post(f"{server.url}/ping").status_code == 200
    assert httpx.get(f"{server.url}/load", headers=AUTH).json() == {"server_load": 0}
    metrics = httpx.get(f"{server.url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert f'{name}{{engine="0",model_name="{model_name}"}}' in metrics, name
    assert sum(server.labelled("disagg_engine_prompt_tokens_total", "source").values()) == float(
        metrics.split(f'vllm:prompt_tokens_total{{engine="0",model_name="{model_name}"}} ')[1].split()[0])


def test_continuous_usage_stats(server):
    body = {"prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = [json.loads(e) for e in sse_events(post(server, "/v1/completions", body))[:-1]]
    completion_tokens = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 4
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in chunks)


@pytest.mark.timeout(300)
def test_lm_evaluation_harness_local_completions_runs_to_the_end(pair_1p1d, model_dir, monkeypatch):
    """lm-eval's local-completions with batch_size 4 against the decode node of a 1P1D pair:
    multiple_choice (loglikelihood: echo + logprobs, lists of token-id prompts; scored on the decode
    node) and generate_until (stop strings; prefilled by the prefill node), local tasks in tests/data."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)  # the task YAMLs name their JSONL relative to the repository root
    monkeypatch.setenv("OPENAI_API_KEY", "unused")  # the client wants one; the pair takes no key
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    decode = pair_1p1d[1]
    model_name = httpx.get(f"{decode.url}/v1/models").json()["data"][0]["id"]
    prefills_before = decode.labelled("disagg_remote_prefill_total", "outcome").get("ok", 0.0)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{decode.url}/v1/completions", "model": model_name, "tokenizer": str(model_dir),
                    "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1,
                    "max_retries": 1},
        tasks=["disagg_mc", "disagg_gen"], task_manager=TaskManager(include_path=str(DATA / "lm_eval")),
        batch_size=4, log_samples=False)
    mc, gen = results["results"]["disagg_mc"], results["results"]["disagg_gen"]
    print(f"lm-eval on {model_name}: disagg_mc acc {mc['acc,none']:.3f} (8 questions), "
          f"disagg_gen exact_match {gen['exact_match,none']:.3f} (4 questions)")
    assert mc["acc,none"] >= 0.5  # SmolLM2-135M answers most of these; chance is 0.25
    assert 0.0 <= gen["exact_match,none"] <= 1.0
    # Each generate_until question's KV came from the prefill node.
    assert decode.labelled("disagg_remote_prefill_total", "outcome").get("ok", 0.0) - prefills_before >= 4


def test_unknown_field_names_logged_once_are_bounded():
    """Field names come from clients: remembering every one logged would grow without end."""
    from disagg.api import protocol
    for i in range(protocol.MAX_WARNED_FIELDS + 50):
        protocol.CompletionRequest.model_validate({"prompt": "hi", f"unknown-{i}": 1})
    assert len(protocol._warned_fields) == protocol.MAX_WARNED_FIELDS


CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population"], "properties": {
    "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    "population": {"type": "integer", "minimum": 0, "maximum": 99999999}}}
CITY_CHAT = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]


def test_grammar_rows_leave_a_plain_request_in_their_batch_token_exact(llm):
    plain = greedy()
    solo = llm.generate(PROMPTS[2], plain)[0]
    specs = [StructuredOutputSpec("choice", json.dumps(["red", "green", "blue"])),
             StructuredOutputSpec("regex", "[0-9]{3}"), StructuredOutputSpec("json", json.dumps(CITY))]
    outs = llm.generate([PROMPTS[2]] + [PROMPTS[0]] * 3, [plain] + [greedy(30, structured=s) for s in specs])
    assert outs[0].token_ids == solo.token_ids
    assert outs[1].text in ("red", "green", "blue") and re.fullmatch("[0-9]{3}", outs[2].text)
    jsonschema.validate(json.loads(outs[3].text), CITY)
    assert [o.finish_reason for o in outs[1:]] == ["stop"] * 3  # EOS once the grammar accepts
    with pytest.raises(SamplingParamError, match="does not compile"):
        llm.generate(PROMPTS[0], greedy(structured=StructuredOutputSpec("regex", "[0-9")))


def test_structured_output_through_the_openai_sdk(server, model_name):
    client = sdk(server)
    schema_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    out = client.chat.completions.create(model=model_name, messages=CITY_CHAT, response_format=schema_format,
                                         max_tokens=40, temperature=0)
    jsonschema.validate(json.loads(out.choices[0].message.content), CITY)
    stream = client.chat.completions.create(model=model_name, messages=CITY_CHAT, response_format=schema_format,
                                            max_tokens=40, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == out.choices[0].message.content
    sampled = client.chat.completions.create(model=model_name, messages=CITY_CHAT, response_format=schema_format,
                                             max_tokens=40, temperature=0.8, seed=1, n=3)
    for choice in sampled.choices:  # each choice has its own matcher
        jsonschema.validate(json.loads(choice.message.content), CITY)
    out = client.completions.create(model=model_name, prompt="A three-digit number:", max_tokens=5, temperature=0,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", out.choices[0].text) and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model=model_name, prompt="Is the sky blue?", max_tokens=5, temperature=0,
                                    extra_body={"guided_choice": ["yes", "no"]})
    assert out.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "response_format"),
])
def test_a_bad_grammar_is_a_400_naming_its_field(server, body, param):
    response = post(server, "/v1/chat/completions", {"messages": CITY_CHAT, "max_tokens": 2, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "additionalProperties": False, "properties": {
                                                               "city": {"type": "string", "maxLength": 20}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
WEATHER_CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_choice_named_required_auto_and_none_through_the_openai_sdk(server, model_name):
    """Named and required: calls that match the schema; auto: content streamed, calls parsed; none: text."""
    client = sdk(server)
    out = client.chat.completions.create(model=model_name, messages=WEATHER_CHAT, tools=[CLOCK, WEATHER],
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         max_tokens=30, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    out = client.chat.completions.create(model=model_name, messages=WEATHER_CHAT, tools=[WEATHER, CLOCK],
                                         tool_choice="required", parallel_tool_calls=False, max_tokens=40,
                                         temperature=0)
    assert out.choices[0].finish_reason == "tool_calls" and len(out.choices[0].message.tool_calls) == 1
    assert out.choices[0].message.tool_calls[0].function.name in ("get_weather", "get_time")
    json.loads(out.choices[0].message.tool_calls[0].function.arguments)
    # "auto" (this server has the flags): content streams as it comes, and equals the answer's.
    answer = client.chat.completions.create(model=model_name, messages=CHAT, tools=[WEATHER], max_tokens=12,
                                            temperature=0)
    stream = client.chat.completions.create(model=model_name, messages=CHAT, tools=[WEATHER], max_tokens=12,
                                            temperature=0, stream=True)
    parts = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(parts) > 2 and "".join(parts) == answer.choices[0].message.content
    assert answer.choices[0].message.tool_calls == []  # this model writes no <tool_call>
    # The hermes parser on a real answer: a grammar makes the model write one call after some text.
    body = dict(model=model_name, messages=WEATHER_CHAT, tools=[WEATHER], max_tokens=40, temperature=0,
                extra_body={"structured_outputs": {"choice": [WRITTEN_CALL]}})
    answer = client.chat.completions.create(**body).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in answer.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    # "none": the template gets no tools and the answer is plain content.
    out = client.chat.completions.create(model=model_name, messages=WEATHER_CHAT, tools=[WEATHER], tool_choice="none",
                                         max_tokens=4, temperature=0)
    assert out.choices[0].message.tool_calls == [] and out.choices[0].message.content


WRITTEN_CALL = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required",
                                         "auto"])
def test_tool_calls_stream_as_written_and_add_up_to_the_answer_not_streamed(server, model_name, tool_choice):
    """vLLM's streamed shape: a call's first delta has its index, id, type and name with arguments "",
    the next ones only the index and a piece of the arguments, as the model writes them. The SDK's
    own accumulator adds them up to the answer not streamed. "auto": a grammar makes the model write
    a <tool_call> after some text."""
    client = sdk(server)
    body = dict(model=model_name, messages=WEATHER_CHAT, tools=[WEATHER, CLOCK], tool_choice=tool_choice,
                max_tokens=40, temperature=0, parallel_tool_calls=False)
    if tool_choice == "auto":
        body["extra_body"] = {"structured_outputs": {"choice": [WRITTEN_CALL]}}
    answer = client.chat.completions.create(**body).choices[0]
    with client.chat.completions.stream(**body) as stream:
        chunks = [event.chunk.choices[0] for event in stream if event.type == "chunk" and event.chunk.choices]
        streamed = stream.get_final_completion().choices[0]
    assert answer.finish_reason == streamed.finish_reason == chunks[-1].finish_reason == "tool_calls"
    assert len(answer.message.tool_calls) == 1
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in answer.message.tool_calls]
    jsonschema.validate(json.loads(answer.message.tool_calls[0].function.arguments),
                        WEATHER["function"]["parameters"] if answer.message.tool_calls[0].function.name
                        == "get_weather" else CLOCK["function"]["parameters"])
    assert (streamed.message.content or "").strip() == (answer.message.content or "")
    first, *rest = [call for c in chunks for call in c.delta.tool_calls or []]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (
        0, "function", answer.message.tool_calls[0].function.name, "")
    assert first.id.startswith("call_") and streamed.message.tool_calls[0].id == first.id
    assert len(rest) > 1 and all(p.index == 0 and p.id is None and p.type is None and p.function.name is None
                                 for p in rest)  # the arguments in pieces, as the tokens came


def test_best_of_returns_the_n_most_likely_of_its_candidates(server):
    body = {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 2, "best_of": 4}
    best = post(server, "/v1/completions", body).json()
    # The same 4 candidates (choice j samples with seed + j), all returned, with their logprobs.
    candidates = post(server, "/v1/completions", {**body, "n": 4, "logprobs": 0}).json()
    ranked = sorted(candidates["choices"], key=lambda c: sum(c["logprobs"]["token_logprobs"]), reverse=True)
    assert [(c["index"], c["text"]) for c in best["choices"]] == [(0, ranked[0]["text"]), (1, ranked[1]["text"])]
    assert all(c["logprobs"] is None for c in best["choices"])  # ranked by them, shown only when asked
    assert best["usage"]["completion_tokens"] == candidates["usage"]["completion_tokens"]  # every candidate counts
    assert_openai_error(post(server, "/v1/completions", {**body, "best_of": 1}), 400, "best_of must be at least n")
    assert_openai_error(post(server, "/v1/completions", {**body, "stream": True}), 400, "cannot be streamed")


def test_flags_from_the_config_file_reach_the_server(server):
    """--config's enable-auto-tool-choice and tool-call-parser: tools with tool_choice "auto" are
    answered (test_chat_as_current_clients_send_it); disable-log-requests: no request lines."""
    assert post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}).status_code == 200
    assert " started: " not in server.log() and " finished: " not in server.log()


def test_json_schema_answers_for_20_prompts_parse_and_validate_streamed_and_not(server):
    cities = ["Paris", "London", "Tokyo", "Rome", "Cairo"]
    prompts = [f"Name a large city ({cities[i % 5]}, say) and its population, as JSON. Request {i}." for i in range(20)]

    async def ask(client: httpx.AsyncClient, i: int) -> str:
        body = {"messages": [{"role": "user", "content": prompts[i]}], "max_tokens": 30, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}}
        if i % 2:
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["message"]["content"]
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            return await read_sse_text(response)

    async def ask_all() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as client:
            return await asyncio.gather(*[ask(client, i) for i in range(20)])

    for text in asyncio.run(ask_all()):
        jsonschema.validate(json.loads(text), CITY)
