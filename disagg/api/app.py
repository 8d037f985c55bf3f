"""The OpenAI HTTP API of a decode (or colocated) node: completions, chat, models, tokenize,
health, load and metrics.

Every error answers in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the
status vLLM gives it: 400 bad input (validation included, never FastAPI's 422; a prompt over the
context with OpenAI's code context_length_exceeded), 401 bad key, 404 unknown model or path, 405
wrong method, 413 a body over --max-request-body-bytes, 500 a request the engine failed, 503
prefill node unavailable under the "fail" policy. Every response carries X-Request-Id.

Completions and chat share one path: a request becomes one engine request per choice (each
prompt times n), started together; `Choice` holds one of them and an endpoint's formatter turns
its outputs into that endpoint's chunks and response. A streamed request waits for every
choice's first output before the response starts, so the errors that come before the first
token (prefill unavailable, bad input) keep their HTTP status; an error after that is sent as an
error event, then [DONE].
"""

import asyncio
import dataclasses
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from disagg import metrics
from disagg.api.kv_events import kv_events_response
from disagg.api.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTemplateFields,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ContextLengthError,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    Prompt,
    PromptLogprob,
    PromptTokensDetails,
    SamplingFields,
    ServerSamplingOptions,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallOut,
    UsageInfo,
    check_context_length,
    check_request_size,
    check_unicode,
)
from disagg.api.reasoning import THINK_END, ReasoningParser, ReasoningStream
from disagg.api.responses import RESPONSES_PARAMS, ResponseObject, ResponsesFormat, ResponsesRequest, ResponseStore
from disagg.api.tool_calls import CallDelta, ToolCall, ToolCallStream, ToolOptions, ToolParser, tool_parser
from disagg.decode_node.node import DecodeNode, PrefillUnavailable
from disagg.engine.output import RequestOutput
from disagg.engine.sampling_params import SamplingParams
from disagg.engine.sequence import TokenLogprob
from disagg.engine.tokenizer import Tokenizer
from disagg.serving import (
    STATUS_CLIENT_CLOSED,
    HTTPOptions,
    add_profiler_routes,
    make_app,
    openai_error,
    request_label,
)
from disagg.timeline import mark

logger = logging.getLogger(__name__)

T = TypeVar("T")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def renamed(self, names: dict[str, str]) -> "APIError":
        """The error with its param named as another endpoint names the field (its first part), in
        the message too where it starts with the field's name ("max_completion_tokens must be ...")."""
        if self.param is not None:
            head, dot, rest = self.param.partition(".")
            new = names.get(head, head)
            self.param = new + dot + rest
            if re.match(rf"{re.escape(head)}\b", self.message):
                self.message = new + self.message[len(head):]
        return self


class ClientDisconnected(Exception):
    """The client closed the connection before the request finished; it was aborted."""


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    metrics.REQUEST_ERRORS.labels(str(status)).inc()
    return JSONResponse(openai_error(status, message, param, code), status_code=status, headers=headers)


def api_error_from(error: Exception) -> APIError:
    """The HTTP status of an exception out of the node."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):  # a SamplingParamError names the field; a ContextLengthError has a code
        return APIError(400, str(error), param=getattr(error, "param", None), code=getattr(error, "code", None))
    if isinstance(error, PrefillUnavailable):
        return APIError(503, f"{error}; retry, or send prefill_policy \"recompute\" to let the decode node "
                             "compute the prompt itself")
    logger.error("request failed", exc_info=error)
    return APIError(500, f"the server failed while generating: {error}")


def request_error(request: SamplingFields, error: ValueError) -> APIError:
    """api_error_from, with a grammar's error naming the request field that sent the grammar."""
    api_error = api_error_from(error)
    if api_error.param == "structured":
        api_error.param = request.structured()[0]
    return api_error


class Generation:
    """One engine request's run through the node: its outputs, its metrics and its two log lines.

    node.generate runs in an asyncio task of its own. Starlette stops a streamed response (the
    client went away) by cancelling an anyio scope, which cancels every await inside it again
    and again and would cut the node's cleanup — the abort on both nodes — short; cancelling
    this task is one asyncio cancellation, so the node's `finally` runs to its end."""

    def __init__(self, node: DecodeNode, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prefill_policy: str | None, log_requests: bool):
        self.request_id = request_id
        self.log_requests = log_requests
        self.num_prompt_tokens = len(prompt_token_ids)
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.last: RequestOutput | None = None
        self.error: Exception | None = None
        self.queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.aborting = False
        if log_requests:
            logger.info("%s started: %d prompt tokens, max_tokens %d", request_id, self.num_prompt_tokens,
                        params.max_tokens)
        self.pump = asyncio.create_task(self._pump(node.generate(request_id, prompt_token_ids, params, prefill_policy)))

    async def _pump(self, outputs: AsyncIterator[RequestOutput]) -> None:
        last: RequestOutput | None = None
        try:
            async for out in outputs:
                self.queue.put_nowait(out)
                last = out
            if last is None or not last.finished:  # so that the reader does not wait forever
                self.queue.put_nowait(RuntimeError("the node's output stream ended before the request finished"))
        except asyncio.CancelledError:
            self.queue.put_nowait(ClientDisconnected(f"{self.request_id}: the client disconnected"))
            raise
        except Exception as e:  # noqa: BLE001  handed to the reader, which answers with its status
            self.queue.put_nowait(e)

    def abort(self) -> None:
        """Cancel the node's generator, once: a second cancellation would interrupt its abort."""
        if not self.aborting and not self.pump.done():
            self.aborting = True
            self.pump.cancel()

    async def next(self) -> RequestOutput:
        """The next output; raises what the node raised, or ClientDisconnected."""
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.error = item
            raise item
        now = time.perf_counter()
        if item.new_token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
                metrics.TTFT.observe(now - self.start)
            else:
                gap = (now - self.last_token_at) / len(item.new_token_ids)
                for _ in item.new_token_ids:
                    metrics.ITL.observe(gap)
            self.last_token_at = now
            metrics.GENERATION_TOKENS.inc(len(item.new_token_ids))
        self.last = item
        return item

    async def close(self) -> None:
        """Abort the request if it is still running (and wait until it is), then log and count how it ended."""
        if not self.pump.done():
            self.abort()
            with anyio.CancelScope(shield=True):  # this may run inside the response's cancelled scope
                await asyncio.wait([self.pump])
        finished = self.last is not None and self.last.finished
        if finished:
            outcome = self.last.finish_reason
        elif isinstance(self.error, ClientDisconnected) or self.error is None:
            outcome = "abort"  # the client went away (or the response failed to send)
        else:
            outcome = f"error ({self.error})"
        if finished or outcome == "abort":
            metrics.REQUESTS.labels(outcome).inc()
            metrics.E2E.observe(time.perf_counter() - self.start)
        if not self.log_requests:
            return
        ttft = "-" if self.first_token_at is None else f"{self.first_token_at - self.start:.3f}s"
        logger.info("%s finished: %d prompt tokens, %d output tokens, finish reason %s, TTFT %s, E2E %.3fs",
                    self.request_id, self.num_prompt_tokens, len(self.last.token_ids) if self.last else 0,
                    outcome, ttft, time.perf_counter() - self.start)


