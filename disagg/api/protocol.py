"""The OpenAI API as vLLM serves it: request and response models for completions, chat, models
and tokenize.

As vLLM does, a field this server does not know is accepted and ignored, with one warning log per
field name; a field it knows but cannot honour (beam search, structured output, ...) is refused
with a 400 naming it unless it holds its neutral value. Sampling fields left out (or null) take
SamplingParams' defaults. Structured output comes in four spellings (OpenAI's response_format,
vLLM's structured_outputs, vLLM's older guided_* fields, and tool_choice in chat); each becomes one
StructuredOutputSpec, and the field it came from names the 400 when its grammar does not compile.
"""

import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from disagg.api.tool_calls import forced_schema, function_names, named_function
from disagg.engine.sampling_params import MAX_LOGPROBS, SamplingParamError, SamplingParams, StructuredOutputSpec

logger = logging.getLogger(__name__)

PrefillPolicy = Literal["recompute", "fail"]
FinishReason = Literal["stop", "length", "abort", "tool_calls"]
Role = Literal["system", "developer", "user", "assistant", "tool"]
MAX_CHOICES = 128  # n times the number of prompts, per request
# Counted on the parsed JSON before pydantic walks it: 100,000 empty messages (2.9 MB) took 2.4 s to
# validate and answer (issue 24). Long agent conversations stay far below these.
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 4096  # text parts of all messages together
MAX_TOOLS = 512

# Field names are the client's: the set of those already logged stops growing at this size.
MAX_WARNED_FIELDS = 256
_warned_fields: set[str] = set()
# Fields that OpenAI's API (and vLLM's) take as null, meaning their default.
NULL_MEANS_DEFAULT = frozenset({
    "n", "stream", "echo", "logprobs", "ignore_eos", "min_tokens", "skip_special_tokens", "include_stop_str_in_output",
    "spaces_between_special_tokens", "parallel_tool_calls", "add_generation_prompt", "continue_final_message",
    "return_token_ids", "return_tokens_as_token_ids", "return_token_strs",
})


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_defaults(cls, data: object) -> object:
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in NULL_MEANS_DEFAULT):
            return {name: value for name, value in data.items()
                    if not (value is None and name in NULL_MEANS_DEFAULT and name in cls.model_fields)}
        return data

    @model_validator(mode="after")
    def _warn_unknown_fields(self):
        for name in self.model_extra or {}:
            key = f"{type(self).__name__}.{name}"
            if key not in _warned_fields and len(_warned_fields) < MAX_WARNED_FIELDS:  # once per field name
                _warned_fields.add(key)
                logger.warning("ignoring the field %r of %s, which this server does not know "
                               "(logged once%s)", name, type(self).__name__,
                               "; no further unknown fields are logged" if len(_warned_fields) == MAX_WARNED_FIELDS
                               else "")
        return self


def check_request_size(body: object) -> None:
    """Refuses (SamplingParamError naming the field) a request body with more messages, content
    parts, tools or prompts than any request needs, by counting list lengths of the parsed JSON:
    cheap, and before validation, whose cost grows with them."""
    if not isinstance(body, dict):
        return  # validation says what is wrong
    messages = body.get("messages")
    if isinstance(messages, list):
        if len(messages) > MAX_MESSAGES:
            raise SamplingParamError("messages", f"at most {MAX_MESSAGES} messages a request, got {len(messages)}")
        parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
        if parts > MAX_CONTENT_PARTS:
            raise SamplingParamError("messages", f"at most {MAX_CONTENT_PARTS} content parts a request, got {parts}")
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise SamplingParamError("tools", f"at most {MAX_TOOLS} tools a request, got {len(tools)}")
    prompt = body.get("prompt")
    # A list of prompts (strings or token lists; not one prompt's token ids), each one choice at least.
    if isinstance(prompt, list) and len(prompt) > MAX_CHOICES and not isinstance(prompt[0], int):
        raise SamplingParamError("prompt", f"at most {MAX_CHOICES} prompts a request (n times the number of "
                                           f"prompts is at most {MAX_CHOICES}), got {len(prompt)}")


