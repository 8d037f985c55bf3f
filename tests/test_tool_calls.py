"""The tool-call parsers (hermes, llama3_json, mistral, pythonic, qwen3_coder) and the forced-call
schema, on strings (no model needed); and each parser on a real answer that a grammar makes the
embedded model write, streamed and not, through a node started with that parser."""

import json

import openai
import pytest
from servers import Node, start_node

from disagg.api.protocol import DeltaFunctionCall, DeltaToolCall
from disagg.api.tool_calls import (
    CallDelta,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    PythonicParser,
    Qwen3CoderParser,
    RequiredParser,
    ToolCallStream,
    ToolOptions,
    ToolParser,
    forced_calls,
    forced_schema,
    parse_hermes,
    streamable_end,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_hermes_reads_every_call_and_keeps_the_rest_as_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                    ("get_time", {})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


def test_hermes_leaves_malformed_calls_in_the_content():
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    content, calls = parse_hermes("Sure. " + broken + ' <tool_call>["not", "a call"]</tool_call>')
    assert calls == [] and content == "Sure. " + broken + ' <tool_call>["not", "a call"]</tool_call>'
    content, calls = parse_hermes("no calls here")
    assert (content, calls) == ("no calls here", [])


def test_hermes_reads_an_unclosed_last_call_and_gives_no_content_when_only_calls():
    content, calls = parse_hermes('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "UTC"}')]