@dataclasses.dataclass
class Choice:
    """One choice of a response: its prompt, its engine request, and what was sent of it so far."""
    index: int  # prompt index * n + choice, as vLLM numbers them
    prompt: Prompt
    generation: Generation
    out: RequestOutput | None = None  # the latest output
    started: bool = False  # its first chunk went out
    num_logprobs_sent: int = 0
    num_token_ids_sent: int = 0  # return_token_ids
    text_offset: int = 0  # completions, and chat with tools: where the text sent so far ends
    tool_calls: ToolCallStream | None = None  # chat with tools, streamed
    reasoning: ReasoningStream | None = None  # chat with --reasoning-parser, streamed

    def new_logprobs(self) -> list[TokenLogprob]:
        logprobs = self.out.logprobs[self.num_logprobs_sent:]
        self.num_logprobs_sent = len(self.out.logprobs)
        return logprobs

    def new_token_ids(self) -> list[int]:
        """The output tokens not sent yet: an output whose text is held back (a possible stop string)
        still counts its tokens, which go out with the next chunk."""
        token_ids = self.out.token_ids[self.num_token_ids_sent:]
        self.num_token_ids_sent = len(self.out.token_ids)
        return token_ids


class Run:
    """One HTTP request's choices, started together and aborted together.

    A task waits for the client's disconnect, which nothing else notices for a request that is
    not streamed, and aborts every choice."""

    def __init__(self, node: DecodeNode, request_id: str, prompts: list[Prompt], params: SamplingParams, n: int,
                 prefill_policy: str | None, raw_request: Request, log_requests: bool, n_param: int):
        self.request_id = request_id
        self.choices: list[Choice] = []  # those answered: every candidate, until keep_best
        self.closed = False
        self.n_param = n_param  # the request's n (`n` here is the candidates of each prompt: best_of)
        self.num_prompts = len(prompts)
        for index in range(len(prompts) * n):
            # vLLM's per-choice seeds: choice j of each prompt samples with seed + j.
            seed = None if params.seed is None else params.seed + index % n
            choice_id = request_id if len(prompts) * n == 1 else f"{request_id}-{index}"
            generation = Generation(node, choice_id, prompts[index // n].token_ids,
                                    dataclasses.replace(params, seed=seed), prefill_policy, log_requests)
            self.choices.append(Choice(index, prompts[index // n], generation))
        self.candidates = list(self.choices)  # every engine request, answered or not
        self.watcher = asyncio.create_task(self._watch(raw_request))

    async def _watch(self, raw_request: Request) -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass
        for choice in self.candidates:
            choice.generation.abort()

    async def start(self) -> None:
        """Wait for every choice's first output; errors before it keep their status."""
        try:
            for choice in self.choices:
                choice.out = await choice.generation.next()
        except ClientDisconnected:
            await self.close()
            raise
        except Exception as e:
            await self.close()
            raise api_error_from(e) from e

    async def finish(self) -> None:
        """Wait until every choice has finished."""
        for choice in self.choices:
            while not choice.out.finished:
                choice.out = await choice.generation.next()

    def keep_best(self, num_prompts: int, n: int) -> None:
        """best_of: of each prompt's candidates, keep the n with the highest cumulative logprob
        (vLLM's ranking), numbered again prompt index * n + rank. Usage still counts every candidate."""
        per_prompt = len(self.choices) // num_prompts
        if per_prompt == n:
            return
        kept = []
        for p in range(num_prompts):
            candidates = self.choices[p * per_prompt:(p + 1) * per_prompt]
            candidates.sort(key=lambda c: sum(lp.logprob for lp in c.out.logprobs), reverse=True)
            kept += [dataclasses.replace(c, index=p * n + rank) for rank, c in enumerate(candidates[:n])]
        self.choices = kept

    async def outputs(self) -> AsyncIterator[Choice]:
        """Each choice as it gets an output (its first ones first), until all have finished. One
        choice (the usual request) reads its stream in turn; several are raced, a task each."""
        for choice in self.choices:
            yield choice
        if len(self.choices) == 1:
            choice = self.choices[0]
            while not choice.out.finished:
                choice.out = await choice.generation.next()
                yield choice
            return
        pending = {asyncio.create_task(c.generation.next()): c for c in self.choices if not c.out.finished}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    choice = pending.pop(task)
                    choice.out = task.result()  # raises what the node raised
                    yield choice
                    if not choice.out.finished:
                        pending[asyncio.create_task(choice.generation.next())] = choice
        finally:
            for task in pending:
                task.cancel()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.watcher.cancel()
        for choice in self.candidates:
            await choice.generation.close()
        # vLLM's vllm:request_params_n: each prompt's n, once all its choices have finished.
        per_prompt = len(self.candidates) // self.num_prompts
        for p in range(self.num_prompts):
            if all(c.out is not None and c.out.finished for c in self.candidates[p * per_prompt:(p + 1) * per_prompt]):
                metrics.REQUEST_PARAMS_N.observe(self.n_param)


# Real text averages about 4 characters a token; a prompt over max_model_len times this many
# characters cannot fit, and is refused before it is tokenized.
MAX_PROMPT_CHARS_PER_TOKEN = 32


def token_text(tokenizer: Tokenizer, token_id: int, as_id: bool = False) -> str:
    """A token as logprobs name it. as_id (vLLM's return_tokens_as_token_ids): "token_id:N", for
    clients that map tokens back to ids, where a token's text may be part of a character only."""
    if as_id:
        return f"token_id:{token_id}"
    # Special tokens keep their names, so that distinct tokens stay distinct keys in top_logprobs.
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer, entries: list[tuple[int, TokenLogprob | None]],
                        offset: int, as_ids: bool = False) -> CompletionLogprobs:
    """Completions' format for (token id, its logprob entry or None) pairs; `offset` is the
    text_offset of the first token (where the text sent so far ends)."""
    result = CompletionLogprobs()
    for token_id, lp in entries:
        token = token_text(tokenizer, token_id, as_ids)
        result.tokens.append(token)
        result.token_logprobs.append(None if lp is None else lp.logprob)
        top = None
        if lp is not None:  # the chosen token is among them, as vLLM sends it
            top = {token_text(tokenizer, t, as_ids): logprob for t, logprob in lp.top} | {token: lp.logprob}
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(token)
    return result


def prompt_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob | None]) -> list[dict[int, PromptLogprob] | None]:
    """vLLM's prompt_logprobs: per prompt token, its entry and the top ones, by token id."""
    result = []
    for lp in entries:
        if lp is None:
            result.append(None)
            continue
        ranked = {t: PromptLogprob(logprob=v, rank=rank, decoded_token=token_text(tokenizer, t))
                  for rank, (t, v) in enumerate(lp.top, start=1)}
        if lp.token_id not in ranked:
            ranked[lp.token_id] = PromptLogprob(logprob=lp.logprob, decoded_token=token_text(tokenizer, lp.token_id))
        result.append(ranked)
    return result


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob], as_ids: bool = False) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> ChatTopLogprob:
        token = token_text(tokenizer, token_id, as_ids)
        return ChatTopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    return ChatLogprobs(content=[
        ChatTokenLogprob(**top(lp.token_id, lp.logprob).model_dump(),
                         top_logprobs=[top(t, logprob) for t, logprob in lp.top])
        for lp in logprobs])