# A JSON \u escape of a UTF-16 surrogate. json.loads joins a valid pair into one character and keeps a
# lone one as it is, which no UTF-8 encoder (the tokenizer's included) takes: a 500 (issue 24).
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def check_unicode(body: bytes, data: object) -> None:
    """Refuses (SamplingParamError naming the field) a body whose strings hold a lone surrogate.
    The body's bytes are scanned first, so that bodies with no surrogate escape (nearly all) cost
    one regex pass; only those that have one are walked."""
    if SURROGATE_ESCAPE.search(body) is None:
        return
    path = lone_surrogate_path(data)
    if path is not None:
        raise SamplingParamError(path or "body", f"{path or 'the body'} holds a lone UTF-16 surrogate (a \\uD800-"
                                                 "\\uDFFF escape that is not half of a pair), which is no text; "
                                                 "send valid Unicode")


def lone_surrogate_path(value: object, path: str = "") -> str | None:
    """The dotted path of the first string (or key) in the parsed JSON that cannot be UTF-8, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        inner = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and lone_surrogate_path(key) is not None:
            return inner
        found = lone_surrogate_path(item, inner)
        if found is not None:
            return found
    return None


class StreamOptions(OpenAIRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


class JSONSchemaFormat(OpenAIRequest):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # None: any JSON value
    strict: bool | None = None


class ResponseFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class StructuredOutputs(OpenAIRequest):
    """vLLM's structured_outputs: exactly one of these."""
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    def spec(self) -> StructuredOutputSpec:
        given = {name: value for name, value in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                                 ("grammar", self.grammar)) if value is not None}
        if self.json_object:
            given["json"] = {"type": "object"}
        if len(given) != 1:
            raise SamplingParamError("structured_outputs", "structured_outputs takes exactly one of json, regex, "
                                                           f"choice, grammar or json_object, got {sorted(given)}")
        kind, value = given.popitem()
        return StructuredOutputSpec(kind, value if isinstance(value, str) else json.dumps(value))


# vLLM fields this server knows but cannot honour, with the values that ask for nothing.
UNSUPPORTED = {
    "use_beam_search": (None, False), "allowed_token_ids": (None,), "bad_words": (None, []),
    "truncate_prompt_tokens": (None,), "prompt_embeds": (None,), "suffix": (None, ""),
}


@dataclass(frozen=True)
class ServerSamplingOptions:
    """vLLM's server flags over sampling: --generation-config's defaults (temperature, top_p, top_k, min_p,
    repetition_penalty, max_tokens) for the fields a request leaves out, and --max-logprobs."""
    defaults: dict = field(default_factory=dict)
    max_logprobs: int = MAX_LOGPROBS

    def default_max_tokens(self, room: int) -> int:
        """max_tokens for a request that sets none: what is left of the context, or the config's if less."""
        return min(room, self.defaults.get("max_tokens", room))


class ContextLengthError(SamplingParamError):
    """A prompt and its max_tokens do not fit the context: a 400 with OpenAI's code for it."""
    code = "context_length_exceeded"


def check_context_length(max_model_len: int, num_prompt_tokens: int, max_tokens: int,
                         request: "CompletionRequest | ChatCompletionRequest") -> None:
    """Refuses a request whose prompt and output cannot fit max_model_len, in the words of OpenAI
    (and of earlier vLLM), which clients match on: LiteLLM's ContextWindowExceededError looks
    for "This model's maximum context length is". `max_tokens` is what the request may generate
    (what is left of the context when it set none, but at least 1). The param is the prompt's
    field, or the max_tokens field when that alone leaves no room for any prompt."""
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        param = request.max_tokens_param if max_tokens >= max_model_len else request.prompt_param
        raise ContextLengthError(param, f"This model's maximum context length is {max_model_len} tokens. However, "
                                        f"you requested {total} tokens ({num_prompt_tokens} in the messages, "
                                        f"{max_tokens} in the completion). Please reduce the length of the "
                                        f"messages or completion. (This server's max_model_len, {max_model_len}, "
                                        "bounds the prompt and max_tokens together.)")


@dataclass
class Prompt:
    """One prompt of a request, tokenized; `text` is what echo sends back."""
    token_ids: list[int]
    text: str


