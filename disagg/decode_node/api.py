"""The OpenAI HTTP API of a decode (or colocated) node: completions, chat, models, health, metrics.

Every error answers in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the
status vLLM gives it: 400 bad input (validation included, never FastAPI's 422), 401 bad key,
404 unknown model, 413 a body over --max-request-body-bytes, 500 a request the engine failed,
503 prefill node unavailable under the "fail" policy.

A streamed request waits for its first output before the response starts, so the errors that
come before the first token (prefill unavailable, bad input) keep their HTTP status; an error
after that is sent as an error event, then [DONE].
"""

import asyncio
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from disagg import metrics
from disagg.decode_node.node import DecodeNode, PrefillUnavailable
from disagg.decode_node.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    UsageInfo,
)
from disagg.engine.output import RequestOutput
from disagg.engine.sampling_params import SamplingParams
from disagg.engine.sequence import TokenLogprob
from disagg.engine.tokenizer import Tokenizer
from disagg.serving import APIKeyMiddleware, BodyLimitMiddleware

logger = logging.getLogger(__name__)

STATUS_CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, the metrics do


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


class ClientDisconnected(Exception):
    """The client closed the connection before the request finished; it was aborted."""


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> ErrorResponse:
    if status == 401:
        kind = "authentication_error"
    elif status < 500:
        kind = "invalid_request_error"
    else:
        kind = "server_error"
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code))


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    metrics.REQUEST_ERRORS.labels(str(status)).inc()
    return JSONResponse(error_body(status, message, param, code).model_dump(), status_code=status)


def api_error_from(error: Exception) -> APIError:
    """The HTTP status of an exception out of the node."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, ValueError):
        return APIError(400, str(error), param=getattr(error, "param", None))  # SamplingParamError names it
    if isinstance(error, PrefillUnavailable):
        return APIError(503, f"{error}; retry, or send prefill_policy \"recompute\" to let the decode node "
                             "compute the prompt itself")
    logger.error("request failed", exc_info=error)
    return APIError(500, f"the server failed while generating: {error}")


class Generation:
    """One request's run through the node: its outputs, its metrics and its two log lines.

    node.generate runs in an asyncio task of its own. Starlette stops a streamed response (the
    client went away) by cancelling an anyio scope, which cancels every await inside it again
    and again and would cut the node's cleanup — the abort on both nodes — short; cancelling
    this task is one asyncio cancellation, so the node's `finally` runs to its end. A second
    task waits for the client's disconnect, which nothing else notices for a request that is
    not streamed."""

    def __init__(self, node: DecodeNode, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prefill_policy: str | None, raw_request: Request):
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self.start = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.last: RequestOutput | None = None
        self.error: Exception | None = None
        self.queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.aborting = False
        logger.info("%s started: %d prompt tokens, max_tokens %d", request_id, self.num_prompt_tokens,
                    params.max_tokens)
        self.pump = asyncio.create_task(self._pump(node.generate(request_id, prompt_token_ids, params, prefill_policy)))
        self.watcher = asyncio.create_task(self._watch(raw_request))

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

    async def _watch(self, raw_request: Request) -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass
        self.abort()

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

    async def final(self) -> RequestOutput:
        out = await self.next()
        while not out.finished:
            out = await self.next()
        return out

    async def close(self) -> None:
        """Abort the request if it is still running (and wait until it is), then log and count how it ended."""
        self.watcher.cancel()
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
        ttft = "-" if self.first_token_at is None else f"{self.first_token_at - self.start:.3f}s"
        logger.info("%s finished: %d prompt tokens, %d output tokens, finish reason %s, TTFT %s, E2E %.3fs",
                    self.request_id, self.num_prompt_tokens, len(self.last.token_ids) if self.last else 0,
                    outcome, ttft, time.perf_counter() - self.start)


MAX_REQUEST_ID_CHARS = 128
# Real text averages about 4 characters a token; a prompt over max_model_len times this many
# characters cannot fit, and is refused before it is tokenized.
MAX_PROMPT_CHARS_PER_TOKEN = 32


def request_id_for(raw_request: Request, prefix: str) -> str:
    """The client's X-Request-Id, or a fresh `prefix-<hex>`. A router sets the header so that one
    request can be followed through the router's, this node's and the prefill node's logs."""
    given = raw_request.headers.get("x-request-id")
    if not given:
        return f"{prefix}-{uuid.uuid4().hex}"
    if len(given) > MAX_REQUEST_ID_CHARS or not given.isprintable():
        raise APIError(400, f"the X-Request-Id header must be at most {MAX_REQUEST_ID_CHARS} printable characters "
                            f"(got {len(given)}); send a shorter id or none")
    return given


