"""The OpenAI API as vLLM serves it: request and response models for completions, chat and models.

Requests refuse fields they do not know (a typo must not be silently ignored, as OpenAI does),
and the OpenAI fields this server cannot honour are accepted only at their no-op values.
Sampling fields left out (or null) take SamplingParams' defaults.
"""

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from disagg.engine.sampling_params import SamplingParams

PrefillPolicy = Literal["recompute", "fail"]
FinishReason = Literal["stop", "length", "abort"]


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(OpenAIRequest):
    include_usage: bool = False


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
    # OpenAI fields without an implementation here: only their neutral values are accepted.
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    prefill_policy: PrefillPolicy | None = None  # ours: what to do when the prefill node fails; None: the node's

    @model_validator(mode="after")
    def _check_unsupported(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                raise ValueError(f"{name} is not supported by this server; leave it out or send 0")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server; leave it out")
        return self

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingParams checks the values; its ValueError is the 400's message."""
        optional = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p}
        return SamplingParams(
            **{name: value for name, value in optional.items() if value is not None},  # None: the default
            seed=self.seed,
            max_tokens=max_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            n=self.n,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # None: up to the model's context length
    logprobs: int | None = None  # the n most likely tokens per position (0..20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str] | list[list[int]]):
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ValueError(f"this server takes one prompt per request, got {len(prompt)}; "
                                 "send each prompt as a request of its own")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @model_validator(mode="after")
    def _check_completion_unsupported(self):
        if self.echo:
            raise ValueError("echo is not supported by this server; leave it out or send false")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported by this server; leave it out or send 1")
        if self.suffix:
            raise ValueError("suffix is not supported by this server; leave it out")
        return self

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """default_max_tokens applies when max_tokens is null: what is left of the context."""
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs)


class TextPart(OpenAIRequest):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIRequest):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]  # OpenAI's list of parts: text only here
    name: str | None = None

    def to_template(self) -> dict:
        """The message as chat templates expect it: content as one string (parts joined as vLLM does)."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # with logprobs: the n most likely tokens per position (0..20)

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """default_max_tokens applies when neither max_completion_tokens nor max_tokens is set."""
        if self.max_completion_tokens is not None:
            max_tokens = self.max_completion_tokens
        elif self.max_tokens is not None:
            max_tokens = self.max_tokens
        else:
            max_tokens = default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


# -- responses ---------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per output token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it


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


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "disagg"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str  # OpenAI's: invalid_request_error, authentication_error, server_error, ...
    param: str | None = None  # the request field at fault, when one is
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