def test_forced_schema_and_calls():
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert forced_schema([TIME, WEATHER], named, True) == WEATHER["function"]["parameters"]
    assert [(c.name, c.arguments) for c in forced_calls('{"city": "Oslo"}', named)] == [("get_weather",
                                                                                          '{"city": "Oslo"}')]
    schema = forced_schema([WEATHER, TIME], "required", False)
    assert schema["maxItems"] == 1 and [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [
        ["get_weather"], ["get_time"]]
    calls = forced_calls('[{"name": "get_time", "parameters": {}}]', "required")
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    assert forced_calls('[{"name": "get_ti', "required") == []  # cut short by max_tokens


def test_auto_tool_choice_needs_both_flags_as_in_vllm():
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        ToolOptions().check_auto()
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ToolOptions(enable_auto_tool_choice=True).check_auto()
    ToolOptions(True, "hermes").check_auto()


def test_a_stream_sends_content_up_to_where_a_tool_call_may_start():
    assert streamable_end("The answer is 4.") == len("The answer is 4.")
    assert streamable_end("Let me check. <tool") == len("Let me check. ")  # may become <tool_call>
    assert streamable_end("a < b") == len("a < b")
    assert streamable_end('Sure <tool_call>{"name"') == len("Sure ")


def stream_pieces(text: str, parser: ToolParser, step: int = 3) -> list[CallDelta]:
    """A ToolCallStream fed the text as a stream grows it, a few characters at a time."""
    stream, pieces = ToolCallStream(parser), []
    for end in range(step, len(text), step):
        pieces += stream.update(text[:end], finished=False)
    return pieces + stream.update(text, finished=True)


def added_up(pieces: list[CallDelta]) -> list[tuple[str, str]]:
    """(name, arguments) of each call, as a client adds up the pieces."""
    calls: dict[int, list[str]] = {}
    for piece in pieces:
        if piece.id is not None:
            assert piece.index == len(calls) and piece.name and piece.arguments == ""
            calls[piece.index] = [piece.name, ""]
        else:
            assert piece.name is None and piece.arguments
            calls[piece.index][1] += piece.arguments
    return [tuple(call) for call in calls.values()]


def test_streamed_calls_add_up_to_the_calls_of_the_answer_not_streamed():
    auto = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, '
            '{"note": "a } in a string"}]}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    pieces = stream_pieces(auto, HermesParser([]))
    assert added_up(pieces) == [(c.name, c.arguments) for c in parse_hermes(auto)[1]]
    assert len([p for p in pieces if p.index == 0]) > 10  # the arguments went out as they grew
    assert parse_hermes(auto)[1][0].arguments == '{"city": "Paris", "days": [1, {"note": "a } in a string"}]}'
    # Arguments written first, or no name-first head: read when the call closes, whole or not at all.
    other = ('<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call> '
             '<tool_call>{"name": get_weather, "arguments": {}}</tool_call>')
    pieces = stream_pieces(other, HermesParser([]))
    assert added_up(pieces) == [(c.name, c.arguments) for c in parse_hermes(other)[1]] == [
        ("get_time", '{"zone": "UTC"}')]
    assert len(pieces) == 2
    # A started call cannot be taken back: cut short, it was sent as far as it went (not streamed: no call).
    cut = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_ca'
    assert added_up(stream_pieces(cut, HermesParser([]))) == [("get_weather", '{"city": "Par</tool_ca')]
    assert parse_hermes(cut)[1] == []
    required = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    pieces = stream_pieces(required, RequiredParser([]))
    assert added_up(pieces) == [(c.name, c.arguments) for c in forced_calls(required, "required")]
    pieces = stream_pieces('{"city": "Oslo"}', NamedParser([], "get_weather"))
    assert added_up(pieces) == [("get_weather", '{"city": "Oslo"}')] and len(pieces) > 3


def test_a_later_piece_of_a_call_carries_only_its_index_and_arguments():
    """As vLLM and OpenAI send it: no id, type or name at all (not null)."""
    first = DeltaToolCall(index=0, id="call_1", type="function", function=DeltaFunctionCall(name="f", arguments=""))
    later = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"a'))
    assert json.loads(first.model_dump_json()) == {"index": 0, "id": "call_1", "type": "function",
                                                   "function": {"name": "f", "arguments": ""}}
    assert json.loads(later.model_dump_json()) == {"index": 0, "function": {"arguments": '{"a'}}


# --- the other formats, on text ------------------------------------------------------------------

FORECAST = {"type": "function", "function": {"name": "get_forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "hours": {"type": "array"}}}}}
TOOLS = [WEATHER, TIME, FORECAST]

# (parser, an answer in its format, its content, its calls as (name, arguments)), as the model writes them.
ANSWERS = [
    (HermesParser, 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Paris"}')]),
    (Llama3JsonParser, '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                       '{"name": "get_time", "parameters": {}}',
     None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    (Llama3JsonParser, '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}',
     None, [("get_weather", '{"city": "Paris"}')]),
    (MistralParser, 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                    '{"name": "get_time", "arguments": {}}]',
     "Sure.", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    (MistralParser, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time{}',
     None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    (PythonicParser, '[get_forecast(city="Paris", days=3, metric=True, hours=[6, 18]), get_time()]',
     None, [("get_forecast", '{"city": "Paris", "days": 3, "metric": true, "hours": [6, 18]}'), ("get_time", "{}")]),
    (Qwen3CoderParser, "I will look.\n<tool_call>\n<function=get_forecast>\n<parameter=city>\nParis\n</parameter>\n"
                       "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
                       "<parameter=hours>\n[6, 18]\n</parameter>\n</function>\n</tool_call>",
     "I will look.\n", [("get_forecast", '{"city": "Paris", "days": 3, "metric": true, "hours": [6, 18]}')]),
]


def streamed(parser: ToolParser, text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    """The content and the calls a stream sends for the answer, fed `step` characters at a time, as
    ChatFormat sends them: content up to content_end while it is written, the rest at the end."""
    stream, pieces, sent = ToolCallStream(parser), [], 0
    for end in range(step, len(text), step):
        sent = max(sent, parser.content_end(text[:end]))
        pieces += stream.update(text[:end], finished=False)
    rest = parser.stream_content(text)
    content = rest if rest.startswith(text[:sent]) else text[:sent]
    return content, added_up(pieces + stream.update(text, finished=True))


@pytest.mark.parametrize(("kind", "text", "content", "calls"), ANSWERS, ids=[a[0].__name__ for a in ANSWERS])
def test_each_parser_reads_its_format_and_a_stream_adds_up_to_it(kind, text, content, calls):
    parser = kind(TOOLS)
    got_content, got_calls = parser.parse(text)
    assert (got_content, [(c.name, c.arguments) for c in got_calls]) == (content, calls)
    for step in (1, 2, 5, 13):
        streamed_content, streamed_calls = streamed(parser, text, step)
        assert streamed_calls == calls
        # hermes strips the content around calls; a stream has sent the space before a call by then
        assert (streamed_content.strip() if kind is HermesParser else streamed_content) == (content or "")
    # parallel_tool_calls false: the first call only, streamed or not.
    first = kind(TOOLS, max_calls=1)
    assert [(c.name, c.arguments) for c in first.parse(text)[1]] == calls[:1]
    assert streamed(first, text, 3)[1] == calls[:1]


@pytest.mark.parametrize("kind", [Llama3JsonParser, MistralParser, PythonicParser, Qwen3CoderParser])
def test_an_answer_without_calls_is_content_streamed_as_it_comes(kind):
    text = "The weather in Paris is sunny, [mostly] {warm}."
    parser = kind(TOOLS)
    assert parser.parse(text) == (text, [])
    assert parser.content_end(text) == len(text)
    assert streamed(parser, text, 4) == (text, [])


def test_what_is_not_a_call_in_each_format_stays_content():
    # Llama: an object that is not a call makes the whole answer content, as vLLM reads it.
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"city": "Oslo"}'
    assert Llama3JsonParser(TOOLS).parse(text) == (text, [])
    assert Llama3JsonParser(TOOLS).parse('{"answer": 4}') == ('{"answer": 4}', [])
    # Pythonic: positional arguments, text after the list, or not a list of calls.
    for text in ('[get_weather("Paris")]', '[get_time()] and more', "[1, 2]", "[get_time(]"):
        assert PythonicParser(TOOLS).parse(text) == (text, []), text
    # Qwen3-Coder: a value that does not read as its type stays a string; no function, no call.
    _, calls = Qwen3CoderParser(TOOLS).parse("<function=get_forecast>\n<parameter=days>\nthree\n</parameter>\n"
                                             "<parameter=other>\n7\n</parameter>\n</function>")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_forecast", {"days": "three", "other": "7"})]
    assert Qwen3CoderParser(TOOLS).parse("<tool_call>\n</tool_call>") == ("<tool_call>\n</tool_call>", [])
    # Mistral: a marker with nothing after it.
    assert MistralParser(TOOLS).parse("Sure.[TOOL_CALLS]") == ("Sure.[TOOL_CALLS]", [])


def test_streams_hold_back_what_may_start_a_call():
    assert MistralParser(TOOLS).content_end("Sure.[TOOL_") == len("Sure.")
    assert Qwen3CoderParser(TOOLS).content_end("Sure.\n<func") == len("Sure.\n")
    assert Qwen3CoderParser(TOOLS).content_end("Sure.\n<tool") == len("Sure.\n")
    assert Llama3JsonParser(TOOLS).content_end("  <|python") == 0  # may be the tag before a call
    assert Llama3JsonParser(TOOLS).content_end("  Hello") == len("  Hello")
    assert PythonicParser(TOOLS).content_end("\n") == 0 and PythonicParser(TOOLS).content_end("[get") == 0


def test_qwen3_coder_streams_each_value_once_its_parameter_closes():
    text = ANSWERS[-1][1]
    stream = ToolCallStream(Qwen3CoderParser(TOOLS))
    sent = []
    for end in range(1, len(text) + 1):
        sent += [p.arguments for p in stream.update(text[:end], finished=end == len(text))]
    assert sent == ["", "{", '"city": "Paris"', ', "days": 3', ', "metric": true', ', "hours": [6, 18]', "}"]


def test_pythonic_streams_a_calls_arguments_once_it_closes():
    text = '[get_weather(city="Par)is"), get_time()]'
    stream = ToolCallStream(PythonicParser(TOOLS))
    pieces = [stream.update(text[:end], finished=False) for end in range(1, len(text))]
    firsts = [i for i, p in enumerate(pieces) if p]
    assert [(p.name, p.arguments) for p in pieces[firsts[0]]] == [("get_weather", "")]
    assert text[:firsts[0] + 1].endswith("get_weather(")  # the name as soon as its parenthesis opens
    assert [p.arguments for p in pieces[firsts[1]]] == ['{"city": "Par)is"}']
    assert text[:firsts[1] + 1].endswith('")')  # the arguments when the call closes


def test_a_named_tool_choice_is_a_call_even_cut_short():
    """vLLM wraps a named function's output as its call whatever it holds."""
    cut = '{"city": "Par'
    assert [(c.name, c.arguments) for c in NamedParser(TOOLS, "get_weather").parse(cut)[1]] == [("get_weather", cut)]
    assert forced_calls(cut, {"type": "function", "function": {"name": "get_weather"}})[0].arguments == cut
    assert added_up(stream_pieces(cut, NamedParser(TOOLS, "get_weather"))) == [("get_weather", cut)]


# --- each parser on a real answer -----------------------------------------------------------------

# The answer the embedded model is made to write (a grammar of one choice) on a node started with its parser.
SCRIPTS = {"hermes": ANSWERS[0], "llama3_json": ANSWERS[1], "mistral": ANSWERS[4], "pythonic": ANSWERS[5],
           "qwen3_coder": ANSWERS[6]}
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module", params=list(SCRIPTS))
def parser_node(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A colocated node with one --tool-call-parser at a time (the module's tests run per parser)."""
    node = start_node("both", tmp_path_factory.mktemp(f"parser-{request.param}"),
                      extra_args=["--enable-auto-tool-choice", "--tool-call-parser", request.param,
                                  "--disable-log-requests"])
    yield request.param, node
    node.kill()


def sdk(node: Node) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_each_parser_reads_a_real_answer_streamed_and_not(parser_node):
    """vLLM's shape through the openai SDK: the answer not streamed has the calls and the content of
    the script; the stream's deltas, added up by the SDK, are the same calls."""
    name, node = parser_node
    _, script, content, calls = SCRIPTS[name]
    client = sdk(node)
    body = dict(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=TOOLS, max_tokens=160, temperature=0, extra_body={"structured_outputs": {"choice": [script]}})
    answer = client.chat.completions.create(**body).choices[0]
    assert answer.finish_reason == "tool_calls"
    assert answer.message.content == content
    assert [(c.function.name, c.function.arguments) for c in answer.message.tool_calls] == calls
    with client.chat.completions.stream(**body) as stream:
        chunks = [event.chunk.choices[0] for event in stream if event.type == "chunk" and event.chunk.choices]
        final = stream.get_final_completion().choices[0]
    assert chunks[-1].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == calls
    assert [c.id for c in final.message.tool_calls] != [c.id for c in answer.message.tool_calls]  # fresh ids
    assert (final.message.content or "").strip() == (content or "").strip()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_each_parser_gives_function_call_items_in_the_responses_api(parser_node):
    """The Responses API on the same answer: a message for the content, a function_call item per call;
    streamed, the items' events add up to the same items."""
    name, node = parser_node
    _, script, content, calls = SCRIPTS[name]
    client = sdk(node)
    body = dict(model=client.models.list().data[0].id, input="Weather in Paris?", tools=RESPONSES_TOOLS,
                max_output_tokens=160, temperature=0, extra_body={"structured_outputs": {"choice": [script]}})
    response = client.responses.create(**body)
    assert response.status == "completed"
    assert [o.type for o in response.output] == ["message"] * bool(content) + ["function_call"] * len(calls)
    functions = [o for o in response.output if o.type == "function_call"]
    assert [(f.name, f.arguments) for f in functions] == calls
    assert all(f.call_id.startswith("call_") and f.id.startswith("fc_") for f in functions)
    events = list(client.responses.create(**body, stream=True))
    done = events[-1].response
    assert events[-1].type == "response.completed"
    assert [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in done.output] == [
        (o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in response.output]
    for index, item in enumerate(done.output):
        if item.type == "function_call":
            pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                      and e.output_index == index]
            assert "".join(pieces) == item.arguments


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_parallel_tool_calls_false_keeps_the_first_call(parser_node):
    name, node = parser_node
    _, script, _, calls = SCRIPTS[name]
    if len(calls) < 2:
        pytest.skip("this parser's script has one call")
    client = sdk(node)
    body = dict(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=TOOLS, max_tokens=160, temperature=0, parallel_tool_calls=False,
                extra_body={"structured_outputs": {"choice": [script]}})
    answer = client.chat.completions.create(**body).choices[0]
    assert [(c.function.name, c.function.arguments) for c in answer.message.tool_calls] == calls[:1]
    with client.chat.completions.stream(**body) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == calls[:1]
