"""The reasoning parsers (--reasoning-parser deepseek_r1, qwen3): on text, and on the embedded model's
real answers through nodes started with them (deepseek_r1's a decode node of the shared 1P1D pair's
prefill node, qwen3's colocated). Shown a few turns that reason in <think>...</think> first, the
model (greedy) reasons the same way, so no grammar is needed to make it; structured output holds
only what follows the reasoning, as vLLM's does."""

import json

import httpx
import openai
import pytest
from servers import PAIR_MAX_MODEL_LEN, Node, start_node

from disagg.api.reasoning import THINK_END, ReasoningParser, ReasoningStream, prompt_ends_reasoning
from disagg.engine.sampling_params import SamplingParamError, StructuredOutputSpec
from disagg.engine.structured_output import GrammarCompiler

# --- on text ----------------------------------------------------------------------------------------

QWEN3_OPENED = "<|im_start|>assistant\n<think>\n"  # Qwen3's newer templates open the reasoning
QWEN3_CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # ... and close it with thinking off
# (answer, reasoning_content, content), for a prompt that leaves the reasoning to the answer.
SPLITS = [
    ("<think>1 plus 1 is 2.</think>The answer is 2.", "1 plus 1 is 2.", "The answer is 2."),
    ("\n<think>\nhm\n</think>\n\nTwo.", "\nhm\n", "\n\nTwo."),
    ("1 plus 1 is 2.</think>The answer is 2.", "1 plus 1 is 2.", "The answer is 2."),  # the template opened it
    ("Still thinking when max_tokens", "Still thinking when max_tokens", None),  # cut short: all reasoning
    ("<think>short</think>", "short", None),
    ("a < b, and </thin is no tag</think>so", "a < b, and </thin is no tag", "so"),
]


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize(("text", "reasoning", "content"), SPLITS)
def test_the_reasoning_is_split_off_as_vllm_splits_it(name, text, reasoning, content):
    assert ReasoningParser.for_prompt(name, QWEN3_OPENED).extract(text) == (reasoning, content)
    assert ReasoningParser.for_prompt(name, "<|im_start|>assistant\n").extract(text) == (reasoning, content)


@pytest.mark.parametrize(("text", "reasoning", "content"), SPLITS)
def test_a_stream_adds_up_to_the_split_at_any_step(text, reasoning, content):
    for step in (1, 2, 3, 7):
        stream, pieces, contents = ReasoningStream(ReasoningParser("deepseek_r1", True)), [], []
        for end in [*range(step, len(text), step), len(text)]:
            piece, text_so_far = stream.update(text[:end], finished=end == len(text))
            pieces.append(piece)
            contents.append(text_so_far)
        assert "".join(pieces) == (reasoning or "")
        assert contents[-1] == (content or "")
        assert all(b.startswith(a) for a, b in zip(contents, contents[1:]))  # the content only grows
        assert not any("<" in p for p in pieces) or "<" in reasoning  # no tag, not even half of one, goes out


def test_a_prompt_that_closed_the_reasoning_leaves_all_content():
    assert prompt_ends_reasoning(QWEN3_CLOSED)
    assert not prompt_ends_reasoning(QWEN3_OPENED) and not prompt_ends_reasoning("no tags at all")
    # A </think> of an earlier turn is not the template's (vLLM's check of the last tag would say it is).
    earlier = "<|im_start|>assistant\n<think>x</think>4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
    assert not prompt_ends_reasoning(earlier + "<|im_start|>assistant\n")
    parser = ReasoningParser.for_prompt("qwen3", QWEN3_CLOSED)
    assert parser.extract("The answer is 2.") == (None, "The answer is 2.")
    assert ReasoningStream(parser).update("The ans", False) == ("", "The ans")


# --- the grammar after the reasoning, on tokens ---------------------------------------------------------

