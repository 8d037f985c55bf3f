"""vLLM's chat fields and API edges as clients meet them, through real nodes: continue_final_message,
echo, chat_template_kwargs, return_token_ids (streamed and not), return_tokens_as_token_ids, the
context-length 400 that LiteLLM and the openai SDK recognise, /v1/models/{id}, X-Request-Id, and
FastAPI's own refusals in OpenAI's error shape.

Most tests go through the decode node of the shared 1P1D pair (conftest's pair_1p1d); the
chat_template_kwargs test needs a template that reads a variable, so it has a colocated node of
its own, started with --chat-template."""

import json

import httpx
import openai
import pytest
from servers import PAIR_MAX_MODEL_LEN, Node, malformed_http_answer, start_node

from disagg.engine.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

QUESTION = {"role": "user", "content": "What is the capital of France?"}
STARTED = {"role": "assistant", "content": "The capital of France is"}
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
GREEDY = {"temperature": 0, "max_tokens": 4}
# The embedded template, and Qwen3's empty thinking block after the generation prompt when
# enable_thinking is false.
THINKING_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}")


@pytest.fixture(scope="module")
def decode(pair_1p1d: tuple[Node, Node]) -> Node:
    return pair_1p1d[1]


@pytest.fixture(scope="module")
def model_name(decode: Node) -> str:
    return httpx.get(f"{decode.url}/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Node:
    tmp = tmp_path_factory.mktemp("chat-fields")
    (tmp / "thinking.jinja").write_text(THINKING_TEMPLATE)
    node = start_node("both", tmp, extra_args=["--chat-template", str(tmp / "thinking.jinja"), "--max-model-len",
                                               "256", "--max-num-seqs", "4", "--disable-log-requests"])
    yield node
    node.kill()


def post(node: Node, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{node.url}{path}", json=body, headers=headers, timeout=60)


def chunks(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def assert_openai_error(response: httpx.Response, status: int, param: str | None, words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert words in error["message"], error["message"]
    return error


def test_continue_final_message_continues_the_turn(decode, model_name, hf_tokenizer):
    messages = [QUESTION, STARTED]
    body = {"model": model_name, "messages": messages, **CONTINUE, **GREEDY, "return_token_ids": True}
    answer = post(decode, "/v1/chat/completions", body).json()
    # The template applied by hand: the conversation without a generation prompt, less the end of
    # the last turn, so the prompt ends inside the assistant's message.
    rendered = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert rendered.endswith("<|im_end|>\n")
    want = hf_tokenizer(rendered.removesuffix("<|im_end|>\n"), add_special_tokens=False).input_ids
    continued = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                                 tokenize=False)  # transformers' own
    assert answer["prompt_token_ids"] == want == hf_tokenizer(continued, add_special_tokens=False).input_ids
    assert post(decode, "/tokenize", {"messages": messages, **CONTINUE}).json()["tokens"] == want
    # The model goes on with the sentence: greedy, it writes what a plain completion of those ids writes.
    plain = post(decode, "/v1/completions", {"prompt": want, **GREEDY}).json()["choices"][0]["text"]
    choice = answer["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": plain, "tool_calls": []}
    assert answer["usage"]["prompt_tokens"] == len(want)
    # echo: the answer starts with the message it continues, streamed as vLLM does (role, then the echo).
    echoed = post(decode, "/v1/chat/completions", {**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == STARTED["content"] + plain
    streamed = chunks(post(decode, "/v1/chat/completions", {**body, "echo": True, "stream": True}))
    deltas = [c["choices"][0]["delta"] for c in streamed]
    assert deltas[0]["role"] == "assistant" and deltas[1]["content"] == STARTED["content"]
    assert "".join(d["content"] or "" for d in deltas) == STARTED["content"] + plain


@pytest.mark.parametrize("template", [None, THINKING_TEMPLATE.replace("message['content']",
                                                                     "(message['content'] | trim)")])
def test_the_tokenizer_continues_a_message_as_transformers_does(model_dir, hf_tokenizer, template):
    """The embedded template, and one that trims the content (and so the space before the cut)."""
    ours = Tokenizer(model_dir, chat_template=template)
    for messages in ([QUESTION, STARTED], [QUESTION, {"role": "assistant", "content": "It is "}], [QUESTION]):
        assert ours.apply_chat_template(messages, False, continue_final_message=True) == \
            hf_tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=False,
                                             continue_final_message=True, tokenize=False)
    with pytest.raises(ValueError, match="does not render the last message"):
        Tokenizer(model_dir, chat_template="{{ 'x' }}").apply_chat_template([QUESTION], False,
                                                                           continue_final_message=True)


def test_continuing_needs_add_generation_prompt_false_and_echo_needs_the_roles_to_match(decode):
    refused = post(decode, "/v1/chat/completions", {"messages": [QUESTION, STARTED], "continue_final_message": True})
    assert_openai_error(refused, 400, "continue_final_message", "Cannot set both `continue_final_message` and "
                                                                "`add_generation_prompt` to True")
    refused = post(decode, "/tokenize", {"messages": [QUESTION, STARTED], "continue_final_message": True})
    assert_openai_error(refused, 400, "continue_final_message", "add_generation_prompt")
    # After a generation prompt the answer is the assistant's: a last user message is not echoed.
    answer = post(decode, "/v1/chat/completions", {"messages": [QUESTION], "echo": True, **GREEDY}).json()
    assert not answer["choices"][0]["message"]["content"].startswith(QUESTION["content"])
    # Without one, the answer goes on in the last message's role, as vLLM answers it, and echo repeats it.
    answer = post(decode, "/v1/chat/completions", {"messages": [QUESTION], "echo": True, **CONTINUE,
                                                   **GREEDY}).json()
    assert answer["choices"][0]["message"]["role"] == "user"
    assert answer["choices"][0]["message"]["content"].startswith(QUESTION["content"])


def test_chat_template_kwargs_reach_the_template(thinking_server):
    base = {"messages": [QUESTION]}
    plain = post(thinking_server, "/tokenize", base).json()
    thinking_off = post(thinking_server, "/tokenize", {**base, "chat_template_kwargs": {"enable_thinking": False}})
    by_hand = post(thinking_server, "/tokenize", {"prompt": "<think>\n\n</think>\n\n", "add_special_tokens": False})
    assert thinking_off.json()["tokens"] == plain["tokens"] + by_hand.json()["tokens"]
    on = post(thinking_server, "/tokenize", {**base, "chat_template_kwargs": {"enable_thinking": True}}).json()
    assert on["tokens"] == plain["tokens"]
    # Chat renders the same prompt, and the kwargs cannot replace what the request itself says.
    answer = post(thinking_server, "/v1/chat/completions", {
        **base, "chat_template_kwargs": {"enable_thinking": False, "add_generation_prompt": False},
        "return_token_ids": True, **GREEDY}).json()
    assert answer["prompt_token_ids"] == thinking_off.json()["tokens"]
    # A template in the request is refused, as vLLM refuses it without --trust-request-chat-template.
    for body, param in (({**base, "chat_template": "{{ 'x' }}"}, "chat_template"),
                        ({**base, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, "chat_template_kwargs")):
        for path in ("/tokenize", "/v1/chat/completions"):
            assert_openai_error(post(thinking_server, path, body), 400, param, "trust-request-chat-template")


def test_return_token_ids_streamed_and_not(decode, model_name, hf_tokenizer):
    body = {"model": model_name, "messages": [QUESTION], "temperature": 0, "max_tokens": 6, "return_token_ids": True}
    answer = post(decode, "/v1/chat/completions", body).json()
    prompt_ids = post(decode, "/tokenize", {"messages": [QUESTION]}).json()["tokens"]
    token_ids = answer["choices"][0]["token_ids"]
    assert answer["prompt_token_ids"] == prompt_ids and len(token_ids) == answer["usage"]["completion_tokens"]
    assert hf_tokenizer.decode(token_ids, skip_special_tokens=True) == answer["choices"][0]["message"]["content"]
    # Streamed with n=2: each choice's first chunk carries the prompt's ids, the others each the tokens they add.
    streamed = chunks(post(decode, "/v1/chat/completions", {**body, "n": 2, "stream": True}))
    for index in (0, 1):
        mine = [c for c in streamed if c["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == prompt_ids and all(c["prompt_token_ids"] is None for c in mine[1:])
        assert [t for c in mine for t in c["choices"][0]["token_ids"] or []] == token_ids
    # Completions: per choice, as vLLM; the openai SDK keeps the extra fields.
    client = openai.OpenAI(base_url=f"{decode.url}/v1", api_key="unused")
    completion = client.completions.create(model=model_name, prompt=prompt_ids, temperature=0, max_tokens=6,
                                           extra_body={"return_token_ids": True})
    assert completion.choices[0].prompt_token_ids == prompt_ids and completion.choices[0].token_ids == token_ids
    stream = client.completions.create(model=model_name, prompt=prompt_ids, temperature=0, max_tokens=6, stream=True,
                                       extra_body={"return_token_ids": True})
    pieces = [c.choices[0] for c in stream]
    assert pieces[0].prompt_token_ids == prompt_ids and [t for p in pieces for t in p.token_ids] == token_ids


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(decode):
    body = {"messages": [QUESTION], **GREEDY, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True,
            "return_token_ids": True}
    choice = post(decode, "/v1/chat/completions", body).json()["choices"][0]
    assert [lp["token"] for lp in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(top["token"].startswith("token_id:") for lp in choice["logprobs"]["content"]
               for top in lp["top_logprobs"])
    completion = post(decode, "/v1/completions", {"prompt": "Paris is", **GREEDY, "logprobs": 1,
                                                  "return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = completion.json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]


def test_context_length_errors_are_refused_before_any_compute_in_openais_words(decode, model_name):
    limit = PAIR_MAX_MODEL_LEN
    prompt_tokens = post(decode, "/tokenize", {"messages": [QUESTION]}).json()["count"]
    computed = decode.metric("disagg_prompt_tokens_total")
    client = openai.OpenAI(base_url=f"{decode.url}/v1", api_key="unused", max_retries=0)
    max_tokens = limit - prompt_tokens + 1
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_name, messages=[QUESTION], max_tokens=max_tokens)
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "messages"
    assert refused.value.body["message"].startswith(
        f"This model's maximum context length is {limit} tokens. However, you requested {limit + 1} tokens "
        f"({prompt_tokens} in the messages, {max_tokens} in the completion). Please reduce the length of the "
        "messages or completion.")
    # max_tokens that leaves no room for any prompt is what the error names.
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_name, messages=[QUESTION], max_completion_tokens=limit)
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "max_completion_tokens"
    # A prompt that alone fills the context: the same words, one token asked of the completion at least.
    long_prompt = [QUESTION["content"][:1]] * limit
    error = assert_openai_error(post(decode, "/v1/completions", {"prompt": " ".join(long_prompt), "max_tokens": None}),
                                400, "prompt", f"This model's maximum context length is {limit} tokens.")
    assert error["code"] == "context_length_exceeded" and "1 in the completion" in error["message"]
    assert_openai_error(post(decode, "/v1/completions", {"prompt": [7] * limit}), 400, "prompt",
                        f"({limit} in the messages, 16 in the completion)")  # completions' default max_tokens
    assert decode.metric("disagg_prompt_tokens_total") == computed  # none of them reached the engine


def test_litellm_knows_the_context_length_error(decode, model_name, monkeypatch):
    """LiteLLM raises its ContextWindowExceededError, which its context-window fallbacks key on."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its price list at import
    litellm = pytest.importorskip("litellm")
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model=f"openai/{model_name}", api_base=f"{decode.url}/v1", api_key="unused",
                           messages=[QUESTION], max_tokens=PAIR_MAX_MODEL_LEN, num_retries=0)


def test_max_tokens_left_out_is_what_the_context_has_left(decode):
    left = 5
    completion = post(decode, "/v1/completions", {"prompt": [7] * (PAIR_MAX_MODEL_LEN - left), "max_tokens": None,
                                                  "ignore_eos": True, "temperature": 0}).json()
    # A chat prompt as long: one token of " x" a word, after the template's own.
    message = {"role": "user", "content": "x"}
    words = PAIR_MAX_MODEL_LEN - left - post(decode, "/tokenize", {"messages": [message]}).json()["count"]
    message["content"] += " x" * words
    chat = post(decode, "/v1/chat/completions", {"messages": [message], "ignore_eos": True, "temperature": 0}).json()
    for answer in (completion, chat):
        assert answer["usage"]["prompt_tokens"] == PAIR_MAX_MODEL_LEN - left, answer["usage"]
        assert answer["usage"]["completion_tokens"] == left and answer["choices"][0]["finish_reason"] == "length"


def test_models_retrieve_through_the_openai_sdk(decode, model_name):
    client = openai.OpenAI(base_url=f"{decode.url}/v1", api_key="unused", max_retries=0)
    card = client.models.retrieve(model_name)
    assert (card.id, card.object, card.max_model_len) == (model_name, "model", PAIR_MAX_MODEL_LEN)
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4")
    assert missing.value.code == "model_not_found" and missing.value.param == "model"


def test_every_response_carries_x_request_id(decode):
    given = {"X-Request-Id": "client-id-7"}
    for response in (post(decode, "/v1/chat/completions", {"messages": [QUESTION], **GREEDY}, given),
                     post(decode, "/v1/completions", {"prompt": "hi", **GREEDY, "stream": True}, given),
                     post(decode, "/v1/completions", {"prompt": "hi", "n": 0}, given),
                     httpx.get(f"{decode.url}/health", headers=given),
                     httpx.get(f"{decode.url}/nowhere", headers=given)):
        assert response.headers["x-request-id"] == "client-id-7"
    # Without one: the id the answer carries, or a fresh one.
    answer = post(decode, "/v1/chat/completions", {"messages": [QUESTION], **GREEDY})
    assert answer.headers["x-request-id"] == answer.json()["id"]
    assert httpx.get(f"{decode.url}/v1/models").headers["x-request-id"]


def test_fastapis_and_uvicorns_own_refusals_are_in_openais_error_shape(pair_1p1d, decode):
    for node in pair_1p1d:  # a request that is not HTTP at all: uvicorn answers before any app
        status, body = malformed_http_answer(node.port)
        assert status == b"HTTP/1.1 400 Bad Request" and "not parse as HTTP/1.1" in body["error"]["message"]
        assert body["error"]["type"] == "invalid_request_error"
    prefill = pair_1p1d[0]  # its health app too
    assert_openai_error(httpx.get(f"{prefill.url}/v1/completions"), 404, None, "Not Found: GET /v1/completions")
    assert_openai_error(httpx.post(f"{prefill.url}/health"), 405, None, "Method Not Allowed: POST /health")
    assert_openai_error(httpx.get(f"{decode.url}/v1/no-such-path"), 404, None, "Not Found: GET /v1/no-such-path")
    refused = httpx.post(f"{decode.url}/v1/models")
    assert_openai_error(refused, 405, None, "Method Not Allowed: POST /v1/models")
    assert refused.headers["allow"] == "GET"
    assert_openai_error(httpx.get(f"{decode.url}/v1/chat/completions"), 405, None, "Method Not Allowed")
    assert_openai_error(httpx.post(f"{decode.url}/v1/completions", content=b"{", headers={
        "Content-Type": "application/json"}), 400, None, "not valid JSON")
    assert_openai_error(httpx.get(f"{decode.url}/v1/models/gpt-4"), 404, "model", "does not exist")


def test_null_fields_take_their_defaults_on_the_wire(decode):
    body = {"messages": [QUESTION], **GREEDY, "n": None, "stream": None, "logprobs": None, "echo": None}
    answer = post(decode, "/v1/chat/completions", body).json()
    assert len(answer["choices"]) == 1 and answer["choices"][0]["logprobs"] is None
