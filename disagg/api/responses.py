"""The Responses API (/v1/responses, GET /v1/responses/{id}) as vLLM serves it, built on chat.

A request becomes a chat request (ResponsesRequest.to_chat): `instructions` a system message, the
conversation of `previous_response_id` (its input and output, without its instructions, as OpenAI
carries it over), then `input`: a string (one user message) or a list of messages and items, a
`function_call` item becoming an assistant message's tool call and a `function_call_output` a tool
message; function tools become chat tools. The chat path serves it (the same template, engine
request, tool-call and reasoning parsers), and ResponsesFormat turns chat's answer into OpenAI's
response object: output items (a `reasoning` item, a `message` with its `output_text`, a
`function_call` per call), `usage` in input and output tokens, `status` "incomplete" when
max_output_tokens cut it short. Streamed, the same items come as OpenAI's events (created,
in_progress, then per item output_item.added ... done, then completed), each with its
sequence_number, and no [DONE] after the last.

Responses are kept in memory (ResponseStore: the most recent, up to a count and a size), unless
`store` is false, for previous_response_id and GET; an id not kept (unknown, not stored, or pushed
out) is a 404.
"""

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from disagg.api.protocol import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    ChatCompletionRequest,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    OpenAIRequest,
    StructuredOutputs,
)
from disagg.engine.sampling_params import SamplingParamError

if TYPE_CHECKING:
    from disagg.api.app import ChatFormat, Choice, Run

# Responses kept for previous_response_id and GET: the least recently used go first past either bound.
STORE_MAX_RESPONSES = 1024
STORE_MAX_BYTES = 64 * 2**20  # of their JSON, the conversation included
# The chat request's fields that a 400 names as the Responses API calls them.
RESPONSES_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                    "max_tokens": "max_output_tokens", "response_format": "text.format"}


# -- the request --------------------------------------------------------------------------------


class InputText(OpenAIRequest):
    type: Literal["input_text", "output_text", "text"]  # output_text: an earlier answer sent back
    text: str


class InputMessage(OpenAIRequest):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]


class FunctionCallItem(OpenAIRequest):
    """A call the model made (from an earlier response's output), sent back with the conversation."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(OpenAIRequest):
    """The result of a call, for the model's next turn."""
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


class ReasoningInputItem(OpenAIRequest):
    """An earlier response's reasoning sent back: chat templates leave it out, so it is dropped."""
    type: Literal["reasoning"]


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningInputItem


class FunctionTool(OpenAIRequest):
    type: Literal["function"]  # the hosted tools (web_search, file_search, mcp, ...) are not built
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedToolChoice(OpenAIRequest):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIRequest):
    format: TextFormat | None = None


class ResponsesRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice = "auto"
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    text: TextConfig | None = None
    metadata: dict | None = None
    user: str | None = None
    reasoning: dict | None = None  # accepted: how much a model reasons is its template's and its own
    truncation: Literal["disabled", "auto"] | None = None  # either way a prompt too long is a 400
    background: bool = False
    # vLLM's sampling fields beyond OpenAI's, passed to the chat request as they are
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    prefill_policy: Literal["recompute", "fail"] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools: object) -> object:
        hosted = [t.get("type") for t in tools if isinstance(t, dict) and t.get("type") != "function"] \
            if isinstance(tools, list) else []
        if hosted:
            raise ValueError(f"only function tools are supported by this server, got {hosted}: the hosted tools "
                             "(web_search, file_search, mcp, ...) are not built")
        return tools

    @model_validator(mode="before")
    @classmethod
    def _bounded_input(cls, body: object) -> object:
        """Counted before validation, whose cost grows with them (as check_request_size counts chat's)."""
        items = body.get("input") if isinstance(body, dict) else None
        if isinstance(items, list):
            if len(items) > MAX_MESSAGES:
                raise ValueError(f"input: at most {MAX_MESSAGES} items a request, got {len(items)}")
            parts = sum(len(i["content"]) for i in items if isinstance(i, dict) and isinstance(i.get("content"), list))
            if parts > MAX_CONTENT_PARTS:
                raise ValueError(f"input: at most {MAX_CONTENT_PARTS} content parts a request, got {parts}")
        return body

    def to_chat(self, conversation: list[ChatMessage]) -> ChatCompletionRequest:
        """The chat request that serves this one, after the conversation of previous_response_id.
        Raises SamplingParamError or pydantic's ValidationError (a 400 naming the chat field)."""
        if self.background:
            raise SamplingParamError("background", "background responses are not supported by this server; "
                                                   "leave background out")
        messages = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        messages += conversation + self.input_messages()
        if len(messages) > MAX_MESSAGES:
            raise SamplingParamError("input", f"at most {MAX_MESSAGES} messages with the previous responses', got "
                                              f"{len(messages)}")
        tool_choice = self.tool_choice
        if isinstance(tool_choice, NamedToolChoice):
            tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
        chat = ChatCompletionRequest(
            model=self.model, messages=messages, max_completion_tokens=self.max_output_tokens,
            tools=[{"type": "function", "function": t.model_dump(include={"name", "description", "parameters"},
                                                                  exclude_none=True)} for t in self.tools] or None,
            # Without tools the default "auto" asks for nothing; "required" or a name is refused as in chat.
            tool_choice=None if not self.tools and tool_choice == "auto" else tool_choice,
            parallel_tool_calls=self.parallel_tool_calls, stream=self.stream, response_format=self.response_format(),
            **self.model_dump(include=PASSED_FIELDS, exclude_none=True, by_alias=True))
        return chat

    def input_messages(self) -> list[ChatMessage]:
        """The input as chat messages: consecutive function calls are one assistant message's calls."""
        if isinstance(self.input, str):
            return [ChatMessage(role="user", content=self.input)]
        messages: list[ChatMessage] = []
        for item in self.input:
            if isinstance(item, InputMessage):
                messages.append(ChatMessage(role=item.role, content=text_of(item.content)))
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1].role == "assistant" and messages[-1].tool_calls:
                    messages[-1].tool_calls.append(call)
                else:
                    messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(ChatMessage(role="tool", content=text_of(item.output), tool_call_id=item.call_id))
        return messages

    def response_format(self) -> dict | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type != "json_schema":
            return None if fmt is None else {"type": fmt.type}
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}


