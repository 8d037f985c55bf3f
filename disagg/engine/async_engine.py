"""AsyncEngine: the engine's step loop in a thread, and a stream of outputs per request for asyncio code.

The servers are asyncio programs; the engine is plain synchronous code. One thread owns the
engine: it runs `step()` while there is work and sleeps otherwise, and every call from asyncio
code (add, abort, load remote KV) is queued to that thread and runs between two steps, so a call
waits at most one step and the event loop never waits on a step. (A lock shared with worker
threads starved them: the loop thread re-took it right after each step, and an abort could wait
seconds while the request kept its blocks.)

A request the engine fails (its sampling, or its step's forward, raised) ends with RequestFailed
for whoever waits on it, and is counted; the other requests go on.

This is the one door into the engine for the nodes: what they need (validation, grammar compiles,
remote requests and their KV, the engine's gauges, its prefix cache's KV events) is here, and
nothing outside the engine reads `LLMEngine` state; the engine thread publishes what others may
read (`EngineStats`, KV events) after each step, and hands what each turn of its loop did
(`IterationStats`: request times, token counts) to the `stat_loggers`, on its own thread.
"""

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from disagg.engine.engine import LLMEngine
from disagg.engine.kv_events import KVEventPublisher, KVEventSubscription
from disagg.engine.output import RequestOutput
from disagg.engine.prefix_blocks import PrefixBlocks
from disagg.engine.profiler import TorchProfiler
from disagg.engine.remote_prefill import FirstToken, RemoteSlot
from disagg.engine.request_stats import IterationStats, RequestStats
from disagg.engine.sampling_params import SamplingParams, StructuredOutputSpec
from disagg.engine.sequence import KVExport, Sequence, TokenLogprob

logger = logging.getLogger(__name__)

TIERS_LOG_INTERVAL = 5.0  # seconds between KV tier summaries in the log, while busy


class EngineDeadError(RuntimeError):
    """The engine loop failed; requests it held cannot finish."""


class RequestAborted(RuntimeError):
    """The request was aborted while someone still waited for its outputs."""


class RequestFailed(RuntimeError):
    """The engine failed this request (its sampling or its step's forward raised); the others go on."""


@dataclass(frozen=True)
class PrefixWait:
    """A routed request that waited for its prompt's prefix arriving for another request."""
    arriving: int  # prompt tokens after its cached prefix that were arriving when it was added
    saved: int  # how many more leading tokens the prefix cache held for it when the wait ended


@dataclass
class _PrefixWaiter:
    seq: Sequence
    cached: int  # its prompt's tokens in the prefix cache when it was added
    arriving: int
    ended: concurrent.futures.Future  # (RemoteSlot | None, PrefixWait), set on the engine thread


