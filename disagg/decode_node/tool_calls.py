"""Tool calls in chat (docs/ARCHITECTURE.md, "Tool calls"): the Hermes/Qwen `<tool_call>` parser
for tool_choice "auto", and the JSON schema that tool_choice "required" or a named function
constrains the output to (through structured output), read back as calls.

As vLLM does: a named function's output is its arguments object; "required" outputs a JSON array
of {"name", "parameters"} objects, one per call (at most one when parallel_tool_calls is false).
"""

import json
import re
import uuid
from dataclasses import dataclass, field

# An unclosed last call (the output ended inside it) is read as well, as vLLM's hermes parser does.
TOOL_CALL_START = "<tool_call>"
TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
TOOL_CALL_PARSERS = ("hermes",)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ToolOptions:
    """vLLM's flags: tool_choice "auto" (what a request with tools asks by default) needs both."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # one of TOOL_CALL_PARSERS

    def check_auto(self) -> None:
        if not (self.enable_auto_tool_choice and self.tool_call_parser):
            raise ValueError('"auto" tool choice (the default when tools are sent) requires the server flags '
                             "--enable-auto-tool-choice and --tool-call-parser; send tool_choice \"none\", "
                             "\"required\" or a named function, or restart the server with them")


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(the content, the calls). With calls, the content is what is left once they are taken out
    (None if nothing is); without, the text as it came. A <tool_call> block whose body is not a JSON
    object with a name is no call: it stays in the content."""
    rest, calls = remove_hermes_calls(text)
    if not calls:
        return text, []
    return rest.strip() or None, calls


def remove_hermes_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The text with each call taken out, and the calls."""
    calls, kept, end = [], [], 0
    for match in TOOL_CALL.finditer(text):
        call = hermes_call(match.group(1))
        if call is not None:
            kept.append(text[end:match.start()])
            end = match.end()
            calls.append(call)
    kept.append(text[end:])
    return "".join(kept), calls


def streamable_end(text: str) -> int:
    """How much of a growing answer can go out as content now: all of it up to a <tool_call>, less an
    end that may be the start of one."""
    start = text.find(TOOL_CALL_START)
    if start != -1:
        return start
    for length in range(len(TOOL_CALL_START) - 1, 0, -1):
        if text.endswith(TOOL_CALL_START[:length]):
            return len(text) - length
    return len(text)


def hermes_call(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(call["name"], arguments)


def function_of(tool: dict) -> dict:
    """A tool's {"name", "description", "parameters"}; empty when the client sent none."""
    function = tool.get("function")
    return function if isinstance(function, dict) else {}


def function_names(tools: list[dict]) -> list[str | None]:
    return [function_of(t).get("name") for t in tools]


def parameters_schema(tool: dict) -> dict:
    parameters = function_of(tool).get("parameters")
    return parameters if isinstance(parameters, dict) else {"type": "object"}


def named_function(tool_choice: str | dict | None) -> str | None:
    """The function a tool_choice object names ({"type": "function", "function": {"name": ...}})."""
    if isinstance(tool_choice, dict):
        name = function_of(tool_choice).get("name")
        return name if isinstance(name, str) else None
    return None


def forced_schema(tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool) -> dict:
    """The JSON schema the output must follow for tool_choice "required" or a named function."""
    name = named_function(tool_choice)
    if name is not None:
        return parameters_schema(tools[function_names(tools).index(name)])
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]},
                                               "parameters": parameters_schema(t)},
              "required": ["name", "parameters"]} for t, n in zip(tools, function_names(tools))]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def forced_calls(text: str, tool_choice: str | dict) -> list[ToolCall]:
    """The calls in an output constrained by forced_schema; none if it does not parse (it was cut
    short by max_tokens: the text then stays the content)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    name = named_function(tool_choice)
    if name is not None:
        return [ToolCall(name, json.dumps(value, ensure_ascii=False))]
    if not isinstance(value, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in value):
        return []  # the grammar makes this shape; anything else is not a call
    return [ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in value]