def sse(event: BaseModel) -> str:
    return f"data: {event.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_error(error: Exception) -> str:
    """The error event of a stream that already started: OpenAI's error shape, as vLLM sends it."""
    api_error = api_error_from(error)
    metrics.REQUEST_ERRORS.labels(str(api_error.status)).inc()
    body = openai_error(api_error.status, api_error.message, api_error.param, api_error.code)
    return f"data: {JSONResponse(body).body.decode()}\n\n"


def usage(choices: list[Choice], num_output_tokens: Callable[[Choice], int]) -> UsageInfo:
    """Each prompt counts once, however many choices it has (vLLM's count)."""
    prompts = {id(c.prompt): c for c in choices}.values()
    prompt = sum(len(c.prompt.token_ids) for c in prompts)
    completion = sum(num_output_tokens(c) for c in choices)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(c.out.num_cached_tokens
                                                                                 for c in prompts)))


class CompletionFormat:
    """/v1/completions: text chunks, the legacy logprobs format, echo."""

    def __init__(self, request: CompletionRequest, tokenizer: Tokenizer, model: str):
        self.request = request
        self.tokenizer = tokenizer
        self.model = model
        self.created = int(time.time())

    def num_output_tokens(self, choice: Choice) -> int:
        return 0 if self.request.echo_only else len(choice.out.token_ids)

    def _prompt_entries(self, choice: Choice) -> list[tuple[int, TokenLogprob | None]]:
        return list(zip(choice.prompt.token_ids, choice.out.prompt_logprobs or []))

    def first(self, choice: Choice) -> list[CompletionChoice]:
        """With echo, the prompt (and its logprobs) goes out before the first output."""
        if not self.request.echo:
            return []
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = completion_logprobs(self.tokenizer, self._prompt_entries(choice), 0,
                                           self.request.return_tokens_as_token_ids)
            choice.text_offset = sum(len(t) for t in logprobs.tokens)
        return [CompletionChoice(index=choice.index, text=choice.prompt.text, logprobs=logprobs,
                                 token_ids=[] if self.request.return_token_ids else None)]

    def delta(self, choice: Choice) -> list[CompletionChoice]:
        out = choice.out
        if self.request.echo_only:  # the one token generated is not part of the answer
            return [CompletionChoice(index=choice.index, text="", finish_reason="length",
                                     token_ids=[] if self.request.return_token_ids else None)] if out.finished else []
        token_ids = choice.new_token_ids() if self.request.return_token_ids else None
        logprobs = None
        if self.request.logprobs is not None:
            entries = [(lp.token_id, lp) for lp in choice.new_logprobs()]
            logprobs = completion_logprobs(self.tokenizer, entries, choice.text_offset,
                                           self.request.return_tokens_as_token_ids)
            choice.text_offset += sum(len(t) for t in logprobs.tokens)
        if out.new_text or out.finished or (logprobs and logprobs.tokens) or token_ids:
            return [CompletionChoice(index=choice.index, text=out.new_text, logprobs=logprobs,
                                     finish_reason=out.finish_reason if out.finished else None,
                                     stop_reason=out.stop_reason, token_ids=token_ids)]
        return []

    def chunk(self, run: Run, parts: list[CompletionChoice], usage_info: UsageInfo | None = None,
              prompt: Prompt | None = None) -> str:
        """`prompt`: this is its choice's first chunk, which carries the prompt's ids (return_token_ids)."""
        if prompt is not None and self.request.return_token_ids:
            parts[0].prompt_token_ids = prompt.token_ids
        return sse(CompletionStreamResponse(id=run.request_id, created=self.created, model=self.model,
                                            choices=parts, usage=usage_info))

    def response(self, run: Run) -> CompletionResponse:
        choices = []
        for choice in run.choices:
            out, echo = choice.out, self.request.echo
            entries = self._prompt_entries(choice) if echo else []
            text = choice.prompt.text if echo else ""
            finish_reason, stop_reason = "length", None
            if not self.request.echo_only:
                entries += [(lp.token_id, lp) for lp in out.logprobs]
                text += out.text
                finish_reason, stop_reason = out.finish_reason, out.stop_reason
            logprobs = None
            if self.request.logprobs is not None:
                logprobs = completion_logprobs(self.tokenizer, entries, 0, self.request.return_tokens_as_token_ids)
            prompt_lps = None if self.request.prompt_logprobs is None else prompt_logprobs(self.tokenizer,
                                                                                            out.prompt_logprobs)
            prompt_ids = token_ids = None
            if self.request.return_token_ids:
                prompt_ids, token_ids = choice.prompt.token_ids, [] if self.request.echo_only else out.token_ids
            choices.append(CompletionChoice(index=choice.index, text=text, logprobs=logprobs,
                                            finish_reason=finish_reason,
                                            stop_reason=stop_reason, prompt_logprobs=prompt_lps,
                                            prompt_token_ids=prompt_ids, token_ids=token_ids))
        return CompletionResponse(id=run.request_id, created=self.created, model=self.model, choices=choices,
                                  usage=usage(run.candidates, self.num_output_tokens))


