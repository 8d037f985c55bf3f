"""Tool calls in chat (docs/ARCHITECTURE.md, "Tool calls"): the parsers of --tool-call-parser that
read calls out of what the model writes for tool_choice "auto" (hermes, llama3_json, mistral,
pythonic, qwen3_coder, as vLLM's of those names), and the JSON schema that tool_choice "required" or
a named function constrains the output to (through structured output), read back as calls.

As vLLM does: a named function's output is its arguments object, and always a call (even one that
max_tokens cut short); "required" outputs a JSON array of {"name", "parameters"} objects, one per
call (at most one when parallel_tool_calls is false, which also keeps only the first call "auto"
reads).

Each format is a ToolParser: where the content before calls ends, the texts that hold calls, and
how one such text reads as a call, whole (`read`) or as far as it is written (`head`). The answer
not streamed (`parse`) and the streamed one (`ToolCallStream`) read the same texts the same way, so
that the streamed pieces add up to the calls of the answer not streamed. Where the model writes a
call's arguments as a JSON object (hermes, llama3_json, mistral), `arguments` is that text as
written, sent as it grows; where it writes them otherwise (pythonic, qwen3_coder: as vLLM, the JSON
of the values read), the arguments are sent as each complete value (qwen3_coder) or call (pythonic)
is read.
"""

import ast
import json
import re
import uuid
from dataclasses import dataclass, field

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# An unclosed last call (the output ended inside it) is read as well, as vLLM's hermes parser does.
TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
# A call written name first, as models and the forced schema write it, up to where its arguments
# object opens: {"name": "get_weather", "arguments": {
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
# What matters to find where a JSON value ends: strings (whole, or open at the end) and brackets.
JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|[][{}]')
# What matters to find where a Python call ends: strings (whole, or open at the end) and brackets.
PYTHON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?\Z)|\'(?:[^\'\\]|\\.)*(?:\'|\\?\Z)|[][(){}]')
PYTHON_CALL_HEAD = re.compile(r"\s*([A-Za-z_]\w*)\s*\(")
SEPARATORS = " \t\r\n,"  # between the calls of a Python list
PYTHON_TAG = "<|python_tag|>"  # Llama 3's token before a call (gone from the text when special tokens are skipped)
MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_NAME = re.compile(r"\s*([^\s{}\[\]\"']+)\s*(?:\[ARGS\])?\s*(?=\{)")
QWEN_FUNCTION = "<function="
QWEN_FUNCTION_END = "</function>"
QWEN_PARAMETER = re.compile(r"<parameter=([^>]*)>(.*?)(</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ToolOptions:
    """vLLM's flags over how the model's text is read: tool_choice "auto" (what a request with tools
    asks by default) needs both --enable-auto-tool-choice and --tool-call-parser; --reasoning-parser
    splits the reasoning off the answer (disagg/api/reasoning.py)."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # one of TOOL_CALL_PARSERS
    reasoning_parser: str | None = None  # one of reasoning.REASONING_PARSERS

    def check_auto(self) -> None:
        if not (self.enable_auto_tool_choice and self.tool_call_parser):
            raise ValueError('"auto" tool choice (the default when tools are sent) requires the server flags '
                             "--enable-auto-tool-choice and --tool-call-parser; send tool_choice \"none\", "
                             "\"required\" or a named function, or restart the server with them")


# -- the pieces the parsers share ---------------------------------------------------------------


def without_partial(text: str, marker: str) -> int:
    """The end of the text less a tail that may be the start of the marker."""
    for length in range(len(marker) - 1, 0, -1):
        if text.endswith(marker[:length]):
            return len(text) - length
    return len(text)


def hermes_call(body: str) -> ToolCall | None:
    """The call a {"name", "arguments"} object (a "required" answer's item, or Llama's: "parameters") holds."""
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
    """The objects of a JSON array of objects (or of objects one after another) being written: each
    one's text and whether it has closed."""
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
    """The calls in an output constrained by forced_schema. A named function's output is its call
    whatever it holds (vLLM's, even cut short by max_tokens); a "required" one that does not parse
    (cut short) has none, and the text stays the content."""
    name = named_function(tool_choice)
    if name is not None:
        return [ToolCall(name, text)]
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if not isinstance(value, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in value):
        return []  # the grammar makes this shape; anything else is not a call
    return [hermes_call(item) for item, _ in array_items(text)]


# -- the formats ------------------------------------------------------------------------------


class ToolParser:
    """One format of calls in an answer. `texts` are the texts that may each hold a call (and whether
    each has closed); `head` reads one as far as it is written (None until its name is), `read` reads
    it whole (None: no call). The arguments `head` gives grow, and lead to those `read` gives."""

    keeps_special_tokens = False  # the format's markers are special tokens, which the text must keep

    def __init__(self, tools: list[dict], max_calls: int | None = None):
        self.tools = tools
        self.max_calls = max_calls  # 1 when parallel_tool_calls is false

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the content, the calls) of a finished answer; without calls the content is the text."""
        content, calls = self.parse_all(text)
        return content, calls[:self.max_calls]

    def parse_all(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How much of a growing answer can go out as content while it is written."""
        raise NotImplementedError

    def stream_content(self, text: str) -> str:
        """The content a stream sends in all, once the answer is finished (what went out while it was
        written is its start)."""
        return self.parse(text)[0] or ""

    def texts(self, text: str, finished: bool) -> list[tuple[str, bool]]:
        raise NotImplementedError

    def head(self, body: str) -> ToolCall | None:
        raise NotImplementedError

    def read(self, body: str) -> ToolCall | None:
        raise NotImplementedError


