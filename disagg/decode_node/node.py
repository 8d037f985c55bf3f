"""DecodeNode: the front door. Validates and tokenizes, gets each prompt's KV from a prefill
node, and generates the answer; with no prefill nodes it is the colocated server.

A disaggregated request, in order (docs/ARCHITECTURE.md, "A request, end to end"):
  0. the route (route.py): the pool picks the prefill node that would answer first, by its queue and
     the prompt's prefix its cache holds; policy remote_prefill "auto" then computes the prompt here,
     as on a colocated server, when that is cheaper by the measured costs (a prompt of which few
     tokens miss our prefix cache, or one the pool's queue would hold up); so is one that asks for
     prompt logprobs;
  1. the engine reserves blocks for the prompt (the request waits for KV without a step); if its
     prefix's KV is arriving for another request here, it first waits for that to land (bounded by
     lookup_timeout), then hits it, and only the rest is asked for;
  2. Prefill(request id, prompt, sampling, our pipe endpoint) on the picked prefill node, with a hint
     naming another prefill node that holds more of the prompt's prefix, if one does (it may pull it);
     when our prefix cache holds none of the prompt, this call goes first, while the engine thread
     reserves the blocks (_calls_first), and a request for the same prefix that comes meanwhile waits
     until they are reserved, then for the prefix as in 1;
  3. meanwhile drop_select on our LookupBuffer consumer takes exactly that request's KV off the pipe,
     and the first token the prefill node sampled, which follows the KV there: the call's answer takes
     the longer way (gRPC) and usually comes after, with the costs the route learns from; a call that
     fails before the KV is in hand ends the wait;
  4. the first token goes to the client at once; the engine loads the KV into the reserved blocks
     between two steps and decodes on from the second token.
If the prefill node is down, dies mid-transfer or is too slow, the request is recomputed here
(policy "recompute") or fails with PrefillUnavailable (policy "fail").
"""

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator

from disagg import metrics
from disagg.control_plane import HeadsEntry, KVRank, PrefillCall, PrefillResult, plan_entries
from disagg.decode_node.prefill_client import PrefillClient, PrefillNodeUnavailable, PrefillPool
from disagg.decode_node.rank_kv import RankReceivers, within_rank
from disagg.decode_node.route import Route, RouteCosts
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.block_hash import LazyBlockHashes, hashes_at
from disagg.engine.output import RequestOutput
from disagg.engine.remote_prefill import RemoteSlot
from disagg.engine.sampling_params import SamplingParams
from disagg.engine.sequence import TokenLogprob
from disagg.engine.step_cost import StepCost
from disagg.lookup_buffer import KVEntry, LookupBufferConsumer, LookupTimeout
from disagg.pipes.row_scatter import RowScatter
from disagg.timeline import mark

logger = logging.getLogger(__name__)

POLICIES = ("recompute", "fail")
# A lookup started with its Prefill call: its Prefill call's progress bounds it until the answer, and
# lookup_timeout after that (_fetch_kv); this only keeps it finite.
WHILE_CALLED_S = 24 * 3600.0


def settle(future: asyncio.Future, source: asyncio.Future) -> None:
    """`future` ends as `source` did."""
    if future.done():
        return
    if source.cancelled():
        future.cancel()
    elif source.exception() is not None:
        future.set_exception(source.exception())
    else:
        future.set_result(source.result())


def stop_tasks(*tasks: asyncio.Future | None) -> None:
    """Cancel the tasks still running; take the outcome of those that ended, so that none is logged as
    never retrieved."""
    for task in tasks:
        if task is None:
            continue
        if task.done():
            if not task.cancelled():
                task.exception()
        else:
            task.cancel()


class PrefillUnavailable(RuntimeError):
    """The prefill node could not provide the KV and the policy says fail (HTTP 503)."""


