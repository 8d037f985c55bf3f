"""AsyncEngine: the engine's step loop in a thread, and a stream of outputs per request for asyncio code.

The servers are asyncio programs; the engine is plain synchronous code. One thread owns the
engine: it runs `step()` while there is work and sleeps otherwise, and every call from asyncio
code (add, abort, load remote KV) is queued to that thread and runs between two steps, so a call
waits at most one step and the event loop never waits on a step. (A lock shared with worker
threads starved them: the loop thread re-took it right after each step, and an abort could wait
seconds while the request kept its blocks.)

A request the engine fails (its sampling, or its step's forward, raised) ends with RequestFailed
for whoever waits on it, and is counted; the other requests go on.
"""

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

import torch

from disagg import metrics
from disagg.engine.engine import LLMEngine
from disagg.engine.output import RequestOutput
from disagg.engine.sampling_params import SamplingParams
from disagg.engine.sequence import KVExport, TokenLogprob

logger = logging.getLogger(__name__)

TIERS_LOG_INTERVAL = 5.0  # seconds between KV tier summaries in the log, while busy


class EngineDeadError(RuntimeError):
    """The engine loop failed; requests it held cannot finish."""


class RequestAborted(RuntimeError):
    """The request was aborted while someone still waited for its outputs."""


class RequestFailed(RuntimeError):
    """The engine failed this request (its sampling or its step's forward raised); the others go on."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.calls: queue.SimpleQueue[tuple[Callable, tuple, dict, concurrent.futures.Future]] = queue.SimpleQueue()
        self.wakeup = threading.Event()
        # Request id -> where its outputs go. Read and written on the engine thread only, so a
        # request's outputs can never reach another request's stream, whatever ids callers reuse.
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Remote requests whose first token finish_remote_prefill already put on their stream.
        self.first_token_sent: set[str] = set()  # engine thread only
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped = True
        self.wakeup.set()
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.engine.close()  # disk writes in flight finish, so a restart finds them

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       kv_export: KVExport | None = None, remote_prefill: bool = False) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes. Raises ValueError for bad input
        before the first output. Closing the iterator early (a client went away) aborts it."""
        queue = await self.add_request(request_id, prompt_token_ids, params,
                                       kv_export=kv_export, remote_prefill=remote_prefill)
        async with contextlib.aclosing(self.stream(request_id, queue)) as outputs:
            async for out in outputs:
                yield out

    async def stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The outputs of a request added with add_request, until it finishes."""
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finished
                if out.error is not None:
                    raise RequestFailed(f"the engine failed request {request_id}: {out.error}")
                yield out
        finally:
            if not finished:
                # Shielded: a second cancellation (servers cancel repeatedly) must not lose the abort.
                await asyncio.shield(self._call(self._drop, request_id, None))

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                          kv_export: KVExport | None = None, remote_prefill: bool = False) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        await self._call(self._add, request_id, prompt_token_ids, params, (asyncio.get_running_loop(), queue),
                         kv_export=kv_export, remote_prefill=remote_prefill)
        return queue

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             stream: tuple[asyncio.AbstractEventLoop, asyncio.Queue], **kwargs) -> None:
        """On the engine thread: the request and its stream, together."""
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.engine.add_request(request_id, prompt_token_ids, params, **kwargs)
        self.streams[request_id] = stream

    def _drop(self, request_id: str, error: Exception | None) -> bool:
        """On the engine thread: abort the request; its stream gets `error`, or nothing more."""
        found = self.engine.abort_request(request_id)
        self.first_token_sent.discard(request_id)
        if error is None:
            self.streams.pop(request_id, None)
        else:
            self._deliver(request_id, error)
        return found

    async def abort(self, request_id: str) -> bool:
        return await self.fail(request_id, RequestAborted(f"request {request_id} was aborted"))

    async def fail(self, request_id: str, error: Exception) -> bool:
        """Drop the request from the engine; whoever waits on its outputs gets `error`."""
        return await self._call(self._drop, request_id, error)

    async def finish_remote_prefill(self, request_id: str, queue: asyncio.Queue, kv: torch.Tensor | None,
                                    first_token: int, first_logprob: TokenLogprob | None = None,
                                    kv_start: int = 0) -> None:
        """Put the first token, which came with the KV, on the request's stream (`queue`, from
        add_request) at once, then have the engine thread load the KV between two steps; the
        engine's own output for that token is not sent again (docs/ARCHITECTURE.md, "A request,
        end to end"). kv None: it is in the request's blocks already (LLMEngine.remote_kv_views). Raises
        ValueError for KV or a token that does not fit, before any output."""
        queue.put_nowait(self.engine.remote_first_output(request_id, kv, first_token, first_logprob, kv_start))
        try:
            # Shielded: a request whose first token is out must be loaded (or aborted) in the engine,
            # never left holding its blocks because its caller went away meanwhile.
            await asyncio.shield(self._call(self._load_remote, request_id, kv, first_token, first_logprob, kv_start))
        except Exception as e:
            # Its first token is out: computing the prompt again would send it twice. It ends here.
            await self.fail(request_id, RequestFailed(f"loading the KV of {request_id} failed: {e}"))
            raise

    def _load_remote(self, request_id: str, *args) -> None:
        """On the engine thread."""
        self.engine.finish_remote_prefill(request_id, *args)
        self.first_token_sent.add(request_id)

    async def keep_remote_blocks_aside(self, request_id: str) -> int:
        return await self._call(self.engine.keep_remote_blocks_aside, request_id)

    async def prefill_locally(self, request_id: str) -> None:
        await self._call(self.engine.prefill_locally, request_id)

    async def _call(self, fn, *args, **kwargs):
        """Run fn(*args, **kwargs) on the engine thread before its next step; its result or error."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.calls.put((fn, args, kwargs, future))
        self.wakeup.set()
        return await asyncio.wrap_future(future)

    def _run_calls(self, stopped: Exception | None = None) -> None:
        """Run the queued calls; once the engine is `stopped`, answer each with that error instead."""
        while True:
            try:
                fn, args, kwargs, future = self.calls.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():  # its caller was cancelled before it ran
                continue
            if stopped is not None:
                future.set_exception(stopped)
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001  handed to the caller
                future.set_exception(e)

    def _loop(self) -> None:
        logged = time.monotonic()
        while not self.stopped:
            self._run_calls()
            busy = self.engine.has_work()
            if busy and self.engine.offload is not None and time.monotonic() - logged >= TIERS_LOG_INTERVAL:
                logged = time.monotonic()
                logger.info("%s", self.engine.offload.summary())
            try:
                outputs = self.engine.step() if busy else []
            except Exception as e:
                # step() fails only the requests that a failed forward or sampling concerns; what gets
                # here is a bug outside those (scheduling), after which no request's state can be trusted.
                logger.exception("engine step failed outside the forward and sampling")
                self._fail_all(e)
                outputs = []
            for out in outputs:
                if out.error is not None:
                    metrics.ENGINE_REQUEST_ERRORS.inc()
                self._deliver(out.request_id, out)
            if not busy:
                self.wakeup.wait(timeout=0.5)
                self.wakeup.clear()
        self._run_calls(stopped=EngineDeadError("the engine was stopped"))  # whoever still waits gets an answer

    def _fail_all(self, error: Exception) -> None:
        self.first_token_sent.clear()
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
            metrics.ENGINE_REQUEST_ERRORS.inc()
            self._deliver(request_id, EngineDeadError(f"engine step failed: {error}"))

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        if isinstance(item, RequestOutput) and request_id in self.first_token_sent:
            self.first_token_sent.remove(request_id)
            if item.error is None:  # its stream already has this output (an error it has not)
                if item.finished:
                    self.streams.pop(request_id, None)
                return
        stream = self.streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, Exception) or item.finished:
            self.streams.pop(request_id, None)
        loop, queue = stream
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is left to read it, and its abort is queued
            self.streams.pop(request_id, None)