def test_the_grammar_starts_where_the_reasoning_ends_however_its_tokens_spell_it(model_dir):
    """</think> is three tokens in this vocabulary (</ think >), and a model may spell it with others;
    the grammar waits for its bytes. Before them every token is free (EOS too); a token that
    completes it may carry the answer's first bytes, which the grammar must take."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = {text: tokenizer.convert_tokens_to_ids(text) for text in ("<", "/", "</", "think", ">", ">>", '>"', "{", "x")}
    compiler = GrammarCompiler(model_dir / "tokenizer.json", len(tokenizer), [tokenizer.eos_token_id])
    end = tuple(tokenizer.encode(THINK_END, add_special_tokens=False))
    assert end == (ids["</"], ids["think"], ids[">"])
    grammar = compiler.grammar(StructuredOutputSpec("json", '{"type": "object"}', end))
    for text in ("x", "</", "think"):  # the reasoning: free, tokens the grammar alone refuses included
        assert grammar.allows(ids[text]) and grammar.allows(tokenizer.eos_token_id)
        assert grammar.refused_now() == []
        grammar.accept(ids[text])
    # After "</think", of the tokens that would finish the marker, those whose rest JSON refuses are masked.
    refused = grammar.refused_now()
    assert ids[">>"] in refused and ids['>"'] in refused and ids[">"] not in refused and ids["x"] not in refused
    grammar.accept(ids[">"])
    assert grammar.start is None and not grammar.allows(ids["x"]) and grammar.allows(ids["{"])
    with pytest.raises(ValueError, match="does not follow"):
        grammar.accept(ids["x"])
    # Spelled "<" "/" "think" '>"': the marker's last token carries the answer's first byte.
    quoted = compiler.grammar(StructuredOutputSpec("regex", '"[a-z]+"', end))
    for text in ("<", "/", "think"):
        quoted.accept(ids[text])
    assert quoted.allows(ids['>"']) and not quoted.allows(ids[">>"])
    quoted.accept(ids['>"'])
    for token in tokenizer.encode('yes"', add_special_tokens=False):
        quoted.accept(token)
    assert quoted.start is None and quoted.matcher.is_accepting()
    with pytest.raises(SamplingParamError, match="outside the vocabulary"):
        compiler.compile(StructuredOutputSpec("json", "{}", (len(tokenizer) + 5,)))


# --- on real answers ----------------------------------------------------------------------------------

FEW_SHOT = [
    {"role": "system", "content": "Think first inside <think></think>, then answer."},
    {"role": "user", "content": "What is 1+1?"},
    {"role": "assistant", "content": "<think>1 plus 1 is 2.</think>The answer is 2."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>2 plus 2 is 4.</think>The answer is 4."},
    {"role": "user", "content": "What is 3+3?"},
]
# SmolLM2's template, with Qwen3's generation prompt: <think> opened, or opened and closed when the last
# message ends with /no_think (as enable_thinking false renders it).
QWEN3_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if messages[-1]['content'].endswith('/no_think') %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def reasoning_node(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pair_1p1d):
    """A node with one --reasoning-parser at a time, and the hermes tool parser, so that calls are
    read out of what follows the reasoning. deepseek_r1's is a decode node of the shared pair's
    prefill node, which samples every first token (remote_prefill always); qwen3's is colocated,
    with Qwen3's kind of template."""
    tmp = tmp_path_factory.mktemp(f"reasoning-{request.param}")
    args = ["--reasoning-parser", request.param, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--disable-log-requests"]
    if request.param == "qwen3":
        (tmp / "template.jinja").write_text(QWEN3_TEMPLATE)
        node = start_node("both", tmp, extra_args=[*args, "--chat-template", str(tmp / "template.jinja")])
    else:
        prefill = pair_1p1d[0]
        node = start_node("consumer", tmp, prefill_nodes=[prefill.grpc_address],
                          extra_args=[*args, "--max-model-len", str(PAIR_MAX_MODEL_LEN)],
                          kv_extra={"prefill_policy": "fail", "remote_prefill": "always"})
    yield request.param, node
    node.kill()


def sdk(node: Node) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0)


def few_shot(name: str) -> list[dict]:
    """The turns, written as the template would have the model write them: with qwen3's template the
    prompt opens <think>, so the earlier answers start inside it too."""
    if name == "deepseek_r1":
        return FEW_SHOT
    return [{**m, "content": m["content"].replace("<think>", "<think>\n")} for m in FEW_SHOT]