class DecodeNode:
    def __init__(self, engine: AsyncEngine, model_name: str, consumer: LookupBufferConsumer | None = None,
                 pool: PrefillPool | None = None, kv_advertise: tuple[str, int] | None = None,
                 prefill_policy: str = "recompute", prefill_timeout: float = 10.0, lookup_timeout: float = 30.0,
                 remote_prefill: str = "auto", local_prefill_max_tokens: int = 64,
                 ranks: RankReceivers | None = None):
        """ranks: under tensor parallelism, the worker ranks' own receivers: a request whose blocks are
        reserved gets each rank's KV heads on that rank's endpoint."""
        self.engine = engine
        self.ranks = ranks
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.consumer = consumer
        self.pool = pool
        self.kv_advertise = kv_advertise  # the pipe endpoint prefill nodes push our KV to
        self.prefill_policy = prefill_policy
        self.prefill_timeout = prefill_timeout
        self.lookup_timeout = lookup_timeout
        self.remote_prefill = remote_prefill  # which prompts go to a prefill node (route.py)
        num_layers = engine.model_config.num_hidden_layers
        self.costs = RouteCosts(StepCost(), engine.kv_bytes_per_token_layer * num_layers, local_prefill_max_tokens)
        engine.stat_loggers.append(self.costs.local.record)
        self.node_id = f"d{uuid.uuid4().hex[:8]}"  # names this node's requests on every node
        self.kv_received_at: dict[str, float] = {}  # request id -> when its remote KV was in hand
        self.entries: dict[str, list[HeadsEntry]] = {}  # request id -> its KV's entries, while it is fetched
        # The first block hash of each prompt whose KV is being fetched (their count): a request for the
        # same prefix then waits for it in the engine rather than call first (_calls_first).
        self.arriving: collections.Counter[int] = collections.Counter()
        # By first block hash, the latest fetch that called first while its request is not added yet: its
        # `added` future and its task (_first_caller_added).
        self.adding: dict[int, tuple[asyncio.Future, asyncio.Task]] = {}

    @property
    def disaggregated(self) -> bool:
        return self.pool is not None

    async def generate(self, label: str, prompt_token_ids: list[int], params: SamplingParams,
                       prefill_policy: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request was validated (AsyncEngine.validate) by the API. `label` (the client's
        X-Request-Id or the API's id) only names the request in logs and answers: the engines and the
        prefill node know it by an id this node makes, so clients
        that reuse ids, or other decode nodes, can never touch each other's requests."""
        mark("disagg.decode.generate")
        policy = prefill_policy or self.prefill_policy
        if policy not in POLICIES:
            raise ValueError(f"prefill_policy must be one of {POLICIES}, got {policy!r}")
        request_id = f"{self.node_id}-{uuid.uuid4().hex}"
        logger.info("%s runs as %s", label, request_id)  # follows a request into the prefill node's log
        metrics.PROMPT_TOKENS.inc(len(prompt_token_ids))
        if not self.disaggregated:
            async with contextlib.aclosing(self.engine.generate(request_id, prompt_token_ids, params)) as outputs:
                async for out in outputs:
                    yield out
            return
        # Prompt logprobs are not part of the KV handoff: such a request is computed here.
        policy_route = "never" if params.prompt_logprobs is not None else self.remote_prefill
        client, node_seconds, node_per_token = None, None, 0.0
        hashes: dict[int, LazyBlockHashes] = {}  # the prompt's block hashes by block size, computed once
        if policy_route != "never":
            with contextlib.suppress(PrefillNodeUnavailable):  # then _fetch_kv tells why, if it goes out
                client = self.pool.pick(prompt_token_ids, hashes)
            per_s = self.pool.tokens_per_s()
            if policy_route == "auto" and client is not None and per_s:
                # Where the node could not measure a step's base, ours stands in: the same model's step.
                node_seconds = client.expected_seconds(prompt_token_ids, hashes, self.costs.local.base_seconds(), per_s)
                node_per_token = 1.0 / per_s
        num_decoding = self.engine.stats.num_running
        route = Route(False, "policy")
        first_block = self._first_block(prompt_token_ids, hashes)
        if client is not None and self._calls_first(client, first_block):
            # Nothing of the prompt is here: the Prefill call goes before the engine thread reserves its
            # blocks (a hop of 1.5-2.6 ms on a GPU pair's decode node), and the route is chosen here.
            route = self.costs.choose(policy_route, len(prompt_token_ids), num_decoding, node_seconds,
                                      node_per_token)
        if route.remote:
            loop = asyncio.get_running_loop()
            sent, added = loop.create_future(), loop.create_future()  # the call is there; the engine's add
            fetch = self._start_fetch(request_id, prompt_token_ids, params, policy, client, hashes, first_block,
                                      added, sent)
            adding = None
            try:
                # The engine thread's hop once the prefill node has the call: started together, both wanted this
                # loop and the GIL, and the call left later; the prefill node has the longer way to go.
                await asyncio.wait({sent, fetch}, return_when=asyncio.FIRST_COMPLETED)
                if fetch.done():  # it failed on its way out, and no request may wait for its KV
                    fetch.result()
                    raise RuntimeError(f"the KV fetch of {request_id} ended before its request was added")
                adding = asyncio.ensure_future(self.engine.add_routed_request(request_id, prompt_token_ids, params,
                                                                              lambda uncached: True))
                adding.add_done_callback(functools.partial(settle, added))
                queue, slot, waited = await asyncio.shield(adding)
            except BaseException:  # cancelled, or the engine refused it: the call stops, the request goes
                fetch.cancel()
                await asyncio.shield(self._end_unadded(request_id, fetch, adding))
                raise
        else:
            def remote(uncached: int) -> bool:  # on the engine thread, once the cached prefix is known
                nonlocal route
                route = self.costs.choose(policy_route, uncached, num_decoding, node_seconds, node_per_token)
                return route.remote

            # A prefix arriving for another request is waited for (bounded as that request's KV is), not
            # fetched again; the engine sees it arriving once that request holds its blocks. (A prompt computed
            # here for want of a prefill node, or for its prompt logprobs, has no fetch to spare: it goes on.)
            if client is not None:
                await self._first_caller_added(first_block)
            queue, slot, waited = await self.engine.add_routed_request(request_id, prompt_token_ids, params, remote,
                                                                       prefix_wait=self.lookup_timeout)
            fetch = None
        mark("disagg.decode.routed")
        if waited is not None:
            metrics.PREFIX_WAITS.labels("hit" if waited.saved else "missed").inc()
            metrics.PREFIX_WAIT_TOKENS.inc(waited.saved)
            logger.debug("%s waited for %d arriving prefix tokens: %d found cached", request_id, waited.arriving,
                         waited.saved)
        metrics.PREFILL_ROUTE.labels("local" if slot is None else "remote").inc()
        metrics.PREFILL_ROUTE_BASIS.labels(route.basis).inc()
        if route.basis == "measured":
            logger.debug("%s: here %.3fs, on %s %.3fs", request_id, route.local_seconds, client.address,
                         route.remote_seconds)
        if slot is None:
            logger.debug("%s: prompt of %d tokens computed here (remote_prefill %s, %s)", request_id,
                         len(prompt_token_ids), policy_route, route.basis)
            async with contextlib.aclosing(self.engine.stream(request_id, queue)) as outputs:
                async for out in outputs:
                    yield out
            return
        logger.debug("%s: prompt of %d tokens (%d cached here) goes to a prefill node (remote_prefill %s, %s)",
                     request_id, len(prompt_token_ids), slot.cached_tokens, policy_route, route.basis)
        if fetch is None:
            added = asyncio.get_running_loop().create_future()
            added.set_result((queue, slot, waited))
            fetch = self._start_fetch(request_id, prompt_token_ids, params, policy, client, hashes, first_block,
                                      added)
        # Not aborted by the stream when it closes: by _end, once the fetch (and with it any receive
        # into the request's blocks) has ended.
        outputs = self.engine.stream(request_id, queue, abort_on_exit=False)
        finished = False
        try:
            async for out in outputs:
                received = self.kv_received_at.pop(request_id, None)
                if received is not None:  # the first token, which came with the KV
                    metrics.FIRST_TOKEN_DELAY.observe(time.perf_counter() - received)
                finished = out.finished
                yield out
        finally:
            self.kv_received_at.pop(request_id, None)
            # Shielded, so that a second cancellation cannot reorder it: the fetch ends (and with it
            # any receive into the request's blocks) before the request is aborted.
            await asyncio.shield(self._end(request_id, fetch, outputs, finished))

    async def _end_unadded(self, request_id: str, fetch: asyncio.Task, adding: asyncio.Future | None) -> None:
        """A request whose Prefill call went first ends before its engine request was in hand: the fetch
        ends first (and with it any receive into its blocks), then the request, if the engine added it."""
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await fetch
        if adding is None:
            return
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await adding
        if not adding.cancelled() and adding.exception() is None:
            await self.engine.drop(request_id)

    def _first_block(self, prompt_token_ids: list[int], block_hashes: dict[int, LazyBlockHashes]) -> int | None:
        """The hash of the prompt's first block our prefix cache could serve, None if none could."""
        if not self.engine.enable_prefix_caching:
            return None
        return next(iter(hashes_at(block_hashes, prompt_token_ids, self.engine.block_size)), None)

    def _calls_first(self, client: PrefillClient, first_block: int | None) -> bool:
        """Whether the request's Prefill call may go before the engine thread has reserved its blocks: our
        prefix cache holds nothing of the prompt and no KV of it is on its way for another request (then
        the engine's wait for it decides), and one entry carries its KV (no tensor-parallel split). Read
        here, off the engine thread: should the engine find a prefix cached meanwhile, the KV comes for
        the whole prompt, and what the cache holds of it is dropped from it (_fetch_kv)."""
        if self.ranks is not None or len(client.info.heads_by_rank) > 1:
            return False
        return first_block is None or (first_block not in self.arriving and not self.engine.may_hold_block(first_block))

    async def _end(self, request_id: str, fetch: asyncio.Task, outputs: AsyncIterator[RequestOutput],
                   finished: bool) -> None:
        if finished:  # the first token may have ended it before the engine loaded the KV
            await fetch
        elif not fetch.done():  # the client went away before the KV came: stop the prefill too
            fetch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await fetch
        await outputs.aclose()
        if not finished:
            await self.engine.drop(request_id)

    def _start_fetch(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, policy: str,
                     client: PrefillClient | None, block_hashes: dict[int, LazyBlockHashes], first_block: int | None,
                     added: asyncio.Future, sent: asyncio.Future | None = None) -> asyncio.Task:
        """_fetch_kv as a task. The prompt's first block counts as arriving from here, not from the task's
        first step: the requests of a burst reach _calls_first in one turn of the loop, before any of their
        fetches runs, and each would call first for the prefix they share. It stops counting once the task is
        done, however it ended (a task cancelled before its first step runs none of its code)."""
        fetch = asyncio.create_task(self._fetch_kv(request_id, prompt_token_ids, params, policy, client,
                                                   block_hashes, added, sent))
        if first_block is not None:
            self.arriving[first_block] += 1
            fetch.add_done_callback(lambda _: self._arrived(first_block))
            if sent is not None:  # its request is added later (generate)
                pending = self.adding[first_block] = (added, fetch)
                for future in pending:
                    future.add_done_callback(lambda _: self.adding.get(first_block) is pending
                                             and self.adding.pop(first_block))
        return fetch

    async def _first_caller_added(self, first_block: int | None) -> None:
        """Until the request of a fetch that called first for a prompt with this first block holds its
        blocks, or that fetch ended (bounded by prefill_timeout): the engine then counts that prefix as
        arriving, and a request for it waits for it there instead of fetching it again. A request that
        called first is added once its call is there (a gRPC round trip), and the requests of a burst
        would otherwise reach the engine before it."""
        pending = self.adding.get(first_block) if first_block is not None else None
        if pending is not None:
            await asyncio.wait(pending, timeout=self.prefill_timeout, return_when=asyncio.FIRST_COMPLETED)

    def _arrived(self, first_block: int) -> None:
        self.arriving[first_block] -= 1
        if not self.arriving[first_block]:
            del self.arriving[first_block]

    async def _fetch_kv(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, policy: str,
                        picked: PrefillClient | None, block_hashes: dict[int, LazyBlockHashes],
                        added: asyncio.Future, sent: asyncio.Future | None = None) -> None:
        """The request's KV and first token from a prefill node, into the engine request `added` resolves
        to (its queue, RemoteSlot and prefix wait). With `sent`, the call goes first (_calls_first), for
        the whole prompt, and `sent` is set once the prefill node has it, or the fetch failed before that;
        `added` then resolves later. Else `added` is done, and the call asks for what our cache lacks."""
        called_first = sent is not None
        client: PrefillClient | None = None
        answer = lookup = slot = None
        start = time.perf_counter()
        try:
            client = picked or self.pool.pick(prompt_token_ids, block_hashes)  # none was healthy: this says why
            heads = self.engine.kv_heads_by_rank
            entries = self.entries[request_id] = [HeadsEntry(request_id, 0, 0, heads[0])]
            if called_first:
                skip, by_rank, kv_ranks = 0, False, []
            else:
                queue, slot, _ = added.result()
                # Our prefix cache's hits are held for this request: only the rest of its KV need come.
                skip = slot.cached_tokens
                # Blocks reserved already: the KV is received straight into them (else into a buffer first, every
                # head as one entry), and under tensor parallelism on either node each decode rank receives its
                # own heads into its own cache's rows, an entry from each prefill rank that holds some of them.
                prefill_heads = client.info.heads_by_rank
                by_rank = slot.rows is not None and (self.ranks is not None or len(prefill_heads) > 1)
                kv_ranks = [KVRank(self.kv_advertise, heads[0])] if self.ranks is None else \
                    self.ranks.kv_ranks(self.kv_advertise)
                if by_rank:
                    entries = self.entries[request_id] = plan_entries(request_id, [r.heads for r in kv_ranks],
                                                                      prefill_heads)
                self._expect(entries, slot)
                if by_rank and self.ranks is not None:
                    await self.ranks.expect(entries, slot.blocks, skip, skip + len(slot.rows))
            # Leading blocks another prefill node holds and the picked one lacks: it may pull them (pull.py).
            pull_from, pull_blocks = self.pool.pull_hint(client, prompt_token_ids, block_hashes)
            call = PrefillCall(request_id, prompt_token_ids, params, self.kv_advertise, skip, pull_from, pull_blocks,
                               kv_ranks if by_rank else [])
            # The KV and the first token behind it on the pipe usually come before the call's answer, which
            # takes the longer way: whichever fails or ends first decides. The lookup waits as long as the call
            # makes progress, and lookup_timeout after its answer.
            source = (client.info.kv_ip, client.info.kv_port)
            answer = asyncio.ensure_future(self._call(client, call, start, sent))
            lookup = asyncio.ensure_future(self._select(entries, prompt_token_ids, source, WHILE_CALLED_S))
            if called_first:  # the engine thread reserves the blocks meanwhile
                answer.add_done_callback(lambda _: sent.done() or sent.set_result(None))  # failed before it went
                queue, slot, _ = await asyncio.shield(added)
                # Received in place if its rows are known before its KV comes (else into a buffer, then
                # cut below if our cache got a prefix meanwhile).
                if slot.cached_tokens == skip and not lookup.done():
                    self._expect(entries, slot)
            await asyncio.wait({answer, lookup}, return_when=asyncio.FIRST_COMPLETED)
            if not lookup.done():
                answer.result()  # raises why the call failed
                # The reply means the KV is queued, not sent: if the node dies now, stop waiting at once.
                watch = asyncio.create_task(self._discard_when_unhealthy(client, request_id))
                try:
                    if not (await asyncio.wait({lookup}, timeout=self.lookup_timeout))[0]:
                        raise LookupTimeout(f"no KV for request {request_id!r} arrived within {self.lookup_timeout}s "
                                            "of the prefill node's answer; it may be unable to reach this decode "
                                            "node: recompute the prefill or raise the timeout")
                finally:
                    watch.cancel()
            entry = lookup.result()
            mark("disagg.decode.kv_in_hand")
            received = time.perf_counter()
            first = entry.first_token
            if first is None:
                raise RuntimeError(f"the KV of {request_id} came without its first token")
            self.kv_received_at[request_id] = received
            kv = None if entry.in_place else entry.kv_tensors[0]
            if kv is not None and slot.cached_tokens > skip:  # our cache got a prefix after the call went first
                kv = kv[:, :, slot.cached_tokens - skip:]
            logprob = None if first.logprob is None else TokenLogprob(first.token_id, first.logprob, first.top)
            await self.engine.finish_remote_prefill(request_id, queue, slot, kv, first.token_id, logprob,
                                                    kv_start=slot.cached_tokens)
            loaded = time.perf_counter()
            metrics.KV_LOAD.observe(loaded - received)
            metrics.KV_TRANSFER.observe(loaded - start)
            metrics.REMOTE_PREFILL.labels("ok").inc()
            answer.add_done_callback(functools.partial(self._answered, start, received, loaded - received))
        except asyncio.CancelledError:
            stop_tasks(answer, lookup)
            await asyncio.shield(self._let_go(request_id, client))
            raise
        except Exception as e:  # noqa: BLE001  any failure of the handoff: recomputed or failed by policy
            stop_tasks(answer, lookup)
            self.kv_received_at.pop(request_id, None)  # a recomputed first token is no remote one
            await asyncio.shield(self._let_go(request_id, client))  # before the blocks are given back
            if called_first:  # the engine request, once added (else generate says why it was not)
                if not sent.done():  # failed before the call went: the engine's add need wait no longer
                    sent.set_result(None)
                try:
                    await asyncio.shield(added)
                except Exception:  # noqa: BLE001
                    return
            where = client.address if client is not None else "no prefill node"
            reason = f"remote prefill of {request_id} failed ({where}): {e}"
            if policy == "fail":
                metrics.REMOTE_PREFILL.labels("failed").inc()
                logger.warning("%s; failing the request (policy fail)", reason)
                await self.engine.fail(request_id, PrefillUnavailable(reason))
            else:
                metrics.REMOTE_PREFILL.labels("recomputed").inc()
                logger.warning("%s; recomputing it here", reason)
                with contextlib.suppress(KeyError):  # it may have been aborted meanwhile
                    await self.engine.prefill_locally(request_id)
        finally:
            if called_first and not sent.done():  # generate adds no request for a fetch that ends so
                sent.set_result(None)
            self.entries.pop(request_id, None)

    def _expect(self, entries: list[HeadsEntry], slot: RemoteSlot) -> None:
        """Our consumer's entries received straight into the request's blocks, if it holds them."""
        if slot.rows is None:
            return
        ours = self.engine.kv_heads_by_rank[0]
        for entry in entries:
            if entry.decode_rank == 0:
                rows = RowScatter(slot.cache, slot.rows, within_rank(entry.heads, ours))
                self.consumer.expect(entry.entry_id, [rows])

    async def _call(self, client: PrefillClient, call: PrefillCall, start: float,
                    sent: asyncio.Future | None) -> tuple[PrefillResult, float]:
        """The Prefill call's result, and when it came."""
        mark("disagg.decode.prefill_call")
        result = await client.prefill(call, idle_timeout=self.prefill_timeout, sent=sent)
        mark("disagg.decode.prefill_answer")
        answered = time.perf_counter()
        metrics.REMOTE_PREFILL_CALL.observe(answered - start)
        return result, answered

    def _answered(self, start: float, received: float, load_seconds: float, answer: asyncio.Future) -> None:
        """A remote prefill's costs for the route, once its call has answered (its KV and first token were
        in hand at `received`, usually before). A call that failed after they came costs the request nothing."""
        if answer.cancelled() or answer.exception() is not None:
            return
        result, answered = answer.result()
        tail = max(0.0, received - answered)  # the KV's wait after the answer
        metrics.KV_LOOKUP_WAIT.observe(tail)
        self.costs.remote_done(received - start - tail, result.prefill_seconds, result.kv_bytes, tail, load_seconds)

    async def _select(self, entries: list[HeadsEntry], prompt_token_ids: list[int], source: tuple[str, int],
                      timeout: float) -> KVEntry:
        """Our consumer's entry of the request (the first of ours), once every entry (ours and every worker
        rank's) has arrived; the first failure ends the wait."""
        own_ids = [e.entry_id for e in entries if e.decode_rank == 0]
        if all(entry.decode_rank == 0 for entry in entries):  # awaited here: no task, no loop turn to hand it over
            return await self._select_own(own_ids, prompt_token_ids, source, timeout)
        own = asyncio.ensure_future(self._select_own(own_ids, prompt_token_ids, source, timeout))
        others = asyncio.ensure_future(self.ranks.drop_select(entries, prompt_token_ids, timeout, source))
        try:
            await asyncio.gather(own, others)
        finally:
            own.cancel()  # one failed: the other's wait ends (its error is the first one's)
            others.cancel()
            await asyncio.gather(own, others, return_exceptions=True)
        return own.result()

    async def _select_own(self, entry_ids: list[str], prompt_token_ids: list[int], source: tuple[str, int],
                          timeout: float) -> KVEntry:
        """The first of our consumer's entries (the one with the first token), once all have arrived (within
        `timeout` together); several (from several prefill ranks) must each have landed in the blocks."""
        deadline, taken = time.monotonic() + timeout, []
        for entry_id in entry_ids:
            left = max(0.0, deadline - time.monotonic()) if taken else timeout
            taken.append(await self.consumer.drop_select_async(entry_id, prompt_token_ids, left, source))
        if len(taken) > 1 and not all(entry.in_place for entry in taken):
            raise RuntimeError(f"KV of {entry_ids[0]} from a prefill rank did not land in its blocks")
        return taken[0]

    async def _let_go(self, request_id: str, client: PrefillClient | None) -> None:
        """Stop receiving the request's KV (blocks a peer may still write kept aside) and stop its
        prefill. Callers shield it: a caller cancelled meanwhile must not skip either."""
        await self._discard(request_id)
        if client is not None:
            await client.abort(request_id, self.kv_advertise)

    async def _discard_when_unhealthy(self, client: PrefillClient, request_id: str) -> None:
        while client.healthy:  # noqa: ASYNC110  the pool's health checks set no event to wait on
            await asyncio.sleep(0.2)
        await self._discard(request_id)

    async def _discard(self, request_id: str) -> None:
        """consumer.discard, in a thread: it may wait while it cuts off a receive into the request's
        blocks (for a nixl pipe, until the peer's writes in flight end). Blocks a peer may still write
        into are never given back."""
        entries = self.entries.get(request_id) or [HeadsEntry(request_id, 0, 0, self.engine.kv_heads_by_rank[0])]
        ours = [entry.entry_id for entry in entries if entry.decode_rank == 0]
        for entry_id in ours:
            await asyncio.to_thread(self.consumer.discard, entry_id)
        ranks_may_be_written = self.ranks is not None and await self.ranks.discard(entries)
        if any(self.consumer.peer_may_write(entry_id) for entry_id in ours) or ranks_may_be_written:
            with contextlib.suppress(KeyError):  # the engine ended the request already (it stopped)
                await self.engine.keep_remote_blocks_aside(request_id)

    def health(self) -> dict:
        status = {"status": "ok", "role": "consumer" if self.disaggregated else "both", "model": self.model_name}
        if self.pool is not None:
            status["prefill_nodes"] = {c.address: c.healthy for c in self.pool.clients}
            # What the route weighs each by (its Watch stream): its load and the blocks its cache holds.
            status["prefill_route"] = {"remote_prefill": self.remote_prefill, **self.costs.measured()}
            status["prefill_state"] = {
                c.address: {**dataclasses.asdict(c.load), "watching": c.view.live,
                            "cached_blocks": {medium: len(held) for medium, held in c.view.hashes.items()}}
                for c in self.pool.clients}
        return status

    def update_gauges(self) -> None:
        metrics.engine_gauges(self.engine.stats)
        if self.consumer is not None:
            stats = self.consumer.stats()
            metrics.BUFFER_ENTRIES.set(stats.entries)
            metrics.BUFFER_BYTES.set(stats.bytes)