class ChatFormat:
    """/v1/chat/completions: the answer's role first (with echo, then the content it goes on from),
    then content deltas. With a reasoning parser, the reasoning goes out first (ReasoningStream) and
    what follows it is the content. When tool calls may come out, each call streams as the model
    writes it (ToolCallStream) and the text around calls is held back as its parser says and sent at
    the end."""

    def __init__(self, request: ChatCompletionRequest, tokenizer: Tokenizer, model: str,
                 tools: ToolParser | None = None, reasoning: ReasoningParser | None = None):
        self.request = request
        self.tokenizer = tokenizer
        self.model = model
        self.tools = tools  # how calls are read out of the answer; None: none can come out
        self.reasoning = reasoning  # --reasoning-parser's, if any
        self.created = int(time.time())

    @staticmethod
    def num_output_tokens(choice: Choice) -> int:
        return len(choice.out.token_ids)

    def first(self, choice: Choice) -> list[ChatStreamChoice]:
        if self.tools is not None:
            choice.tool_calls = ToolCallStream(self.tools)
        if self.reasoning is not None:
            choice.reasoning = ReasoningStream(self.reasoning)
        parts = [ChatStreamChoice(index=choice.index, delta=DeltaMessage(role=self.request.response_role, content=""))]
        if self.request.echo_text:  # vLLM sends it in a chunk of its own, after the role's
            parts.append(ChatStreamChoice(index=choice.index, delta=DeltaMessage(content=self.request.echo_text)))
        return parts

    def delta(self, choice: Choice) -> list[ChatStreamChoice]:
        """This output's chunks: its reasoning, its content, then each piece of a tool call in a chunk
        of its own; the logprobs, token ids and the finish reason go with the last."""
        out = choice.out
        logprobs = None
        if self.request.logprobs:
            logprobs = chat_logprobs(self.tokenizer, choice.new_logprobs(), self.request.return_tokens_as_token_ids)
        token_ids = choice.new_token_ids() if self.request.return_token_ids else None
        deltas, text = [], out.text
        if choice.reasoning is not None:
            reasoning, text = choice.reasoning.update(out.text, out.finished)  # text: the content so far
            deltas = [DeltaMessage(reasoning=reasoning, reasoning_content=reasoning)] if reasoning else []
        if choice.tool_calls is None:
            content, choice.text_offset = text[choice.text_offset:], len(text)
            deltas += [DeltaMessage(content=content)] if content else []
        else:
            deltas += self.tool_deltas(choice, text, out.finished)
        if not deltas and (out.finished or (logprobs and logprobs.content) or token_ids):
            deltas = [DeltaMessage(content="")]
        parts = [ChatStreamChoice(index=choice.index, delta=delta) for delta in deltas]
        if parts:
            parts[-1].logprobs = logprobs
            parts[-1].token_ids = token_ids
            if out.finished:
                calls = choice.tool_calls.calls if choice.tool_calls else []
                parts[-1].finish_reason = tool_finish_reason(out.finish_reason, calls)
                parts[-1].stop_reason = out.stop_reason
        return parts

    def tool_deltas(self, choice: Choice, text: str, finished: bool) -> list[DeltaMessage]:
        """The content streams up to where a call starts (or may start; all of it held back where the
        parser decides only at the end), and the rest of the content goes out at the end."""
        content = ""
        if not finished:
            end = max(choice.text_offset, self.tools.content_end(text))
            content, choice.text_offset = text[choice.text_offset:end], end
        else:
            rest = self.tools.stream_content(text)
            content = rest[choice.text_offset:] if rest.startswith(text[:choice.text_offset]) else ""
        pieces = choice.tool_calls.update(text, finished)
        return ([DeltaMessage(content=content)] if content else []) + [
            DeltaMessage(tool_calls=[delta_tool_call(piece)]) for piece in pieces]

    def message(self, out: RequestOutput) -> tuple[ChatResponseMessage, str]:
        """A finished choice's message and finish reason."""
        reasoning, content = (None, out.text) if self.reasoning is None else self.reasoning.extract(out.text)
        calls = []
        if self.tools is not None and content is not None:
            content, calls = self.tools.parse(content)
        tool_calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls]
        if self.request.echo_text:
            content = self.request.echo_text + (content or "")
        message = ChatResponseMessage(role=self.request.response_role, content=content, tool_calls=tool_calls,
                                      reasoning=reasoning, reasoning_content=reasoning)
        return message, tool_finish_reason(out.finish_reason, calls)

    def chunk(self, run: Run, parts: list[ChatStreamChoice], usage_info: UsageInfo | None = None,
              prompt: Prompt | None = None) -> str:
        """`prompt`: this is a choice's first chunk, which carries the prompt's ids (return_token_ids)."""
        prompt_ids = prompt.token_ids if prompt is not None and self.request.return_token_ids else None
        return sse(ChatCompletionChunk(id=run.request_id, created=self.created, model=self.model,
                                       choices=parts, usage=usage_info, prompt_token_ids=prompt_ids))

    def response(self, run: Run) -> ChatCompletionResponse:
        choices = []
        as_ids, return_ids = self.request.return_tokens_as_token_ids, self.request.return_token_ids
        for c in run.choices:
            message, finish_reason = self.message(c.out)
            choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish_reason,
                                      logprobs=chat_logprobs(self.tokenizer, c.out.logprobs, as_ids)
                                      if self.request.logprobs else None, stop_reason=c.out.stop_reason,
                                      token_ids=c.out.token_ids if return_ids else None))
        prompt_lps = None
        if self.request.prompt_logprobs is not None:
            prompt_lps = prompt_logprobs(self.tokenizer, run.choices[0].out.prompt_logprobs)
        return ChatCompletionResponse(id=run.request_id, created=self.created, model=self.model, choices=choices,
                                      usage=usage(run.choices, self.num_output_tokens), prompt_logprobs=prompt_lps,
                                      prompt_token_ids=run.choices[0].prompt.token_ids if return_ids else None)