class SamplingFields(OpenAIRequest):
    """The sampling fields completions and chat share; vLLM's extensions (top_k, min_p, ...) included."""

    model: str | None = None  # None: the served model
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as vLLM does
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # only slow tokenizers use it; ours are fast, as in vLLM
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # vLLM's: logprobs of the prompt tokens
    response_format: ResponseFormat | None = None
    prefill_policy: PrefillPolicy | None = None  # ours: what to do when the prefill node fails; None: the node's
    use_beam_search: bool | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None  # vLLM's older names for structured_outputs' fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: object = None
    bad_words: object = None
    truncate_prompt_tokens: object = None
    return_token_ids: bool = False  # vLLM's: prompt_token_ids on the response, token_ids on each choice
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N", not by their text

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    def check_supported(self) -> None:
        """Raises SamplingParamError (a 400 naming the field) for what this server cannot honour."""
        for name, neutral in UNSUPPORTED.items():
            if getattr(self, name, None) not in neutral:
                raise SamplingParamError(name, f"{name} is not supported by this server; leave it out")
        if not 1 <= self.n <= MAX_CHOICES:
            raise SamplingParamError("n", f"n must be between 1 and {MAX_CHOICES}, got {self.n}")

    def structured_specs(self) -> dict[str, StructuredOutputSpec]:
        """Field name -> the structured output it asks for, for every field that asks for one."""
        specs = {}
        if self.response_format is not None and self.response_format.type != "text":
            schema = {"type": "object"}  # json_object: any JSON object, as OpenAI's JSON mode
            if self.response_format.type == "json_schema":
                schema = self.response_format.json_schema.schema_ or {}
            specs["response_format"] = StructuredOutputSpec("json", json.dumps(schema))
        if self.structured_outputs is not None:
            specs["structured_outputs"] = self.structured_outputs.spec()
        guided = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
        for name, kind in guided.items():
            value = getattr(self, name)
            if value is not None:
                specs[name] = StructuredOutputSpec(kind, value if isinstance(value, str) else json.dumps(value))
        return specs

    def structured(self) -> tuple[str, StructuredOutputSpec] | tuple[None, None]:
        """The one structured output asked for and the field that asks for it; (None, None) if none."""
        specs = self.structured_specs()
        if len(specs) > 1:
            raise SamplingParamError(sorted(specs)[1], f"send one way of structured output, got {sorted(specs)}")
        return next(iter(specs.items()), (None, None))

    @property
    def num_candidates(self) -> int:
        """Choices generated per prompt (completions' best_of may make it more than n)."""
        return self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: usage in every chunk (with include_usage, as there)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def _sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                         options: ServerSamplingOptions) -> SamplingParams:
        """SamplingParams checks the values; its ValueError is the 400's message."""
        self.check_supported()
        _, structured = self.structured()
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and value > options.max_logprobs:
                raise SamplingParamError(name, f"{name} {value} is more than the {options.max_logprobs} this server "
                                               "allows (--max-logprobs)")
        optional = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                    "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                    "repetition_penalty": self.repetition_penalty}
        optional = {name: options.defaults.get(name) if value is None else value for name, value in optional.items()}
        return SamplingParams(
            **{name: value for name, value in optional.items() if value is not None},  # None: the default
            seed=self.seed,
            max_tokens=max_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias=logit_bias_ids(self.logit_bias),
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=prompt_logprobs,
            structured=structured,
        )


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float]:
    try:
        return {int(token): value for token, value in (bias or {}).items()}
    except ValueError:
        raise SamplingParamError("logit_bias", "logit_bias keys must be token ids, such as \"50256\"") from None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # None: up to the model's context length; 0 only with echo
    logprobs: int | None = None  # the n most likely tokens per position (0..20)
    echo: bool = False  # the prompt comes back before the output (with its logprobs, when asked)
    best_of: int | None = None
    suffix: str | None = None
    prompt_embeds: object = None
    prompt_param: ClassVar[str] = "prompt"  # the fields a context-length error names
    max_tokens_param: ClassVar[str] = "max_tokens"

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[str] | list[int] | list[list[int]]):
        if not prompt or (isinstance(prompt, list) and not isinstance(prompt[0], int) and not all(prompt)):
            raise ValueError("the prompt is empty")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @property
    def echo_only(self) -> bool:
        """lm-eval's loglikelihood: the prompt and its logprobs, nothing generated."""
        return self.echo and self.max_tokens == 0

    @property
    def num_candidates(self) -> int:
        """Choices generated per prompt: best_of, of which the n most likely are returned."""
        return self.best_of or self.n

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of < self.n:
            raise SamplingParamError("best_of", f"best_of must be at least n, got best_of={self.best_of}, n={self.n}")
        if self.stream and self.num_candidates > self.n:
            raise SamplingParamError("best_of", "best_of > n cannot be streamed: the best choices are known only at "
                                                "the end")
        if len(self.prompts) * self.num_candidates > MAX_CHOICES:
            raise SamplingParamError("best_of" if self.best_of else "n", f"best_of (or n) times the number of "
                                     f"prompts must be at most {MAX_CHOICES}, got {self.num_candidates} x "
                                     f"{len(self.prompts)}")

    def to_sampling_params(self, default_max_tokens: int,
                           options: ServerSamplingOptions = ServerSamplingOptions()) -> SamplingParams:
        """default_max_tokens applies when max_tokens is null: what is left of the context."""
        if self.max_tokens == 0 and not self.echo:
            raise SamplingParamError("max_tokens", "max_tokens must be at least 1 (0 only with echo)")
        # With echo and max_tokens 0 one token is generated and dropped, as vLLM does.
        max_tokens = options.default_max_tokens(default_max_tokens) if self.max_tokens is None else self.max_tokens or 1
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        logprobs = self.logprobs
        if logprobs is None and self.num_candidates > self.n:
            logprobs = 0  # best_of ranks by them; the answer shows them only when asked
        return self._sampling_params(max_tokens, logprobs, prompt_logprobs, options)