@dataclass(frozen=True)
class EngineStats:
    """The engine's gauges as of its last step, published by the engine thread for any thread to read."""
    num_running: int = 0
    num_waiting: int = 0  # for blocks, a place, or their KV
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_steps: int = 0  # batches run: a sign of life
    num_request_errors: int = 0  # requests the engine failed (their sampling or forward raised)
    num_preemptions: int = 0
    queued_prompt_tokens: int = 0  # prompt tokens held not computed yet (a decode node's remote ones too)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, profiler: TorchProfiler | None = None):
        self.engine = engine
        self.profiler = profiler  # /start_profile and /stop_profile, when the node was started with one
        # Fixed once the engine is built, so any thread may read them.
        self.tokenizer = engine.tokenizer
        self.model_dir = engine.model_dir
        self.max_model_len = engine.max_model_len
        self.model_config = engine.model_config
        self.device = engine.device
        self.dtype = engine.dtype
        self.block_size = engine.config.block_size
        self.enable_prefix_caching = engine.config.enable_prefix_caching
        # One token's K and V in one layer, of every KV head: a prompt's KV, whatever the nodes' TP.
        self.kv_bytes_per_token_layer = 2 * self.model_config.num_key_value_heads * self.model_config.head_dim * \
            self.dtype.itemsize
        workers = engine.runner.workers
        # Each tensor-parallel rank's KV heads [first, end) and, from rank 1 on, the channel to what the node
        # runs in its process (EngineConfig.rank_service).
        self.kv_heads_by_rank = list(workers.kv_heads) if workers else [engine.runner.model.shard.kv_heads]
        self.rank_channels = list(workers.channels) if workers else []
        self.num_request_errors = 0  # engine thread only; published in stats
        self.stats = self._stats()
        self.request_stats = RequestStats()  # engine thread only
        # Called on the engine thread with each turn's IterationStats (the metrics'): keep them quick.
        self.stat_loggers: list[Callable[[IterationStats], None]] = []
        self.calls: queue.SimpleQueue[tuple[Callable, tuple, dict, concurrent.futures.Future]] = queue.SimpleQueue()
        self.wakeup = threading.Event()
        # Request id -> where its outputs go. Read and written on the engine thread only, so a
        # request's outputs can never reach another request's stream, whatever ids callers reuse.
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Request id -> a routed request waiting for its prefix arriving for another (engine thread only).
        self.prefix_waits: dict[str, _PrefixWaiter] = {}
        self.kv_events = KVEventPublisher(engine.block_manager, engine.offload)  # engine thread only
        self.step_started: float | None = None  # time.monotonic() when the step running began; None between steps
        self.stopped = False
        if engine.runner.workers is not None:
            engine.runner.workers.on_death = self._rank_died
        self.thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self.thread.start()

    @staticmethod
    def _rank_died(reason: str) -> None:
        """A tensor-parallel rank is gone: no step can run again, so the node exits (non-zero) at once, and
        its clients, peers and supervisor (disagg up, the router's health checks) see it gone rather
        than a node that answers and cannot compute."""
        logger.critical("%s: this node exits", reason)
        logging.shutdown()
        os._exit(1)

    def stop(self) -> None:
        self.stopped = True
        self.wakeup.set()
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.engine.close()  # disk writes in flight finish, so a restart finds them

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """LLMEngine.validate: ValueError for a request this engine cannot serve. Any thread; it may
        compile a grammar, so not on an event loop when params.structured is set."""
        self.engine.validate(prompt_token_ids, params)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """LLMEngine.validate_prompt: ValueError for token ids this engine cannot take. Any thread."""
        self.engine.validate_prompt(prompt_token_ids)

    async def compile_grammar(self, spec: StructuredOutputSpec) -> None:
        """Compile (and cache) a grammar off the event loop; ValueError if it is bad. The engine
        thread then finds it cached."""
        await asyncio.to_thread(self.engine.grammars.compile, spec)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       kv_export: KVExport | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes. Raises ValueError for bad input
        before the first output. Closing the iterator early (a client went away) aborts it."""
        queue = await self.add_request(request_id, prompt_token_ids, params, kv_export=kv_export)
        async with contextlib.aclosing(self.stream(request_id, queue)) as outputs:
            async for out in outputs:
                yield out

    async def stream(self, request_id: str, queue: asyncio.Queue, *,
                     abort_on_exit: bool = True) -> AsyncIterator[RequestOutput]:
        """The outputs of a request added with add_request, until it finishes. Left before (the
        caller went away), the request is dropped, unless the caller drops it itself (`drop`) once
        what else writes into its blocks has stopped (abort_on_exit False)."""
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
            if not finished and abort_on_exit:
                # Shielded: a second cancellation (servers cancel repeatedly) must not lose the abort.
                await asyncio.shield(self.drop(request_id))

    def may_hold_block(self, block_hash: int) -> bool:
        """Whether the device prefix cache or the host KV tier (which a remote request's prefix is loaded
        from too) holds a block under `block_hash` now, read on the caller's thread: dict lookups, atomic
        under the GIL but not in step with the engine thread, which may cache or evict the block right
        after. A hint; the engine thread's own lookup decides."""
        offload = self.engine.offload
        return block_hash in self.engine.block_manager.hash_to_block or (offload is not None and
                                                                        block_hash in offload.host)

    async def drop(self, request_id: str) -> bool:
        """Abort the request; its stream gets nothing more. False if it had ended."""
        return await self._call(self._drop, request_id, None)

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                          kv_export: KVExport | None = None) -> asyncio.Queue:
        """Add a request; its outputs come on the queue returned (read them with `stream`)."""
        queue: asyncio.Queue = asyncio.Queue()
        await self._call(self._add, request_id, prompt_token_ids, params, (asyncio.get_running_loop(), queue),
                         kv_export=kv_export)
        return queue

    async def add_routed_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                                 remote: Callable[[int], bool], prefix_wait: float = 0.0
                                 ) -> tuple[asyncio.Queue, RemoteSlot | None, PrefixWait | None]:
        """Add a request whose prompt KV and first token come from a prefill node
        (`finish_remote_prefill`) if `remote(uncached prompt tokens)` says so, with what it holds of
        its KV now (RemoteSlot), else as one computed here (slot None). The prefix cache is looked up
        and the request added in one call on the engine thread: no step runs in between to change
        the cache, and the request waits for one step at most, as any add does.

        If its prompt's next blocks after the cached ones are arriving for another remote request, they
        count as cached for `remote`, and the request waits up to `prefix_wait` seconds (0: not at all)
        for them to land, then hits them: the slot, made then, asks for the rest only. The wait ends
        early if that request ends without them (failed, aborted, recomputed); then its slot is what it
        would have been. PrefixWait says how the wait went."""
        queue: asyncio.Queue = asyncio.Queue()
        slot, waiter = await self._call(self._add_routed, request_id, prompt_token_ids, params,
                                        (asyncio.get_running_loop(), queue), remote, prefix_wait > 0)
        if waiter is None:
            return queue, slot, None
        ended = asyncio.wrap_future(waiter)
        try:
            done, _ = await asyncio.wait({ended}, timeout=prefix_wait)
            if not done:  # the bound passed: go on with what the cache holds now
                await self._call(self._end_prefix_wait, request_id)
            slot, waited = await ended
        except asyncio.CancelledError:
            # Shielded: a second cancellation (servers cancel repeatedly) must not lose the abort.
            await asyncio.shield(self.drop(request_id))
            raise
        return queue, slot, waited

    def _add_routed(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    stream: tuple[asyncio.AbstractEventLoop, asyncio.Queue], remote: Callable[[int], bool],
                    may_wait: bool) -> tuple[RemoteSlot | None, concurrent.futures.Future | None]:
        """On the engine thread: the slot now, or the future its wait ends with."""
        cached, arriving = self.engine.prefix_tokens(prompt_token_ids, params)
        remote_prefill = remote(len(prompt_token_ids) - cached - arriving)
        waits = may_wait and arriving > 0
        seq = self._add(request_id, prompt_token_ids, params, stream, remote_prefill=remote_prefill,
                        wait_for_prefix=waits)
        if waits:
            ended: concurrent.futures.Future = concurrent.futures.Future()
            self.prefix_waits[request_id] = _PrefixWaiter(seq, cached, arriving, ended)
            return None, ended
        return (self.engine.remote_slot(request_id) if remote_prefill else None), None

    def _end_prefix_waits(self) -> None:
        """On the engine thread, after a step: end the waits of the requests whose prefix came, or whose
        prefix's request ended without it (they may have got their blocks in that step)."""
        for request_id, waiter in list(self.prefix_waits.items()):
            if not self.engine.waits_for_prefix(waiter.seq):
                self._end_prefix_wait(request_id)

    def _end_prefix_wait(self, request_id: str) -> None:
        """On the engine thread: the request waits no more (ended already: nothing to do)."""
        waiter = self.prefix_waits.pop(request_id, None)
        if waiter is None:
            return
        cached = self.engine.end_prefix_wait(waiter.seq)
        waited = PrefixWait(waiter.arriving, max(0, cached - waiter.cached))
        # A request ended meanwhile (failed, or its engine stopped) has nothing to receive: its stream says why.
        live = waiter.seq.remote and request_id in self.engine.requests
        if waiter.ended.set_running_or_notify_cancel():  # else its caller went away
            waiter.ended.set_result((self.engine.remote_slot(request_id) if live else None, waited))

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             stream: tuple[asyncio.AbstractEventLoop, asyncio.Queue], **kwargs) -> Sequence:
        """On the engine thread: the request and its stream, together."""
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = self.engine.add_request(request_id, prompt_token_ids, params, **kwargs)
        self.streams[request_id] = stream
        self.request_stats.added(seq, time.monotonic())
        return seq

    def _drop(self, request_id: str, error: Exception | None) -> bool:
        """On the engine thread: abort the request; its stream gets `error`, or nothing more."""
        found = self.engine.abort_request(request_id)
        self._end_prefix_wait(request_id)  # if it waited for a prefix: whoever awaits that goes on
        if found:
            reason = "abort" if error is None or isinstance(error, RequestAborted) else "error"
            self.request_stats.finished(request_id, reason, time.monotonic())
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

    async def finish_remote_prefill(self, request_id: str, queue: asyncio.Queue, slot: RemoteSlot,
                                    kv: torch.Tensor | None, first_token: int,
                                    first_logprob: TokenLogprob | None = None, kv_start: int = 0) -> None:
        """A remote request's first token and KV came (kv None: it is in its blocks, through the slot's
        rows). The token's output is made here (slot.first) and put on the request's stream (`queue`,
        from add_routed_request) at once, not after the engine's step in flight; then the engine
        thread takes the KV over between two steps (LLMEngine.finish_remote_prefill). Raises
        ValueError for a token that does not fit, before anything is sent; for KV that does not fit
        too, and then the request fails (its first token is out)."""
        queue.put_nowait(slot.first.output(first_token, first_logprob))
        sent = time.monotonic()
        try:
            # Shielded: a request whose first token is out must be loaded (or aborted) in the engine,
            # never left holding its blocks because its caller went away meanwhile.
            await asyncio.shield(self._call(self._finish_remote, request_id, sent, kv, slot.first, kv_start))
        except Exception as e:
            await self.fail(request_id, RequestFailed(f"loading the KV of {request_id} failed: {e}"))
            raise

    def _finish_remote(self, request_id: str, sent: float, kv: torch.Tensor | None, first: FirstToken,
                       kv_start: int) -> None:
        """On the engine thread; the first token went out at `sent`."""
        self.engine.finish_remote_prefill(request_id, kv, first, kv_start)
        self.request_stats.remote_first_token(request_id, sent, kv_start)
        if request_id not in self.engine.requests:  # its first token ended it: that output was its last
            self.streams.pop(request_id, None)
            self.request_stats.finished(request_id, first.seq.finish_reason or "stop", time.monotonic())

    async def held_prefix_blocks(self, prompt_token_ids: list[int], limit: int) -> int:
        """How many of the prompt's first `limit` full blocks the prefix cache holds (PrefixBlocks.held)."""
        return await self._call(self._prefix_blocks().held, prompt_token_ids, limit)

    async def export_prefix_blocks(self, hashes: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """The tokens and KV of the leading blocks held under `hashes` (PrefixBlocks.export)."""
        return await self._call(self._prefix_blocks().export, hashes)

    async def insert_prefix_blocks(self, prompt_token_ids: list[int], first: int, kv: torch.Tensor) -> int:
        """Cache KV that arrived for blocks first, first + 1, ... of a prompt (PrefixBlocks.insert)."""
        return await self._call(self._prefix_blocks().insert, prompt_token_ids, first, kv)

    def _prefix_blocks(self) -> PrefixBlocks:
        if self.engine.prefix_blocks is None:
            raise ValueError("prefix blocks cannot move to or from this engine: it has no prefix cache, "
                             "or its blocks are split over tensor-parallel ranks")
        return self.engine.prefix_blocks

    async def start_profile(self) -> None:
        """Start the profiler on the engine thread, between two steps (RuntimeError if it runs already)."""
        await self._call(self.profiler.start)

    async def stop_profile(self) -> str:
        """Stop it between two steps, and write its trace on a thread of its own, while the engine
        steps on; the trace's path."""
        profile = await self._call(self.profiler.stop)
        return str(await asyncio.to_thread(self.profiler.write, profile))

    async def keep_remote_blocks_aside(self, request_id: str) -> int:
        return await self._call(self.engine.keep_remote_blocks_aside, request_id)

    async def prefill_locally(self, request_id: str) -> None:
        await self._call(self.engine.prefill_locally, request_id)

    async def subscribe_kv_events(self, max_pending: int = 1024) -> KVEventSubscription:
        """The prefix cache's hashes now (`snapshot`) and, through `next`, each later change;
        `close` it when done (kv_events.py)."""
        subscription = KVEventSubscription(asyncio.get_running_loop(), max_pending)
        subscription.snapshot = await self._call(self.kv_events.subscribe, subscription)
        return subscription

    def running_step(self) -> tuple[float, int] | None:
        """The step running now: (seconds it has run, prompt tokens it computes), or None between steps.
        Any thread; read without a lock, so at worst it describes the step just ended or just begun."""
        started = self.step_started
        if started is None:
            return None
        return time.monotonic() - started, self.engine.step_prompt_tokens

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
            self.request_stats.check_scheduled(time.monotonic())  # remote requests get blocks as they are added
            busy = self.engine.has_work()
            if busy and self.engine.offload is not None and time.monotonic() - logged >= TIERS_LOG_INTERVAL:
                logged = time.monotonic()
                logger.info("%s", self.engine.offload.summary())
            started, steps = time.monotonic(), self.engine.num_steps
            self.step_started = started if busy else None
            try:
                outputs = self.engine.step() if busy else []
            except Exception as e:
                # step() fails only the requests that a failed forward or sampling concerns; what gets
                # here is a bug outside those (scheduling), after which no request's state can be trusted.
                logger.exception("engine step failed outside the forward and sampling")
                self._fail_all(e)
                outputs = []
            self.step_started = None
            # Before the outputs: a request may end in the very step that admits it, as a prefill node's do.
            self.request_stats.check_scheduled(started)
            now = time.monotonic()
            for out in outputs:
                if out.error is not None:
                    self.num_request_errors += 1
                self.request_stats.output(out, now)
                self._deliver(out.request_id, out)
            if self.engine.num_steps != steps:
                self.request_stats.stepped(now - started, self.engine.step_prompt_tokens)
            self._end_prefix_waits()
            self.stats = self._stats()
            self.kv_events.publish()
            self._log_stats()
            if not busy:
                self.wakeup.wait(timeout=0.5)
                self.wakeup.clear()
        self._run_calls(stopped=EngineDeadError("the engine was stopped"))  # whoever still waits gets an answer

    def _log_stats(self) -> None:
        """On the engine thread: this turn's IterationStats to the stat loggers. A logger that fails
        loses its numbers, never the engine."""
        stats = self.request_stats.take()
        if stats is None:
            return
        for log in self.stat_loggers:
            try:
                log(stats)
            except Exception:
                logger.exception("a stat logger failed; the engine goes on")

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
            self.request_stats.finished(request_id, "error", time.monotonic())
            self.num_request_errors += 1
            self._deliver(request_id, EngineDeadError(f"engine step failed: {error}"))

    def _stats(self) -> EngineStats:
        """On the engine thread."""
        scheduler, bm = self.engine.scheduler, self.engine.block_manager
        queued = sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
                     for seq in (*scheduler.running, *scheduler.waiting))
        return EngineStats(len(scheduler.running), len(scheduler.waiting), bm.num_blocks, bm.num_free_blocks,
                           self.engine.num_steps, self.num_request_errors, scheduler.num_preemptions, queued)

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
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