Format = CompletionFormat | ChatFormat | ResponsesFormat


def delta_tool_call(piece: CallDelta) -> DeltaToolCall:
    if piece.id is None:
        return DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments))
    return DeltaToolCall(index=piece.index, id=piece.id, type="function",
                         function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments))


def tool_finish_reason(finish_reason: str, calls: list[ToolCall]) -> str:
    """"tool_calls" for an answer that ended on its own with calls, as vLLM and OpenAI say it."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


class OpenAIServing:
    """The endpoints' handlers, over one node and its served model name."""

    def __init__(self, node: DecodeNode, served_model_name: str, tool_options: ToolOptions, log_requests: bool,
                 sampling: ServerSamplingOptions):
        self.node = node
        self.model = served_model_name
        self.tool_options = tool_options
        self.sampling = sampling  # --generation-config defaults, --max-logprobs
        self.log_requests = log_requests  # a line as each request starts and ends
        self.num_requests = 0  # in flight, for /load
        self.responses_store = ResponseStore()  # /v1/responses kept for previous_response_id and GET

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{self.model}` "
                                "(see /v1/models).", param="model", code="model_not_found")

    def check_prompt_chars(self, prompt: str, param: str) -> None:
        """A prompt too long to fit the context whatever its tokens: refused before it is tokenized,
        in the words of check_context_length, so that clients know it for the same error."""
        max_model_len = self.node.max_model_len
        limit = max_model_len * MAX_PROMPT_CHARS_PER_TOKEN
        if len(prompt) > limit:
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                                f"{param} ({len(prompt)} characters) cannot fit in that many tokens (this server "
                                f"takes at most {limit} characters, {MAX_PROMPT_CHARS_PER_TOKEN} a token). Please "
                                f"reduce the length of the {param}.", param=param, code=ContextLengthError.code)

    # Tokenizing and templating run in worker threads (the tokenizer lets go of the GIL while it
    # works): a long prompt must not hold up the event loop, which answers /health and streams tokens.
    # Token ids are only checked (and decoded for echo): up to INLINE_TOKEN_IDS of them on the loop.
    async def tokenize_prompt(self, prompt: str | list[int], echo: bool) -> Prompt:
        """`echo`: the prompt's text is sent back, so token ids are decoded to it (else its text is "")."""
        if isinstance(prompt, list):
            if len(prompt) >= self.node.max_model_len:  # check_context_length refuses it, in its words
                return Prompt(prompt, "")

            def check_and_decode() -> str:
                self.node.engine.validate_prompt(prompt)
                return self.node.tokenizer.decode(prompt, skip_special_tokens=False) if echo else ""

            try:  # ids outside the vocabulary are bad input, and the tokenizer cannot decode them
                return Prompt(prompt, await on_loop_if(len(prompt) <= INLINE_TOKEN_IDS, check_and_decode))
            except ValueError as e:
                raise APIError(400, str(e), param="prompt") from e
        self.check_prompt_chars(prompt, "prompt")
        return Prompt(await asyncio.to_thread(self.node.tokenizer.encode, prompt), prompt)

    async def render_chat(self, messages: list[ChatMessage], tools: list[dict] | None,
                          options: ChatTemplateFields) -> str:
        try:
            options.check_chat_template()
        except ValueError as e:
            raise api_error_from(e) from e

        def render() -> str:
            return self.node.tokenizer.apply_chat_template(
                [m.to_template() for m in messages], options.add_generation_prompt, tools,
                continue_final_message=options.continue_final_message, template_kwargs=options.chat_template_kwargs)

        try:
            text = await asyncio.to_thread(render)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        self.check_prompt_chars(text, "messages")
        return text

    async def completions(self, raw_request: Request) -> Response | BaseModel:
        request = await read_request(CompletionRequest, raw_request)
        self.check_model(request.model)
        try:
            request.check_supported()  # n times the prompts, before any is tokenized
        except ValueError as e:
            raise request_error(request, e) from e
        prompts = [await self.tokenize_prompt(p, request.echo) for p in request.prompts]
        longest = max(len(p.token_ids) for p in prompts)
        try:
            params = request.to_sampling_params(max(1, self.node.max_model_len - longest), self.sampling)
            check_context_length(self.node.max_model_len, longest, params.max_tokens, request)
        except ValueError as e:
            raise request_error(request, e) from e
        fmt = CompletionFormat(request, self.node.tokenizer, self.model)
        return await self.serve(request, raw_request, "cmpl", prompts, params, fmt)

    async def chat(self, raw_request: Request) -> Response | BaseModel:
        request = await read_request(ChatCompletionRequest, raw_request)
        return await self.serve_chat(request, raw_request, "chatcmpl", lambda fmt: fmt)

    async def serve_chat(self, request: ChatCompletionRequest, raw_request: Request, prefix: str,
                         wrap: Callable[[ChatFormat], Format]) -> Response | BaseModel:
        """Chat and the Responses API built on it (`wrap` turns chat's formatter into the endpoint's)."""
        self.check_model(request.model)
        if request.tool_mode == "auto":
            try:
                self.tool_options.check_auto()
            except ValueError as e:
                raise APIError(400, str(e), param="tool_choice") from e
        text = await self.render_chat(request.messages, request.template_tools, request)
        # The rendered template already holds the special tokens (BOS included) it wants.
        prompt = Prompt(await asyncio.to_thread(self.node.tokenizer.encode, text, add_special_tokens=False), text)
        try:
            params = request.to_sampling_params(max(1, self.node.max_model_len - len(prompt.token_ids)),
                                                self.sampling)
            check_context_length(self.node.max_model_len, len(prompt.token_ids), params.max_tokens, request)
        except ValueError as e:
            raise request_error(request, e) from e
        tools = tool_parser(request.tool_mode, request.tool_choice, request.tools, request.parallel_tool_calls,
                            self.tool_options)
        if tools is not None and tools.keeps_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)  # the calls' marker is one (vLLM's)
        reasoning = None
        if self.tool_options.reasoning_parser is not None:
            reasoning = ReasoningParser.for_prompt(self.tool_options.reasoning_parser, text)
            if reasoning.in_reasoning and params.structured is not None:
                # As vLLM: the grammar holds the answer only, from the reasoning's end on.
                end = tuple(self.node.tokenizer.encode(THINK_END, add_special_tokens=False))  # 8 characters
                params = dataclasses.replace(params, structured=dataclasses.replace(params.structured,
                                                                                    after_tokens=end))
        fmt = wrap(ChatFormat(request, self.node.tokenizer, self.model, tools, reasoning))
        return await self.serve(request, raw_request, prefix, [prompt], params, fmt)

    async def responses(self, raw_request: Request) -> Response | BaseModel:
        """/v1/responses: the request as a chat request (with the conversation of previous_response_id),
        served by the chat path; its 400s name the Responses API's fields."""
        request = await read_request(ResponsesRequest, raw_request)
        conversation = []
        if request.previous_response_id is not None:
            stored = self.responses_store.get(request.previous_response_id)
            if stored is None:
                raise APIError(404, f"Response with id '{request.previous_response_id}' not found.",
                               param="previous_response_id", code="response_not_found")
            conversation = stored.conversation
        try:
            chat = await asyncio.to_thread(request.to_chat, conversation)
            return await self.serve_chat(chat, raw_request, "resp",
                                         lambda fmt: ResponsesFormat(request, chat, fmt, self.responses_store))
        except ValidationError as e:
            raise APIError(400, *validation_problems(e.errors(include_url=False))).renamed(RESPONSES_PARAMS) from None
        except ValueError as e:
            raise api_error_from(e).renamed(RESPONSES_PARAMS) from e
        except APIError as e:
            raise e.renamed(RESPONSES_PARAMS) from None

    async def retrieve_response(self, response_id: str) -> ResponseObject:
        stored = self.responses_store.get(response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", code="response_not_found")
        return stored.response

    async def serve(self, request: SamplingFields, raw_request: Request, prefix: str, prompts: list[Prompt],
                    params: SamplingParams, fmt: Format) -> Response | BaseModel:
        """The path completions and chat share: validate, start every choice, stream or answer."""
        def validate() -> None:  # each prompt's ids are scanned; the first compiles the grammar, if any
            for prompt in prompts:
                self.node.engine.validate(prompt.token_ids, params)

        # A grammar takes up to ~0.15 s to compile (once per distinct one): never on the event loop. The
        # rest scans the prompts' ids and logit_bias's. Bad is a 400.
        scanned = sum(len(p.token_ids) for p in prompts) + len(params.logit_bias)
        small = params.structured is None and scanned <= INLINE_TOKEN_IDS
        try:
            await on_loop_if(small, validate)
        except ValueError as e:
            raise request_error(request, e) from e
        # A router sets X-Request-Id so that one request can be followed through the router's and
        # this node's logs (and, by this node's own id for it, the prefill node's).
        request_id = request_label(raw_request.headers.get("x-request-id"), prefix)
        raw_request.state.request_id = request_id  # RequestIdHeader answers with it
        run = Run(self.node, request_id, prompts, params, request.num_candidates, request.prefill_policy, raw_request,
                  self.log_requests, request.n)
        self.num_requests += 1
        try:
            await run.start()
        except ClientDisconnected:
            self.num_requests -= 1
            return Response(status_code=STATUS_CLIENT_CLOSED)
        except APIError:
            self.num_requests -= 1
            raise
        if request.stream:
            return StreamingResponse(self.events(run, fmt, request), media_type="text/event-stream")
        try:
            await run.finish()
            run.keep_best(len(prompts), request.n)
        except ClientDisconnected:
            return Response(status_code=STATUS_CLIENT_CLOSED)
        except Exception as e:
            raise api_error_from(e) from e
        finally:
            await run.close()
            self.num_requests -= 1
        return fmt.response(run)

    async def events(self, run: Run, fmt: Format, request: SamplingFields) -> AsyncIterator[str]:
        marked = False  # the first event's mark, for a profiler's timeline
        try:
            async for choice in run.outputs():
                opening = not choice.started
                parts = (fmt.first(choice) if opening else []) + fmt.delta(choice)
                choice.started = True
                if not marked:
                    mark("disagg.api.first_event")
                    marked = True
                for i, part in enumerate(parts):
                    # vLLM's continuous usage: this choice's prompt and its output so far.
                    usage_info = usage([choice], fmt.num_output_tokens) if request.continuous_usage else None
                    yield fmt.chunk(run, [part], usage_info, choice.prompt if opening and i == 0 else None)
            if request.include_usage:
                yield fmt.chunk(run, [], usage(run.choices, fmt.num_output_tokens))
        except ClientDisconnected:
            return
        except Exception as e:  # noqa: BLE001  the stream started: the error goes to the client as an event
            yield stream_error(e)
        finally:
            await run.close()
            self.num_requests -= 1
        if not isinstance(fmt, ResponsesFormat):  # Responses streams end with their last event (OpenAI's, vLLM's)
            yield SSE_DONE

    async def tokenize(self, raw_request: Request) -> TokenizeResponse:
        request = await read_request(TokenizeRequest, raw_request)
        self.check_model(request.model)
        if request.messages is not None:
            text = await self.render_chat(request.messages, request.tools, request)
            add_special_tokens = bool(request.add_special_tokens)  # the template has its own
        else:
            self.check_prompt_chars(request.prompt, "prompt")
            text = request.prompt
            add_special_tokens = request.add_special_tokens is not False
        def encode() -> TokenizeResponse:
            ids = self.node.tokenizer.encode(text, add_special_tokens)
            strs = self.node.tokenizer.token_strings(ids) if request.return_token_strs else None
            return TokenizeResponse(count=len(ids), max_model_len=self.node.max_model_len, tokens=ids,
                                    token_strs=strs)

        return await asyncio.to_thread(encode)

    async def detokenize(self, raw_request: Request) -> DetokenizeResponse:
        request = await read_request(DetokenizeRequest, raw_request)
        self.check_model(request.model)
        vocab = self.node.tokenizer.vocab_size

        def decode() -> DetokenizeResponse:
            bad = [t for t in request.tokens if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"tokens must be token ids in [0, {vocab}), got {bad[:5]}", param="tokens")
            return DetokenizeResponse(prompt=self.node.tokenizer.decode(request.tokens, skip_special_tokens=False))

        return await asyncio.to_thread(decode)


# A hop into a worker thread and back costs a request 0.1-0.5 ms (a wake-up each way, the GIL handed
# over twice), more than parsing and checking a small request does on the event loop, and work in
# Python holds the GIL in either thread; so small work runs on the loop. Bounds, on a CPU core: a
# body of 8 KiB parses in under 3 ms at worst (hostile: 240 empty Responses input messages; 0.1 ms for
# a 512-token prompt's ids), and 2,048 token ids are checked and decoded (echo) in 0.3 ms.
INLINE_BODY_BYTES = 8 * 1024
INLINE_TOKEN_IDS = 2048


async def on_loop_if(small: bool, fn: Callable[[], T]) -> T:
    """fn() on the event loop when `small`, else in a worker thread, so that longer work leaves the
    loop its turns (/health, other streams)."""
    return fn() if small else await asyncio.to_thread(fn)


# Parsing and validating a body near --max-request-body-bytes takes tens to hundreds of ms (400,000
# token ids: 100 ms; 100,000 messages: 2.4 s with its errors); on the event loop that would hold
# up /health and every stream, so a body over INLINE_BODY_BYTES is parsed in a worker thread, after
# cheap size limits.
async def read_request(model: type[BaseModel], raw_request: Request) -> BaseModel:
    mark("disagg.api.request")
    body = await raw_request.body()
    return await on_loop_if(len(body) <= INLINE_BODY_BYTES, lambda: parse_request(model, body))


MAX_PROBLEMS = 8  # validation problems named in one 400


def parse_request(model: type[BaseModel], body: bytes) -> BaseModel:
    """The body as `model`, or an APIError 400 saying what is wrong with it."""
    try:
        data = json.loads(body)
    except ValueError as e:  # not JSON, or not UTF-8
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    try:
        check_request_size(data)
        check_unicode(body, data)
        return model.model_validate(data)
    except ValidationError as e:
        raise APIError(400, *validation_problems(e.errors(include_url=False))) from None
    except ValueError as e:
        raise api_error_from(e) from None


def validation_problems(errors: list[dict]) -> tuple[str, str | None]:
    """A 400's message and param (the field, when only one is wrong) from pydantic's errors."""
    problems, params = [], []
    for err in errors:
        loc = [str(part) for part in err["loc"] if part != "body"]
        if err["type"] == "json_invalid":
            problems.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
            continue
        field = ".".join(loc)
        if field:
            params.append(field)
        problems.append(f"{field}: {err['msg']}" if field else err["msg"])
    if len(problems) > MAX_PROBLEMS:
        problems = problems[:MAX_PROBLEMS] + [f"and {len(problems) - MAX_PROBLEMS} more"]
    return "; ".join(problems), params[0] if len(params) == 1 else None


async def on_api_error(_: Request, e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, e.param, e.code)


async def on_unexpected_error(request: Request, e: Exception) -> JSONResponse:
    # A bug, not bad input; uvicorn logs the traceback. This answer is sent from outside every
    # middleware (Starlette's ServerErrorMiddleware), so it adds the request id RequestIdHeader would.
    return error_response(500, f"internal server error: {e!r}",
                          headers={"x-request-id": response_request_id(request.scope)})


def response_request_id(scope: Scope) -> str:
    """The id a response is labelled with: the one its handler gave the request (chat and completions:
    the id in the body), else the client's X-Request-Id, else a fresh one."""
    state = scope.setdefault("state", {})
    if "request_id" not in state:
        state["request_id"] = request_label(Headers(scope=scope).get("x-request-id"), "req")
    return state["request_id"]


class RequestIdHeader:
    """Every response carries X-Request-Id (response_request_id), as vLLM's with
    --enable-request-id-headers, so a client can quote it and find the request in the node's logs.
    A plain ASGI middleware, as serving.py's, so that streamed responses pass through untouched."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = response_request_id(scope)
            await send(message)

        await self.app(scope, receive, send_with_id)


async def on_validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    """OpenAI and vLLM answer 400 for a malformed request; FastAPI's default would be 422."""
    return error_response(400, *validation_problems(e.errors()))


BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def body_schema(path: str) -> dict:
    """The OpenAPI request body of an endpoint that parses its own (read_request), for /docs and the fuzzers."""
    ref = {"$ref": f"#/components/schemas/{BODIES[path].__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def add_body_schemas(app: FastAPI) -> None:
    """Puts the models of BODIES into /openapi.json's components, where body_schema points."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            _, defs = models_json_schema([(model, "validation") for model in BODIES.values()],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        return app.openapi_schema

    app.openapi = openapi


def build_app(node: DecodeNode, options: HTTPOptions, served_model_name: str,
              tool_options: ToolOptions | None = None, log_requests: bool = False,
              sampling: ServerSamplingOptions | None = None) -> FastAPI:
    app = make_app("disagg", options, error_response)
    app.add_middleware(RequestIdHeader)  # added last, so it wraps the API key and body limit refusals too
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected_error)  # make_app's, with the request id

    serving = OpenAIServing(node, served_model_name, tool_options or ToolOptions(), log_requests,
                            sampling or ServerSamplingOptions())
    add_body_schemas(app)
    app.add_api_route("/v1/completions", serving.completions, methods=["POST"], response_model=None,
                      openapi_extra=body_schema("/v1/completions"))
    app.add_api_route("/v1/chat/completions", serving.chat, methods=["POST"], response_model=None,
                      openapi_extra=body_schema("/v1/chat/completions"))
    app.add_api_route("/v1/responses", serving.responses, methods=["POST"], response_model=None,
                      openapi_extra=body_schema("/v1/responses"))
    app.add_api_route("/v1/responses/{response_id}", serving.retrieve_response, methods=["GET"])
    # vLLM serves these at the root, not under /v1.
    app.add_api_route("/tokenize", serving.tokenize, methods=["POST"], openapi_extra=body_schema("/tokenize"))
    app.add_api_route("/detokenize", serving.detokenize, methods=["POST"], openapi_extra=body_schema("/detokenize"))

    def model_card() -> ModelCard:
        # Absolute: `disagg router` without --tokenizer hashes prompts with the tokenizer found there.
        return ModelCard(id=served_model_name, root=str(node.engine.model_dir.absolute()),
                         tokenizer=str(node.tokenizer.json_path.parent.absolute()), max_model_len=node.max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}")  # a path: a Hub id served as its name has a slash (ORG/NAME)
    async def model(model_id: str) -> ModelCard:
        serving.check_model(model_id)
        return model_card()

    @app.api_route("/health", methods=["GET"])
    @app.api_route("/ping", methods=["GET", "POST"])  # SageMaker's (and vLLM's) health check
    async def health() -> JSONResponse:
        status = node.health()
        return JSONResponse(status, status_code=200 if status.get("status") == "ok" else 503)

    @app.get("/kv_events")  # for `disagg router --routing cache_aware` (kv_events.py)
    async def kv_events(request: Request) -> StreamingResponse:
        return await kv_events_response(node.engine, request)

    @app.get("/load")
    async def load() -> dict:
        return {"server_load": serving.num_requests}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        node.update_gauges()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version_info() -> dict:
        return {"version": app.version}

    add_profiler_routes(app, node.engine)
    return app