class TextPart(OpenAIRequest):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIRequest):
    role: Role
    content: str | list[TextPart] | None = None  # OpenAI's list of parts: text only here
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call

    @model_validator(mode="after")
    def _check_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant message with tool_calls "
                             "may have none)")
        return self

    @property
    def text(self) -> str:
        """The content as one string: parts joined as vLLM joins them."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""

    def to_template(self) -> dict:
        """The message as chat templates expect it: content as one string, developer as system,
        tool-call arguments parsed into objects as vLLM passes them."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [parsed_tool_call(call) for call in self.tool_calls]
        return message


def parsed_tool_call(call: dict) -> dict:
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
        except json.JSONDecodeError:
            pass  # the template gets the string as it came
    return call


class ChatTemplateFields(OpenAIRequest):
    """vLLM's fields over how messages are rendered into the prompt, which chat and /tokenize share."""
    add_generation_prompt: bool = True  # the template opens the assistant's turn after the messages
    continue_final_message: bool = False  # the prompt ends inside the last message, which the model continues
    chat_template: str | None = None  # refused, as vLLM refuses it without --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template, e.g. enable_thinking

    def check_chat_template(self) -> None:
        """Raises SamplingParamError (a 400 naming the field) for what vLLM refuses too."""
        if self.continue_final_message and self.add_generation_prompt:
            raise SamplingParamError("continue_final_message", "Cannot set both `continue_final_message` and "
                                     "`add_generation_prompt` to True: send add_generation_prompt false to continue "
                                     "the last message")
        for param, given in (("chat_template", self.chat_template is not None),
                             ("chat_template_kwargs", "chat_template" in (self.chat_template_kwargs or {}))):
            # A template is code (Jinja): a client's could run the node's threads for as long as it likes.
            if given:
                raise SamplingParamError(param, "a chat template sent with the request is refused (as vLLM does "
                                                "without --trust-request-chat-template): the server renders "
                                                "messages with its own (--chat-template, or the tokenizer's)")


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # with logprobs: the n most likely tokens per position (0..20)
    tools: list[dict] | None = None  # passed to the chat template
    tool_choice: str | dict | None = None  # None: "auto" with tools, "none" without (vLLM's default)
    parallel_tool_calls: bool = True
    echo: bool = False  # vLLM's: the answer starts with the last message's content, when its role is the answer's

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def tool_mode(self) -> Literal["none", "auto", "forced"]:
        """How tool calls come out: not at all, parsed from what the model writes, or forced by a grammar."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if not self.tools or choice == "none":
            return "none"
        return "auto" if choice == "auto" else "forced"

    prompt_param: ClassVar[str] = "messages"

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools the chat template sees: none with tool_choice "none"."""
        return None if self.tool_mode == "none" else self.tools

    @property
    def response_role(self) -> Role:
        """The answer's role, as vLLM gives it: the assistant's after a generation prompt; else the
        last message's, which the answer goes on with."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    @property
    def echo_text(self) -> str:
        """What echo puts before the answer: the last message's content, if its role is the answer's."""
        last = self.messages[-1]
        return last.text if self.echo and last.role == self.response_role else ""

    def check_supported(self) -> None:
        super().check_supported()
        self.check_chat_template()
        if any(not isinstance(name, str) or not name for name in function_names(self.tools or [])):
            raise SamplingParamError("tools", 'each tool must be {"type": "function", "function": {"name": ..., '
                                              '"parameters": {...}}} with a name')
        choice = self.tool_choice
        if not (choice in (None, "none", "auto", "required") or named_function(choice) is not None):
            raise SamplingParamError("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or "
                                                    "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if (choice == "required" or named_function(choice) is not None) and not self.tools:
            raise SamplingParamError("tool_choice", "tool_choice \"required\" or a named function needs tools")
        name = named_function(choice)
        if name is not None and name not in function_names(self.tools):
            raise SamplingParamError("tool_choice", f"tool_choice names the function {name!r}, which is not among "
                                                    f"the tools {function_names(self.tools)}")

    def structured_specs(self) -> dict[str, StructuredOutputSpec]:
        specs = super().structured_specs()
        if self.tool_mode == "forced":
            schema = forced_schema(self.tools, self.tool_choice, self.parallel_tool_calls)
            specs["tool_choice"] = StructuredOutputSpec("json", json.dumps(schema))
        return specs

    def to_sampling_params(self, default_max_tokens: int,
                           options: ServerSamplingOptions = ServerSamplingOptions()) -> SamplingParams:
        """default_max_tokens applies when neither max_completion_tokens nor max_tokens is set."""
        if self.max_completion_tokens is not None:
            max_tokens = self.max_completion_tokens
        elif self.max_tokens is not None:
            max_tokens = self.max_tokens
        else:
            max_tokens = options.default_max_tokens(default_max_tokens)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling_params(max_tokens, logprobs, self.prompt_logprobs, options)
        except SamplingParamError as e:  # the 400 names the field this request sent, not the engine's
            sent = {"logprobs": "top_logprobs"}
            if self.max_completion_tokens is not None:
                sent["max_tokens"] = "max_completion_tokens"
            if e.param not in sent:
                raise
            raise SamplingParamError(sent[e.param], str(e).replace(e.param, sent[e.param], 1)) from None


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize: a prompt, or messages rendered with the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        return self


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


# -- responses ---------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token (with echo the prompt's
    first, whose first entry has no logprob)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry, one per token id (its JSON key)."""
    logprob: float
    rank: int | None = None  # 1: the most likely; None: not among the top ones asked for
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: its prompt's (streamed: in its first chunk)
    token_ids: list[int] | None = None  # return_token_ids: the tokens of `text` past the prompt


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class WithoutNulls(BaseModel):
    """Fields left as None are not sent at all: a streamed call's later pieces carry only its index
    and the next part of its arguments, as in vLLM and OpenAI."""

    @model_serializer(mode="wrap")
    def without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(WithoutNulls):
    name: str | None = None  # in a call's first piece
    arguments: str


class DeltaToolCall(WithoutNulls):
    index: int  # of the call in its message
    id: str | None = None  # in a call's first piece, with type
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


# --reasoning-parser's split of the answer: vLLM's name for the reasoning is `reasoning`, which it
# used to call `reasoning_content` (DeepSeek's name, which most clients read); both are sent, and
# neither when there is none.
Reasoning = Field(default=None, exclude_if=lambda value: value is None)


class ChatResponseMessage(BaseModel):
    role: Role = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)
    reasoning: str | None = Reasoning
    reasoning_content: str | None = Reasoning


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # return_token_ids: the generated tokens


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # vLLM's, of the one prompt
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaMessage(BaseModel):
    role: Role | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = Reasoning
    reasoning_content: str | None = Reasoning


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # return_token_ids: the tokens this chunk adds


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in each choice's first chunk


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "disagg"
    root: str  # vLLM's: the model the node loaded; here its local directory
    tokenizer: str  # the directory of the tokenizer it loaded (--tokenizer, else root): a cache-aware router's
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