def usage(out: RequestOutput) -> UsageInfo:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    # Special tokens keep their names, so that distinct tokens stay distinct keys in top_logprobs.
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    """Completions' format; `offset` is the text_offset of the first token (where the text sent so far ends)."""
    result = CompletionLogprobs()
    for lp in logprobs:
        token = token_text(tokenizer, lp.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(lp.logprob)
        result.top_logprobs.append({token_text(tokenizer, t): logprob for t, logprob in lp.top})
        result.text_offset.append(offset)
        offset += len(token)
    return result


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> ChatTopLogprob:
        token = token_text(tokenizer, token_id)
        return ChatTopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

    return ChatLogprobs(content=[
        ChatTokenLogprob(**top(lp.token_id, lp.logprob).model_dump(), top_logprobs=[top(t, l) for t, l in lp.top])
        for lp in logprobs])


def sse(event: BaseModel) -> str:
    return f"data: {event.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_error(error: Exception) -> str:
    """The error event of a stream that already started: OpenAI's error shape, as vLLM sends it."""
    api_error = api_error_from(error)
    metrics.REQUEST_ERRORS.labels(str(api_error.status)).inc()
    return sse(error_body(api_error.status, api_error.message, api_error.param, api_error.code))


def build_app(node: DecodeNode, api_key: str | None, served_model_name: str, max_request_body_bytes: int) -> FastAPI:
    version = importlib.metadata.version("disagg")
    app = FastAPI(title="disagg", version=version)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes, error_response=error_response)
    if api_key:  # added last, so it runs first: a request without the key is refused before its body is read
        app.add_middleware(APIKeyMiddleware, api_key=api_key, error_response=error_response)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        # OpenAI and vLLM answer 400 for a malformed request; FastAPI's default would be 422.
        problems, params = [], []
        for err in e.errors():
            loc = [str(part) for part in err["loc"] if part != "body"]
            if err["type"] == "json_invalid":
                problems.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
                continue
            field = ".".join(loc)
            if field:
                params.append(field)
            msg = "unknown field; this server does not support it" if err["type"] == "extra_forbidden" else err["msg"]
            problems.append(f"{field}: {msg}" if field else msg)
        return error_response(400, "; ".join(problems), param=params[0] if len(params) == 1 else None)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def on_unexpected_error(_: Request, e: Exception) -> JSONResponse:
        # A bug, not bad input; uvicorn logs the traceback.
        return error_response(500, f"internal server error: {e!r}")

    def check_model(model: str | None) -> None:
        if model is not None and model != served_model_name:
            raise APIError(404, f"The model `{model}` does not exist. This server serves `{served_model_name}` "
                                "(see /v1/models).", param="model", code="model_not_found")

    def check_prompt_chars(prompt: str, param: str) -> None:
        limit = node.max_model_len * MAX_PROMPT_CHARS_PER_TOKEN
        if len(prompt) > limit:
            raise APIError(400, f"the prompt has {len(prompt)} characters; this server takes at most {limit} "
                                f"({MAX_PROMPT_CHARS_PER_TOKEN} per token of max_model_len={node.max_model_len}), "
                                "since a longer prompt cannot fit the context", param=param)

    # Tokenizing and templating run in worker threads (the tokenizer lets go of the GIL while it
    # works): a long prompt must not hold up the event loop, which answers /health and streams tokens.
    async def tokenize_prompt(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        check_prompt_chars(prompt, "prompt")
        return await asyncio.to_thread(node.tokenizer.encode, prompt)

    async def tokenize_chat(messages: list[dict]) -> list[int]:
        prompt = await asyncio.to_thread(node.tokenizer.apply_chat_template, messages)
        check_prompt_chars(prompt, "messages")
        # The rendered template already holds the special tokens (BOS included) it wants.
        return await asyncio.to_thread(node.tokenizer.encode, prompt, add_special_tokens=False)

    async def start(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prefill_policy: str | None, raw_request: Request) -> tuple[Generation, RequestOutput]:
        """Validate, start the request, and wait for its first output (errors before it keep their status)."""
        try:
            node.validate(prompt_token_ids, params)
        except ValueError as e:
            raise api_error_from(e) from e
        generation = Generation(node, request_id, prompt_token_ids, params, prefill_policy, raw_request)
        try:
            return generation, await generation.next()
        except ClientDisconnected:
            await generation.close()
            raise
        except Exception as e:
            await generation.close()
            raise api_error_from(e) from e

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served_model_name, max_model_len=node.max_model_len)])

    @v1.post("/completions", response_model=None)
    async def completions(request: CompletionRequest, raw_request: Request) -> Response | CompletionResponse:
        check_model(request.model)
        prompt_ids = await tokenize_prompt(request.prompt)
        try:
            params = request.to_sampling_params(default_max_tokens=max(1, node.max_model_len - len(prompt_ids)))
        except ValueError as e:
            raise api_error_from(e) from e
        request_id = request_id_for(raw_request, "cmpl")
        try:
            generation, first = await start(request_id, prompt_ids, params, request.prefill_policy, raw_request)
        except ClientDisconnected:
            return Response(status_code=STATUS_CLIENT_CLOSED)
        if request.stream:
            return StreamingResponse(completion_events(generation, first, request, params),
                                     media_type="text/event-stream")
        try:
            out = first if first.finished else await generation.final()
        except ClientDisconnected:
            return Response(status_code=STATUS_CLIENT_CLOSED)
        except Exception as e:
            raise api_error_from(e) from e
        finally:
            await generation.close()
        logprobs = None if params.logprobs is None else completion_logprobs(node.tokenizer, out.logprobs, 0)
        return CompletionResponse(id=request_id, model=served_model_name, usage=usage(out), choices=[
            CompletionChoice(text=out.text, logprobs=logprobs, finish_reason=out.finish_reason,
                             stop_reason=out.stop_reason)])

    async def completion_events(generation: Generation, first: RequestOutput, request: CompletionRequest,
                                params: SamplingParams) -> AsyncIterator[str]:
        created = int(time.time())
        offset = 0  # text_offset of the next token's logprobs
        num_logprobs_sent = 0
        try:
            out = first
            while True:
                logprobs = None
                if params.logprobs is not None:
                    logprobs = completion_logprobs(node.tokenizer, out.logprobs[num_logprobs_sent:], offset)
                    num_logprobs_sent = len(out.logprobs)
                    offset += sum(len(t) for t in logprobs.tokens)
                if out.new_text or out.finished or (logprobs and logprobs.tokens):
                    yield sse(CompletionStreamResponse(id=generation.request_id, created=created, model=served_model_name,
                                                       choices=[CompletionChoice(
                                                           text=out.new_text, logprobs=logprobs,
                                                           finish_reason=out.finish_reason if out.finished else None,
                                                           stop_reason=out.stop_reason)]))
                if out.finished:
                    break
                out = await generation.next()
            if request.stream_options and request.stream_options.include_usage:
                yield sse(CompletionStreamResponse(id=generation.request_id, created=created, model=served_model_name,
                                                   choices=[], usage=usage(out)))
        except ClientDisconnected:
            return
        except Exception as e:  # noqa: BLE001  the stream started: the error goes to the client as an event
            yield stream_error(e)
        finally:
            await generation.close()
        yield SSE_DONE

    @v1.post("/chat/completions", response_model=None)
    async def chat_completions(request: ChatCompletionRequest,
                               raw_request: Request) -> Response | ChatCompletionResponse:
        check_model(request.model)
        try:
            prompt_ids = await tokenize_chat([m.to_template() for m in request.messages])
            params = request.to_sampling_params(default_max_tokens=max(1, node.max_model_len - len(prompt_ids)))
        except ValueError as e:
            raise api_error_from(e) from e
        request_id = request_id_for(raw_request, "chatcmpl")
        try:
            generation, first = await start(request_id, prompt_ids, params, request.prefill_policy, raw_request)
        except ClientDisconnected:
            return Response(status_code=STATUS_CLIENT_CLOSED)
        if request.stream:
            return StreamingResponse(chat_events(generation, first, request, params), media_type="text/event-stream")
        try:
            out = first if first.finished else await generation.final()
        except ClientDisconnected:
            return Response(status_code=STATUS_CLIENT_CLOSED)
        except Exception as e:
            raise api_error_from(e) from e
        finally:
            await generation.close()
        logprobs = None if params.logprobs is None else chat_logprobs(node.tokenizer, out.logprobs)
        return ChatCompletionResponse(id=request_id, model=served_model_name, usage=usage(out), choices=[
            ChatChoice(message=ChatResponseMessage(content=out.text), logprobs=logprobs,
                       finish_reason=out.finish_reason, stop_reason=out.stop_reason)])

    async def chat_events(generation: Generation, first: RequestOutput, request: ChatCompletionRequest,
                          params: SamplingParams) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatStreamChoice], usage_info: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=generation.request_id, created=created, model=served_model_name,
                                           choices=choices, usage=usage_info))

        num_logprobs_sent = 0
        try:
            yield chunk([ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))])
            out = first
            while True:
                logprobs = None
                if params.logprobs is not None:
                    logprobs = chat_logprobs(node.tokenizer, out.logprobs[num_logprobs_sent:])
                    num_logprobs_sent = len(out.logprobs)
                if out.new_text or out.finished or (logprobs and logprobs.content):
                    yield chunk([ChatStreamChoice(delta=DeltaMessage(content=out.new_text), logprobs=logprobs,
                                                  finish_reason=out.finish_reason if out.finished else None,
                                                  stop_reason=out.stop_reason)])
                if out.finished:
                    break
                out = await generation.next()
            if request.stream_options and request.stream_options.include_usage:
                yield chunk([], usage(out))
        except ClientDisconnected:
            return
        except Exception as e:  # noqa: BLE001  the stream started: the error goes to the client as an event
            yield stream_error(e)
        finally:
            await generation.close()
        yield SSE_DONE

    app.include_router(v1)

    @app.get("/health")
    async def health() -> JSONResponse:
        status = node.health()
        return JSONResponse(status, status_code=200 if status.get("status") == "ok" else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        node.update_gauges()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version_info() -> dict:
        return {"version": version}

    return app