def raw_answer(node: Node, messages: list[dict], max_tokens: int) -> str:
    """The same greedy answer as plain text: the chat prompt's tokens through /v1/completions."""
    tokens = httpx.post(f"{node.url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    body = {"prompt": tokens, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{node.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_chat_answers_carry_the_reasoning_apart_streamed_and_not(reasoning_node):
    name, node = reasoning_node
    client = sdk(node)
    model = client.models.list().data[0].id
    messages = few_shot(name)
    raw = raw_answer(node, messages, 24)
    assert "</think>" in raw and "<think>" not in raw[raw.index("</think>"):]  # the model reasoned, then answered
    reasoning, _, content = raw.removeprefix("<think>").partition("</think>")
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    message = answer.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (reasoning, content)
    assert message.model_extra["reasoning"] == reasoning  # vLLM's newer name for it
    assert reasoning.strip() == "3 plus 3 is 6." and "6" in content
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                            stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    streamed_reasoning = [d.model_extra.get("reasoning_content") for d in deltas if d.model_extra.get("reasoning")]
    assert len(streamed_reasoning) > 2 and "".join(streamed_reasoning) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not d.model_extra.get("reasoning") for d in deltas[first_content:])  # the reasoning came first


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_responses_carry_a_reasoning_item_before_the_message(reasoning_node):
    name, node = reasoning_node
    client = sdk(node)
    model = client.models.list().data[0].id
    messages = few_shot(name)
    body = dict(model=model, instructions=messages[0]["content"], input=messages[1:], max_output_tokens=24,
                temperature=0)
    response = client.responses.create(**body)
    assert [o.type for o in response.output] == ["reasoning", "message"]
    reasoning = response.output[0].content[0].text
    assert reasoning.strip() == "3 plus 3 is 6." and "6" in response.output_text
    events = list(client.responses.create(**body, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    done = events[-1].response
    assert [o.type for o in done.output] == ["reasoning", "message"]
    assert (done.output[0].content[0].text, done.output_text) == (reasoning, response.output_text)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tool_calls_are_read_out_of_what_follows_the_reasoning(reasoning_node):
    """hermes after the reasoning parser: a call written after </think> is a call, one inside the
    reasoning stays reasoning (vLLM reads calls in the content only)."""
    name, node = reasoning_node
    client = sdk(node)
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    turn = {"role": "assistant", "content": f"<think>{call} would tell.</think>{call}"}
    messages = [{"role": "user", "content": "What time is it?"}, turn,
                {"role": "user", "content": "Tell me the time."}, turn,
                {"role": "user", "content": "What time is it now?"}]
    if name == "qwen3":
        messages = [{**m, "content": m["content"].replace("<think>", "<think>\n")} for m in messages]
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    raw = raw_answer(node, messages, 64)
    assert raw.removeprefix("<think>").partition("</think>")[2].strip() == call, raw  # the model copied the turns
    answer = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, tools=tools,
                                            max_tokens=64, temperature=0).choices[0]
    assert answer.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in answer.message.tool_calls] == [("get_time", "{}")]
    assert call in answer.message.model_extra["reasoning_content"]


ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


def streamed_message(node: Node, body: dict) -> tuple[str, str]:
    """(reasoning_content, content) of a streamed chat answer, its deltas joined."""
    reasoning, content = "", ""
    with httpx.stream("POST", f"{node.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
    return reasoning, content


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_structured_output_holds_only_what_follows_the_reasoning(reasoning_node):
    """As vLLM's: the reasoning is the model's own, as without a grammar, and the grammar holds the
    answer after </think>; streamed == not. Through deepseek_r1's decode node the first token is
    sampled on the prefill node: a reasoning token that the grammar alone would refuse."""
    name, node = reasoning_node
    messages = few_shot(name)
    body = {"messages": messages, "max_tokens": 32, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}}
    answer = httpx.post(f"{node.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    message = answer["message"]
    reasoning = message["reasoning_content"]  # the model's own (test_chat_answers_...: the same without a grammar)
    assert reasoning.strip() == "3 plus 3 is 6.", answer
    assert json.loads(message["content"]) == {"answer": 6} and answer["finish_reason"] == "stop"
    assert streamed_message(node, body) == (reasoning, message["content"])
    # The Responses API, with vLLM's guided choice: the same split into a reasoning item and the message.
    body = {"instructions": messages[0]["content"], "input": messages[1:], "max_output_tokens": 32,
            "temperature": 0, "structured_outputs": {"choice": ["six", "seven"]}}
    response = httpx.post(f"{node.url}/v1/responses", json=body, timeout=60).json()
    assert [o["type"] for o in response["output"]] == ["reasoning", "message"], response
    assert response["output"][0]["content"][0]["text"] == reasoning
    assert response["output"][1]["content"][0]["text"] in ("six", "seven")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_prompt_that_closed_the_reasoning_leaves_the_grammar_all_the_answer(reasoning_node):
    """Where the template closed the reasoning (qwen3 with thinking off) the whole answer is content,
    and the grammar holds it from its first token."""
    name, node = reasoning_node
    if name != "qwen3":
        pytest.skip("only Qwen3's template closes the reasoning in the prompt")
    body = {"messages": [{"role": "user", "content": "Yes or no? /no_think"}], "max_tokens": 4,
            "structured_outputs": {"choice": ["yes", "no"]}}
    message = httpx.post(f"{node.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert message["content"] in ("yes", "no") and "reasoning_content" not in message
    assert "reasoning" not in message  # no reasoning fields at all when there is none
