"""The tool-call parsers (hermes, llama3_json, mistral, pythonic, qwen3_coder) and the forced-call
schema, on strings (no model needed); and each parser on a real answer that a grammar makes the
embedded model write, streamed and not, through a node started with that parser."""

import json

import pytest

from disagg.api.protocol import DeltaFunctionCall, DeltaToolCall
from disagg.api.tool_calls import (
    CallDelta,
    HermesParser,
    NamedParser,
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
