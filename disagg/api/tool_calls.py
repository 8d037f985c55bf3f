"""Tool calls in chat (docs/ARCHITECTURE.md, "Tool calls"): the Hermes/Qwen `<tool_call>` parser
for tool_choice "auto", and the JSON schema that tool_choice "required" or a named function
constrains the output to (through structured output), read back as calls.

As vLLM does: a named function's output is its arguments object; "required" outputs a JSON array
of {"name", "parameters"} objects, one per call (at most one when parallel_tool_calls is false).

A call's `arguments` is the text the model wrote for them, not the object read and written again,
so that a streamed answer (`ToolCallStream`), which sends that text as it is written, adds up to
the same string as the answer not streamed.
"""

import json
import re
import uuid
from dataclasses import dataclass, field

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# An unclosed last call (the output ended inside it) is read as well, as vLLM's hermes parser does.
TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
TOOL_CALL_PARSERS = ("hermes",)
# A call written name first, as models and the forced schema write it, up to where its arguments
# object opens: {"name": "get_weather", "arguments": {
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
# What matters to find where a JSON value ends: strings (whole, or open at the end) and brackets.
JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|[][{}]')


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
    return start if start != -1 else without_partial(text, TOOL_CALL_START)


def without_partial(text: str, marker: str) -> int:
    """The end of the text less a tail that may be the start of the marker."""
    for length in range(len(marker) - 1, 0, -1):
        if text.endswith(marker[:length]):
            return len(text) - length
    return len(text)


def hermes_call(body: str) -> ToolCall | None:
    """The call a {"name", "arguments"} object (a "required" answer's item: "parameters") holds."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    head = call_head(body)
    if head is not None and head.name == call["name"]:
        return ToolCall(call["name"], head.arguments)  # as written
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(call["name"], arguments)


def call_head(body: str) -> ToolCall | None:
    """A call being written name first: its name and the text of its arguments object so far (all of
    it once the object has closed); None until the object opens, or for a call written otherwise."""
    head = CALL_HEAD.match(body)
    if head is None:
        return None
    return ToolCall(head.group(1), body[head.end():object_end(body, head.end())])


def object_end(text: str, start: int) -> int | None:
    """Where the JSON object or array that opens at text[start] ends (just past its bracket); None
    while it is still open."""
    depth = 0
    for token in JSON_TOKEN.finditer(text, start):
        if token.group() in ("{", "["):
            depth += 1
        elif token.group() in ("}", "]"):
            depth -= 1
            if depth == 0:
                return token.end()
    return None


def array_items(text: str) -> list[tuple[str, bool]]:
    """The objects of a JSON array of objects being written: each one's text and whether it has closed."""
    items, start = [], text.find("{")
    while start != -1:
        end = object_end(text, start)
        if end is None:
            return items + [(text[start:], False)]
        items.append((text[start:end], True))
        start = text.find("{", end)
    return items


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
        return [ToolCall(name, text)]
    if not isinstance(value, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in value):
        return []  # the grammar makes this shape; anything else is not a call
    return [hermes_call(item) for item, _ in array_items(text)]



@dataclass
class CallDelta:
    """A piece of a streamed call, in vLLM's shape: a call's first piece has its id and name (and
    arguments ""), the pieces after it the next part of its arguments text."""
    index: int  # of the call in the answer
    arguments: str
    name: str | None = None
    id: str | None = None


class ToolCallStream:
    """One streamed choice's tool calls, sent as the model writes them: a call starts once its name
    is written, then its arguments go out as they grow. A call's text ("auto": a <tool_call> body;
    "required": an item of the array; a named function: the whole answer) is decided when it closes:
    one that never showed a name-first head is read whole then, as the answer not streamed reads it
    (and is no call if it does not parse). Once started, a call cannot be taken back: if its text
    turns out malformed, or max_tokens cuts it short, the stream has sent the call as far as it went,
    where the answer not streamed has no call (vLLM streams the same way)."""

    def __init__(self, tool_mode: str, tool_choice: str | dict):
        self.hermes = tool_mode == "auto"
        self.tool_choice = tool_choice
        self.name = named_function(tool_choice)  # forced: the named function's, or None for "required"
        self.calls: list[ToolCall] = []  # those started, each with the arguments sent so far
        self.num_decided = 0  # call texts already read to their end
        self.started = False  # the first undecided text has a started call

    def update(self, text: str, finished: bool) -> list[CallDelta]:
        """The pieces to send for the answer so far."""
        deltas = []
        for body, closed in self.texts(text, finished)[self.num_decided:]:
            final = closed or finished
            if self.started:
                arguments = self.head(body).arguments
            else:
                call = self.read(body) if final else self.head(body)
                if call is None:
                    self.num_decided += final
                    continue
                self.calls.append(ToolCall(call.name, "", call.id))
                self.started = True
                deltas.append(CallDelta(len(self.calls) - 1, "", call.name, call.id))
                arguments = call.arguments
            sent = self.calls[-1]
            if len(arguments) > len(sent.arguments):
                deltas.append(CallDelta(len(self.calls) - 1, arguments[len(sent.arguments):]))
                sent.arguments = arguments
            if final:
                self.num_decided += 1
                self.started = False
        return deltas

    def texts(self, text: str, finished: bool) -> list[tuple[str, bool]]:
        """The texts that each hold a call, and whether each has closed."""
        if self.hermes:  # an open call's text less an end that may be the start of </tool_call>
            return [(body if closed or finished else body[:without_partial(body, TOOL_CALL_END)], bool(closed))
                    for body, closed in TOOL_CALL.findall(text)]
        if self.name is not None:
            return [(text, False)]  # closes when the answer ends
        return array_items(text)

    def head(self, body: str) -> ToolCall | None:
        if self.name is not None:
            return ToolCall(self.name, body) if body else None
        return call_head(body)

    def read(self, body: str) -> ToolCall | None:
        if self.name is not None:
            calls = forced_calls(body, self.tool_choice)
            return calls[0] if calls else None
        return hermes_call(body)