class HermesParser(ToolParser):
    """Hermes and Qwen 2.5: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, anywhere in the
    text; the content is the text with the calls taken out. A block whose body is not a JSON object
    with a name is no call: it stays in the content."""

    def parse_all(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return parse_hermes(text)

    def content_end(self, text: str) -> int:
        return streamable_end(text)

    def stream_content(self, text: str) -> str:
        rest, calls = remove_hermes_calls(text)
        return rest.rstrip() if calls[:self.max_calls] else rest

    def texts(self, text: str, finished: bool) -> list[tuple[str, bool]]:
        # An open call's text less an end that may be the start of </tool_call>.
        return [(body if closed or finished else body[:without_partial(body, TOOL_CALL_END)], bool(closed))
                for body, closed in TOOL_CALL.findall(text)]

    def head(self, body: str) -> ToolCall | None:
        return call_head(body)

    def read(self, body: str) -> ToolCall | None:
        return hermes_call(body)


class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3 and 4: an answer that opens with a JSON object (after <|python_tag|>, if the text
    keeps it) is calls, {"name": ..., "parameters" (or "arguments"): {...}}, several separated by
    ";", and has no content; any other answer is content. One object that is not a call makes the
    whole answer content, as vLLM reads it. (vLLM's parser not streamed also finds calls after text;
    its streamed one only at the start, which both do here.)"""

    def calls_start(self, text: str) -> int | None:
        """Where the calls start; -1 for an answer of content; None while that is not yet known."""
        rest = text.lstrip()
        if rest.startswith(PYTHON_TAG):
            rest = rest[len(PYTHON_TAG):].lstrip()
        elif PYTHON_TAG.startswith(rest):
            return None
        if not rest:
            return None
        return len(text) - len(rest) if rest.startswith("{") else -1

    def parse_all(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = self.calls_start(text)
        if start is None or start == -1:
            return text, []
        items = array_items(text[start:])
        calls = [hermes_call(body) for body, closed in items if closed]
        if not calls or len(calls) < len(items) or None in calls:
            return text, []
        return None, calls

    def content_end(self, text: str) -> int:
        return len(text) if self.calls_start(text) == -1 else 0

    def texts(self, text: str, finished: bool) -> list[tuple[str, bool]]:
        start = self.calls_start(text)
        return [] if start is None or start == -1 else array_items(text[start:])

    def head(self, body: str) -> ToolCall | None:
        return call_head(body)

    def read(self, body: str) -> ToolCall | None:
        return hermes_call(body)


class MistralParser(ToolParser):
    """Mistral: content, then [TOOL_CALLS] and the calls: a JSON array of {"name", "arguments"} objects
    (tokenizers before v11), or name{arguments} (name[ARGS]{arguments} in Hugging Face's text) after
    each [TOOL_CALLS] (v11 on), arguments kept as written even when malformed, as vLLM does. The
    marker is a special token, so the text keeps special tokens (vLLM's skip_special_tokens=False)."""

    keeps_special_tokens = True

    def parse_all(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = text.find(MISTRAL_CALLS)
        calls = [call for body, _ in self.texts(text, True) if (call := self.read(body)) is not None]
        if start == -1 or not calls:
            return text, []
        return text[:start] or None, calls

    def content_end(self, text: str) -> int:
        start = text.find(MISTRAL_CALLS)
        return start if start != -1 else without_partial(text, MISTRAL_CALLS)

    def texts(self, text: str, finished: bool) -> list[tuple[str, bool]]:
        start = text.find(MISTRAL_CALLS)
        if start == -1:
            return []
        calls = text[start + len(MISTRAL_CALLS):]
        if calls.lstrip().startswith("["):
            return array_items(calls)
        pieces = calls.split(MISTRAL_CALLS)
        if not finished:  # the end may be the start of the next marker
            pieces[-1] = pieces[-1][:without_partial(pieces[-1], MISTRAL_CALLS)]
        texts = []
        for i, piece in enumerate(pieces):
            brace = piece.find("{")
            closed = i < len(pieces) - 1 or (brace != -1 and object_end(piece, brace) is not None)
            texts.append((piece, closed))
        return texts

    def head(self, body: str) -> ToolCall | None:
        if body.lstrip().startswith("{"):
            return call_head(body)
        name = MISTRAL_NAME.match(body)
        if name is None:
            return None
        return ToolCall(name.group(1), body[name.end():object_end(body, name.end())])

    def read(self, body: str) -> ToolCall | None:
        return hermes_call(body) if body.lstrip().startswith("{") else self.head(body)


class PythonicParser(ToolParser):
    """Llama 3.2 and 4, ToolACE: an answer that is a Python list of calls with keyword arguments,
    [get_weather(city="Paris"), get_time()], is calls, each call's arguments the JSON of its values
    (vLLM's); any other answer is content. A call's arguments go out once the call has closed."""

    def parse_all(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if not self.is_calls(text):
            return text, []
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError:
            return text, []
        calls = [python_call(node) for node in tree.elts] if isinstance(tree, ast.List) else []
        if not calls or None in calls:
            return text, []
        return None, calls

    @staticmethod
    def is_calls(text: str) -> bool | None:
        rest = text.lstrip()
        return rest.startswith("[") if rest else None

    def content_end(self, text: str) -> int:
        return len(text) if self.is_calls(text) is False else 0

    def texts(self, text: str, finished: bool) -> list[tuple[str, bool]]:
        if not self.is_calls(text):
            return []
        items, depth, start = [], 0, text.index("[") + 1
        for token in PYTHON_TOKEN.finditer(text, start):
            if token.group() in ("(", "[", "{"):
                depth += 1
            elif token.group() in (")", "]", "}"):
                if depth == 0:
                    return items  # the list has closed
                depth -= 1
                if depth == 0:  # a call has closed
                    items.append((text[start:token.end()].lstrip(SEPARATORS), True))
                    start = token.end()
        rest = text[start:].lstrip(SEPARATORS)
        return items + [(rest, False)] if rest else items

    def head(self, body: str) -> ToolCall | None:
        name = PYTHON_CALL_HEAD.match(body)
        return None if name is None else ToolCall(name.group(1), "")

    def read(self, body: str) -> ToolCall | None:
        try:
            return python_call(ast.parse(body.strip(), mode="eval").body)
        except SyntaxError:
            return None


def python_call(node: ast.expr) -> ToolCall | None:
    """name(key=value, ...) with literal values as a call; None for anything else (positional
    arguments included, which vLLM's pattern does not take either)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    try:
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        if len(arguments) < len(node.keywords):
            return None  # **kwargs
        return ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False))
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None


class Qwen3CoderParser(ToolParser):
    """Qwen3-Coder (and Qwen3.5): content, then calls as
    <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>, the
    <tool_call> wrapper optional (as vLLM's fallback); each value read by its type in the tool's
    parameters schema, the arguments their JSON. Streamed, "{" goes out with the name and each value
    as its </parameter> is written. Literal <function= or </parameter> inside a value is not told
    from the markup (vLLM's parser guesses there from what follows; this one does not)."""

    def parse_all(self, text: str) -> tuple[str | None, list[ToolCall]]:
        start = self.calls_start(text)
        calls = [call for body, _ in self.texts(text, True) if (call := self.read(body)) is not None]
        if start == -1 or not calls:
            return text, []
        return text[:start] or None, calls

    @staticmethod
    def calls_start(text: str) -> int:
        starts = [i for i in (text.find(TOOL_CALL_START), text.find(QWEN_FUNCTION)) if i != -1]
        return min(starts, default=-1)

    def content_end(self, text: str) -> int:
        start = self.calls_start(text)
        if start != -1:
            return start
        return min(without_partial(text, TOOL_CALL_START), without_partial(text, QWEN_FUNCTION))

    def texts(self, text: str, finished: bool) -> list[tuple[str, bool]]:
        bodies = text.split(QWEN_FUNCTION)[1:]
        texts = []
        for i, body in enumerate(bodies):
            end = body.find(QWEN_FUNCTION_END)
            if end != -1:
                texts.append((body[:end], True))
            else:
                texts.append((body, i < len(bodies) - 1))
        return texts

    def parameters(self, name: str, body: str, complete_only: bool) -> dict:
        properties = {}
        for tool in self.tools:
            if function_of(tool).get("name") == name:
                properties = parameters_schema(tool).get("properties") or {}
        values = {}
        for match in QWEN_PARAMETER.finditer(body):
            if complete_only and match.end() == len(body) and match.group(3) != "</parameter>":
                break  # its value may still grow
            value = match.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            values[match.group(1)] = typed_value(value, properties.get(match.group(1)))
        return values

    def head(self, body: str) -> ToolCall | None:
        name, bracket, rest = body.partition(">")
        if not bracket or not valid_function_name(name):
            return None
        values = self.parameters(name, rest, complete_only=True)
        return ToolCall(name, "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: "
                                              f"{json.dumps(v, ensure_ascii=False)}" for k, v in values.items()))

    def read(self, body: str) -> ToolCall | None:
        name, bracket, rest = body.partition(">")
        if not bracket or not valid_function_name(name):
            return None
        return ToolCall(name, json.dumps(self.parameters(name, rest, complete_only=False), ensure_ascii=False))


def valid_function_name(name: str) -> bool:
    """A name, not a stray template token or free text (vLLM's check)."""
    return bool(name) and not any(c in "{}<>\"' \t\n\r" for c in name)


def typed_value(value: str, schema: dict | None) -> object:
    """A qwen3_coder parameter's text as its schema's type says (vLLM's conversion); a string where
    the schema says nothing, or the text does not read as that type."""
    kind = str(schema.get("type", "string")).lower() if isinstance(schema, dict) else "string"
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if value.lower() in ("null", "none"):
        return None
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            return int(number) if number.is_integer() else number
    except ValueError:
        return value
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return value


class RequiredParser(ToolParser):
    """tool_choice "required": the JSON array of calls the grammar holds the output to."""

    def parse_all(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = forced_calls(text, "required")
        return (None, calls) if calls else (text, [])

    def content_end(self, text: str) -> int:
        return 0

    def texts(self, text: str, finished: bool) -> list[tuple[str, bool]]:
        return array_items(text)

    def head(self, body: str) -> ToolCall | None:
        return call_head(body)

    def read(self, body: str) -> ToolCall | None:
        return hermes_call(body)


class NamedParser(ToolParser):
    """A named function: the whole output is its arguments, and always its call."""

    def __init__(self, tools: list[dict], name: str):
        super().__init__(tools)
        self.name = name

    def parse_all(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return None, [ToolCall(self.name, text)]

    def content_end(self, text: str) -> int:
        return 0

    def texts(self, text: str, finished: bool) -> list[tuple[str, bool]]:
        return [(text, False)]  # it closes when the answer ends

    def head(self, body: str) -> ToolCall | None:
        return ToolCall(self.name, body) if body else None

    def read(self, body: str) -> ToolCall | None:
        return ToolCall(self.name, body)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser, "pythonic": PythonicParser,
    "qwen3_coder": Qwen3CoderParser,
}
TOOL_CALL_PARSERS = tuple(TOOL_PARSERS)


def tool_parser(tool_mode: str, tool_choice: str | dict | None, tools: list[dict] | None, parallel_tool_calls: bool,
                options: ToolOptions) -> ToolParser | None:
    """The parser of a chat request's answer: None when no calls can come out of it."""
    if tool_mode == "none":
        return None
    name = named_function(tool_choice)
    if name is not None:
        return NamedParser(tools, name)
    max_calls = None if parallel_tool_calls else 1
    if tool_mode == "forced":
        return RequiredParser(tools, max_calls)
    return TOOL_PARSERS[options.tool_call_parser](tools, max_calls)


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
    is written, then its arguments go out as they grow. A call's text is decided when it closes: one
    whose head never showed is read whole then, as the answer not streamed reads it (and is no call if
    it does not read). Once started, a call cannot be taken back: if its text turns out malformed, or
    max_tokens cuts it short, the stream has sent the call as far as it went, where the answer not
    streamed may have no call (vLLM streams the same way)."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.calls: list[ToolCall] = []  # those started, each with the arguments sent so far
        self.num_decided = 0  # call texts already read to their end
        self.started = False  # the first undecided text has a started call

    def update(self, text: str, finished: bool) -> list[CallDelta]:
        """The pieces to send for the answer so far."""
        deltas = []
        for body, closed in self.parser.texts(text, finished)[self.num_decided:]:
            if not self.started and self.parser.max_calls is not None and len(self.calls) >= self.parser.max_calls:
                break  # parallel_tool_calls false: the first call only
            final = closed or finished
            call = self.parser.read(body) if final else self.parser.head(body)
            if call is None and self.started:
                call = self.parser.head(body)  # malformed or cut short: sent as far as it went
            if call is None:
                self.num_decided += final
                continue
            if not self.started:
                self.calls.append(ToolCall(call.name, "", call.id))
                self.started = True
                deltas.append(CallDelta(len(self.calls) - 1, "", call.name, call.id))
            sent = self.calls[-1]
            if len(call.arguments) > len(sent.arguments) and call.arguments.startswith(sent.arguments):
                deltas.append(CallDelta(len(self.calls) - 1, call.arguments[len(sent.arguments):]))
                sent.arguments = call.arguments
            if final:
                self.num_decided += 1
                self.started = False
        return deltas