# Fields the chat request takes under the same names.
PASSED_FIELDS = {"temperature", "top_p", "user", "top_k", "min_p", "seed", "stop", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "ignore_eos",
                 "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "prefill_policy"}


def text_of(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


# -- the response -------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)
    logprobs: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")
    summary: list = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class FunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: f"fc_{uuid.uuid4().hex}")
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = ReasoningItem | OutputMessage | FunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # not counted apart: the reasoning's tokens are among output_tokens


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """OpenAI's response object."""
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict | None
    store: bool
    temperature: float | None
    text: dict
    tool_choice: str | dict
    tools: list[dict]
    top_p: float | None
    truncation: str
    usage: ResponseUsage | None
    user: str | None
    metadata: dict


class StreamEvent(BaseModel):
    """One event of a streamed response: its type, its place in the stream, and its own fields."""
    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int = 0


@dataclass
class StoredResponse:
    response: ResponseObject
    conversation: list[ChatMessage]  # what previous_response_id continues: input and output, no instructions
    size: int  # bytes of JSON


class ResponseStore:
    """The responses kept, most recently used last; the least recently used go first past either bound."""

    def __init__(self, max_responses: int = STORE_MAX_RESPONSES, max_bytes: int = STORE_MAX_BYTES):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def put(self, response: ResponseObject, conversation: list[ChatMessage]) -> None:
        size = len(response.model_dump_json()) + sum(len(m.model_dump_json()) for m in conversation)
        if size > self.max_bytes:
            return  # it alone is over the bound: not kept
        self.entries[response.id] = StoredResponse(response, conversation, size)
        self.bytes += size
        while len(self.entries) > self.max_responses or self.bytes > self.max_bytes:
            _, dropped = self.entries.popitem(last=False)
            self.bytes -= dropped.size

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self.entries.get(response_id)
        if stored is not None:
            self.entries.move_to_end(response_id)
        return stored


class ResponsesFormat:
    """/v1/responses: chat's answer (ChatFormat's deltas, or its message) as OpenAI's response object
    and events. One choice: the Responses API has no n."""

    def __init__(self, request: ResponsesRequest, chat_request: ChatCompletionRequest, chat: "ChatFormat",
                 store: ResponseStore):
        self.request = request
        self.chat_request = chat_request
        self.chat = chat
        self.store = store
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.items: list[OutputItem] = []  # streamed: those started so far, the last one open until the next
        self.open = False  # the last item still takes deltas
        self.num_events = 0  # the next event's sequence_number
        self.num_output_tokens = chat.num_output_tokens

    def first(self, choice: "Choice") -> list[StreamEvent]:
        self.chat.first(choice)
        snapshot = self.response_object(choice, "in_progress").model_dump()
        return [StreamEvent(type="response.created", response=snapshot),
                StreamEvent(type="response.in_progress", response=snapshot)]

    def delta(self, choice: "Choice") -> list[StreamEvent]:
        events = []
        for part in self.chat.delta(choice):
            events += self.delta_events(part)
        if choice.out.finished:
            events += self.close_item()
            response = self.keep(choice, self.items)
            events.append(StreamEvent(type=f"response.{response.status}", response=response.model_dump()))
        return events

    def delta_events(self, part: ChatStreamChoice) -> list[StreamEvent]:
        """A chat delta's reasoning, content and call pieces as events of the items they belong to."""
        delta, events = part.delta, []
        if delta.reasoning:
            if not (self.open and isinstance(self.items[-1], ReasoningItem)):
                events += self.add_item(ReasoningItem(status="in_progress", content=[]))
                events.append(self.item_event("response.content_part.added", content_index=0,
                                              part=ReasoningText(text="").model_dump()))
                self.items[-1].content.append(ReasoningText(text=""))
            self.items[-1].content[0].text += delta.reasoning
            events.append(self.item_event("response.reasoning_text.delta", content_index=0, delta=delta.reasoning))
        if delta.content:
            if not (self.open and isinstance(self.items[-1], OutputMessage)):
                events += self.add_item(OutputMessage(status="in_progress"))
                events.append(self.item_event("response.content_part.added", content_index=0,
                                              part=OutputText(text="").model_dump()))
                self.items[-1].content.append(OutputText(text=""))
            self.items[-1].content[0].text += delta.content
            events.append(self.item_event("response.output_text.delta", content_index=0, delta=delta.content,
                                          logprobs=[]))
        for piece in delta.tool_calls or []:
            if piece.id is not None:  # a call's first piece
                events += self.add_item(FunctionCall(call_id=piece.id, name=piece.function.name, arguments="",
                                                     status="in_progress"))
            else:
                self.items[-1].arguments += piece.function.arguments
                events.append(self.item_event("response.function_call_arguments.delta",
                                              delta=piece.function.arguments))
        return events

    def add_item(self, item: OutputItem) -> list[StreamEvent]:
        events = self.close_item()
        self.items.append(item)
        self.open = True
        return events + [StreamEvent(type="response.output_item.added", output_index=len(self.items) - 1,
                                     item=item.model_dump())]

    def item_event(self, kind: str, **fields) -> StreamEvent:
        """An event about the last item."""
        return StreamEvent(type=kind, item_id=self.items[-1].id, output_index=len(self.items) - 1, **fields)

    def close_item(self) -> list[StreamEvent]:
        if not self.open:
            return []
        self.open = False
        item = self.items[-1]
        item.status = "completed"
        if isinstance(item, ReasoningItem):
            text = item.content[0]
            events = [self.item_event("response.reasoning_text.done", content_index=0, text=text.text),
                      self.item_event("response.content_part.done", content_index=0, part=text.model_dump())]
        elif isinstance(item, OutputMessage):
            text = item.content[0]
            events = [self.item_event("response.output_text.done", content_index=0, text=text.text, logprobs=[]),
                      self.item_event("response.content_part.done", content_index=0, part=text.model_dump())]
        else:
            events = [self.item_event("response.function_call_arguments.done", name=item.name,
                                      arguments=item.arguments)]
        return events + [StreamEvent(type="response.output_item.done", output_index=len(self.items) - 1,
                                     item=item.model_dump())]

    def chunk(self, run: "Run", parts: list[StreamEvent], usage_info: object = None, prompt: object = None) -> str:
        """One event, as OpenAI and vLLM send it: its type as the SSE event name, then its JSON (a
        response's events carry neither the usage chunk's fields nor the prompt's token ids)."""
        lines = []
        for event in parts:
            event.sequence_number = self.num_events
            self.num_events += 1
            lines.append(f"event: {event.type}\ndata: {event.model_dump_json()}\n\n")
        return "".join(lines)

    def response(self, run: "Run") -> ResponseObject:
        """The answer not streamed: its items in the order a stream sends them."""
        choice = run.choices[0]
        message, _ = self.chat.message(choice.out)
        return self.keep(choice, output_items(message))

    def keep(self, choice: "Choice", items: list[OutputItem]) -> ResponseObject:
        """The finished response, kept (unless store is false) with the conversation it continues."""
        response = self.response_object(choice, "incomplete" if choice.out.finish_reason == "length" else "completed")
        response.output = items
        if self.request.store:
            messages = self.chat_request.messages
            if self.request.instructions is not None:
                messages = messages[1:]  # the next turn gets its own instructions
            self.store.put(response, messages + [assistant_message(items)])
        return response

    def response_object(self, choice: "Choice", status: str) -> ResponseObject:
        request, out = self.request, choice.out
        usage = None
        if status != "in_progress":
            prompt_tokens = len(choice.prompt.token_ids)
            usage = ResponseUsage(input_tokens=prompt_tokens,
                                  input_tokens_details=InputTokensDetails(cached_tokens=out.num_cached_tokens),
                                  output_tokens=len(out.token_ids), total_tokens=prompt_tokens + len(out.token_ids))
        text_format = request.text.format if request.text is not None and request.text.format is not None else None
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=request.instructions, max_output_tokens=request.max_output_tokens, model=self.chat.model,
            output=[], parallel_tool_calls=request.parallel_tool_calls,
            previous_response_id=request.previous_response_id, reasoning=request.reasoning, store=request.store,
            temperature=request.temperature, top_p=request.top_p,
            text={"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                  else {"type": "text"}},
            tool_choice=request.tool_choice if isinstance(request.tool_choice, str)
            else request.tool_choice.model_dump(),
            tools=[t.model_dump(exclude_none=True) for t in request.tools], truncation=request.truncation or "disabled",
            usage=usage, user=request.user, metadata=request.metadata or {})


def output_items(message: ChatResponseMessage) -> list[OutputItem]:
    """A chat message as output items: its reasoning, its content, its calls (empty ones left out, as a
    stream sends none for them)."""
    items: list[OutputItem] = []
    if message.reasoning:
        items.append(ReasoningItem(content=[ReasoningText(text=message.reasoning)]))
    if message.content:
        items.append(OutputMessage(content=[OutputText(text=message.content)]))
    items += [FunctionCall(call_id=c.id, name=c.function.name, arguments=c.function.arguments)
              for c in message.tool_calls]
    return items


def assistant_message(items: list[OutputItem]) -> ChatMessage:
    """A response's output as the chat message that the next turn's template sees."""
    text = "".join(part.text for item in items if isinstance(item, OutputMessage) for part in item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in items if isinstance(item, FunctionCall)]
    return ChatMessage(role="assistant", content=text if text or not calls else None, tool_calls=calls or None)
