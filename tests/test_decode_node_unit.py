"""DecodeNode's remote-prefill handoff and its failure matrix, with fakes and no model (the fast lane).

The engine, the prefill pool and the lookup-buffer consumer are fakes that record every call in one
log, so a test asserts what DecodeNode asked of each and in which order. The engine's `stream` is
AsyncEngine's own, so where it aborts a request (a client gone away) is the real one's. The same
paths with real processes are in test_serving.py and test_router.py (the slow lane).
"""

import asyncio
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from disagg.control_plane import PrefillCall, PrefillResult
from disagg.decode_node.node import WHILE_CALLED_S, DecodeNode, PrefillUnavailable
from disagg.decode_node.prefill_client import PrefillFailed, PrefillNodeUnavailable
from disagg.engine.async_engine import AsyncEngine, PrefixWait
from disagg.engine.block_hash import LazyBlockHashes
from disagg.engine.remote_prefill import RemoteSlot
from disagg.engine.sampling_params import SamplingParams
from disagg.lookup_buffer.errors import (
    BufferFullError,
    DigestMismatch,
    EntryCancelled,
    LookupDiscarded,
    LookupTimeout,
    ProducerLost,
)
from disagg.lookup_buffer.messages import FirstToken, KVEntry
from disagg.pipes import RowScatter

pytestmark = pytest.mark.timeout(10)

PROMPT = [1, 2, 3, 4, 5, 6]
ADVERTISE = ("127.0.0.11", 7100)  # the decode node's pipe endpoint
PRODUCER = ("127.0.0.12", 7200)  # the prefill node's kv_ip, kv_port
DIGEST = "digest-of-prompt"
FIRST, DECODED, LOCAL = 101, 102, 201  # the remote first token, the next one, a locally computed one
CACHE, ROWS = torch.zeros(2, 2, 8, 1, 1), torch.arange(3, 7)  # the KV cache, the reserved blocks' rows
KV = "kv-tensor"  # an entry's tensor when it was not received in place
LOOKUP_TIMEOUT = 30.0
PREFILL_TIMEOUT = 5.0
WAIT = "wait"  # the fake lookup waits until the request is discarded


@dataclass
class Out:
    """What DecodeNode and AsyncEngine.stream read of a RequestOutput."""
    token: int
    finished: bool
    error: str | None = None


def names(log: list[tuple]) -> list[str]:
    return [call[0] for call in log]


def called(log: list[tuple], name: str) -> list[tuple]:
    return [call for call in log if call[0] == name]


def result() -> PrefillResult:
    return PrefillResult(num_cached_tokens=0, kv_bytes=1024, prefill_seconds=0.01)


class FakeEngine:
    """What DecodeNode calls on AsyncEngine. A remote request's outputs: the first token, then one
    decoded token that finishes it; a recomputed or local one: one token that finishes it."""

    stream = AsyncEngine.stream  # the real ones: a stream left early drops its request, unless told not to
    drop = AsyncEngine.drop

    def __init__(self, log: list[tuple], cached_tokens: int = 0, rows: torch.Tensor | None = ROWS,
                 holds_prefix: bool = True, add_hold: asyncio.Event | None = None):
        """holds_prefix: what may_hold_block says of the prompt's first block (True: the Prefill call waits
        for the request's blocks, False: it goes first); add_hold: adding a request waits for it."""
        self.log = log
        self.block_size = 4
        self.enable_prefix_caching = True
        self.holds_prefix = holds_prefix
        self.add_hold = add_hold
        self.tokenizer = object()
        self.max_model_len = 64
        self.model_config = SimpleNamespace(num_hidden_layers=2)
        self.kv_bytes_per_token_layer = 1024
        self.kv_heads_by_rank = [(0, 3)]  # one rank, every KV head
        self.stat_loggers: list = []  # the route's cost measurement subscribes here
        self.stats = SimpleNamespace(num_running=0)
        self.slot = RemoteSlot(cached_tokens=cached_tokens, cache=CACHE, rows=rows, blocks=[], first=None)
        self.waited: PrefixWait | None = None  # how a remote request's wait for an arriving prefix went
        self.queues: dict[str, asyncio.Queue] = {}

    async def _call(self, fn, *args):
        return fn(*args)

    def _drop(self, request_id: str, error: Exception | None) -> bool:
        """The engine aborts the request: its blocks are given back."""
        self.log.append(("drop", request_id))
        return True

    def may_hold_block(self, block_hash: int) -> bool:
        return self.holds_prefix

    async def add_routed_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                                 remote, prefix_wait: float = 0.0
                                 ) -> tuple[asyncio.Queue, RemoteSlot | None, PrefixWait | None]:
        if self.add_hold is not None:
            await self.add_hold.wait()
        self.queues[request_id] = asyncio.Queue()
        if not remote(len(prompt_token_ids) - self.slot.cached_tokens):
            self.log.append(("add_local_request", request_id, prompt_token_ids))
            self.queues[request_id].put_nowait(Out(LOCAL, True))
            return self.queues[request_id], None, None
        self.log.append(("add_remote_request", request_id, prompt_token_ids, prefix_wait))
        return self.queues[request_id], self.slot, self.waited

    async def finish_remote_prefill(self, request_id: str, queue: asyncio.Queue, slot: RemoteSlot, kv,
                                    first_token: int, first_logprob=None, kv_start: int = 0) -> None:
        self.log.append(("finish_remote_prefill", request_id, slot, kv, first_token, kv_start))
        queue.put_nowait(Out(first_token, False))
        queue.put_nowait(Out(DECODED, True))

    async def prefill_locally(self, request_id: str) -> None:
        self.log.append(("prefill_locally", request_id))
        self.queues[request_id].put_nowait(Out(LOCAL, True))

    async def fail(self, request_id: str, error: Exception) -> bool:
        self.log.append(("fail", request_id, error))
        self.queues[request_id].put_nowait(error)
        return True

    async def keep_remote_blocks_aside(self, request_id: str) -> int:
        self.log.append(("keep_remote_blocks_aside", request_id))
        return 2



class FakeClient:
    """A PrefillClient whose Prefill call answers `answer`, or raises it; with `hold`, once that is set."""

    def __init__(self, log: list[tuple], answer: PrefillResult | Exception, hold: asyncio.Event | None = None):
        self.log = log
        self.send_hold: asyncio.Event | None = None  # the node has the call once this is set
        self.fail_before_send = False  # the call raises `answer` before the node has it
        self.answer = answer
        self.hold = hold
        self.healthy = True
        self.load = SimpleNamespace(prefill_tokens_per_s=0.0)  # not measured: the route's fallback rule
        self.address = "prefill-0:50051"
        self.info = SimpleNamespace(kv_ip=PRODUCER[0], kv_port=PRODUCER[1], num_kv_heads=3, heads_by_rank=[(0, 3)])

    async def prefill(self, call: PrefillCall, idle_timeout: float, sent: asyncio.Future | None = None
                      ) -> PrefillResult:
        self.log.append(("prefill", call, idle_timeout))
        if self.fail_before_send:
            raise self.answer
        if self.send_hold is not None:
            await self.send_hold.wait()
        if sent is not None:  # the node has the call
            self.log.append(("sent", call.request_id))
            sent.set_result(None)
        if self.hold is not None:
            await self.hold.wait()
            self.log.append(("answered", call.request_id))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    async def abort(self, request_id: str, kv_dest: tuple[str, int]) -> bool:
        self.log.append(("abort", request_id, kv_dest))
        return True


class FakePool:
    def __init__(self, log: list[tuple], client: FakeClient, available: bool = True):
        self.log = log
        self.clients = [client]
        self.available = available
        self.hint = ("", 0)  # where the picked node may pull the prompt's prefix from: nowhere
        self.block_hashes: list[dict] = []  # the dict each pick and pull_hint was given

    def pick(self, prompt_token_ids: list[int], block_hashes: dict | None = None) -> FakeClient:
        self.log.append(("pick",))
        self.block_hashes.append(block_hashes)
        if not self.available:
            raise PrefillNodeUnavailable("no healthy prefill node: prefill-0:50051: connection refused")
        return self.clients[0]

    def tokens_per_s(self) -> float:
        return self.clients[0].load.prefill_tokens_per_s

    def pull_hint(self, picked: FakeClient, prompt_token_ids: list[int], block_hashes: dict) -> tuple[str, int]:
        self.log.append(("pull_hint", picked))
        self.block_hashes.append(block_hashes)
        return self.hint


class FakeConsumer:
    """A LookupBufferConsumer whose lookup returns an entry (`lookup` None), raises `lookup`, or
    waits (WAIT) until discard() ends it with LookupDiscarded, as the real one does. discard() runs
    in a thread (DecodeNode._discard); with `hold_discard` it waits on that event first."""

    def __init__(self, log: list[tuple], lookup: Exception | str | None = None, digest: str = DIGEST,
                 in_place: bool = True, peer_may_write: bool = False, hold_discard: threading.Event | None = None,
                 kv: torch.Tensor | str = KV, arrive: asyncio.Event | None = None):
        """in_place: an entry lands in its destination if one was expected before it arrived (else it
        comes as `kv`); arrive: a lookup's entry arrives once this is set (else at once)."""
        self.log = log
        self.kv = kv
        self.arrive = arrive
        self.expected: set[str] = set()
        self.lookup = lookup
        self.digest = digest
        self.in_place = in_place
        self.may_write = peer_may_write
        self.hold_discard = hold_discard
        self.waiting = asyncio.Event()  # a lookup waits
        self.discarding = threading.Event()  # discard() was entered
        self.loop: asyncio.AbstractEventLoop | None = None
        self.discarded: asyncio.Future | None = None

    def expect(self, request_id: str, into: list) -> None:
        self.log.append(("expect", request_id, into))
        self.expected.add(request_id)

    async def drop_select_async(self, request_id: str, token_ids: list[int], timeout: float,
                                source: tuple[str, int] | None = None) -> KVEntry:
        self.log.append(("drop_select", request_id, token_ids, timeout, source))
        if isinstance(self.lookup, Exception):
            raise self.lookup
        if self.lookup == WAIT:
            self.loop = asyncio.get_running_loop()
            self.discarded = self.loop.create_future()
            self.waiting.set()
            try:
                await self.discarded
            except asyncio.CancelledError:
                self.log.append(("drop_select cancelled", request_id))
                raise
            raise LookupDiscarded(f"lookup for request {request_id!r} ended: the request was discarded")
        if self.arrive is not None:
            await self.arrive.wait()
        in_place = self.in_place and request_id in self.expected
        kv = [RowScatter(CACHE, ROWS)] if in_place else [self.kv]
        return KVEntry(request_id=request_id, token_digest=self.digest, kv_tensors=kv, in_place=in_place,
                       carries_first_token=True, first_token=FirstToken(FIRST))

    def discard(self, request_id: str) -> bool:
        self.log.append(("discard", request_id))
        self.discarding.set()
        if self.hold_discard is not None:
            self.hold_discard.wait(5)
        if self.discarded is not None:
            self.loop.call_soon_threadsafe(lambda: self.discarded.done() or self.discarded.set_result(None))
        return False

    def peer_may_write(self, request_id: str) -> bool:
        return self.may_write


def make_node(log: list[tuple], *, answer: PrefillResult | Exception | None = None, available: bool = True,
              policy: str = "recompute", engine: FakeEngine | None = None, consumer: FakeConsumer | None = None,
              hold: asyncio.Event | None = None, lookup_timeout: float = LOOKUP_TIMEOUT) -> DecodeNode:
    client = FakeClient(log, answer if answer is not None else result(), hold)
    return DecodeNode(engine or FakeEngine(log), "model", consumer=consumer or FakeConsumer(log),
                      pool=FakePool(log, client, available), kv_advertise=ADVERTISE, prefill_policy=policy,
                      prefill_timeout=PREFILL_TIMEOUT, lookup_timeout=lookup_timeout, remote_prefill="always")


async def collect(node: DecodeNode, params: SamplingParams | None = None) -> tuple[list[int], Exception | None]:
    """The tokens the caller got, and what the node raised (None if nothing)."""
    tokens = []
    try:
        async for out in node.generate("client-label", PROMPT, params or SamplingParams(max_tokens=4)):
            tokens.append(out.token)
    except Exception as e:  # noqa: BLE001  the test asserts what it was
        return tokens, e
    return tokens, None


async def logged(log: list[tuple], name: str) -> None:
    """Until the log has a call of `name`."""
    while name not in names(log):  # noqa: ASYNC110  the fakes log calls, they set no event
        await asyncio.sleep(0.005)


def request_id(log: list[tuple]) -> str:
    return called(log, "add_remote_request")[0][1]


def assert_failed_over(log: list[tuple], tokens: list[int], error: Exception | None, policy: str) -> None:
    """A failed handoff: the lookup's destination dropped, then the prefill node told, then the request
    recomputed here or failed by the policy; the KV never loaded."""
    rid = request_id(log)
    assert "finish_remote_prefill" not in names(log)
    # the stream's abort of a request failed by policy comes last (tested apart); a lookup still waiting
    # is cancelled as the failure is handled
    after_add = [name for name in names(log) if name not in ("drop", "drop_select cancelled")]
    if policy == "recompute":
        assert after_add[-3:] == ["discard", "abort", "prefill_locally"]
        assert called(log, "prefill_locally") == [("prefill_locally", rid)]
        assert "fail" not in names(log)
        assert (tokens, error) == ([LOCAL], None)
    else:
        assert after_add[-3:] == ["discard", "abort", "fail"]
        assert isinstance(called(log, "fail")[0][2], PrefillUnavailable)
        assert "prefill_locally" not in names(log)
        assert tokens == [] and isinstance(error, PrefillUnavailable)
        assert "prefill-0:50051" in str(error)
        assert names(log)[-1] == "drop"  # the stream ended early: the engine drops the request
    assert called(log, "discard") == [("discard", rid)]
    assert called(log, "abort") == [("abort", rid, ADVERTISE)]
    assert "keep_remote_blocks_aside" not in names(log)


def test_happy_path_receives_in_place_and_streams():
    async def main():
        log: list[tuple] = []
        engine = FakeEngine(log, cached_tokens=3, rows=ROWS)
        node = make_node(log, engine=engine)
        tokens, error = await collect(node)
        rid = request_id(log)
        assert rid.startswith(node.node_id + "-")
        assert (tokens, error) == ([FIRST, DECODED], None)
        assert names(log) == ["pick", "add_remote_request", "expect", "pull_hint", "prefill", "drop_select",
                              "finish_remote_prefill"]
        (into,) = called(log, "expect")[0][2]  # the KV lands in the reserved rows of the cache
        assert into.tensor is CACHE and into.rows is ROWS
        call, idle_timeout = called(log, "prefill")[0][1:]
        assert call == PrefillCall(rid, PROMPT, SamplingParams(max_tokens=4), ADVERTISE, skip_tokens=3)
        assert idle_timeout == PREFILL_TIMEOUT
        # started with the call, bounded by its progress (then by lookup_timeout after its answer)
        assert called(log, "drop_select") == [("drop_select", rid, PROMPT, WHILE_CALLED_S, PRODUCER)]
        # in place: the KV is in the blocks already; the remote first token; loaded after the cached part
        assert called(log, "finish_remote_prefill") == [("finish_remote_prefill", rid, engine.slot, None, FIRST, 3)]
        assert node.kv_received_at == {}

    asyncio.run(main())


def test_a_prompt_of_which_nothing_is_here_calls_before_its_blocks_are_reserved():
    """Our prefix cache holds none of the prompt: the Prefill call (for all of it) goes while the engine
    thread adds the request; its KV then lands in the rows that add reserved."""
    async def main():
        log: list[tuple] = []
        hold, arrive = asyncio.Event(), asyncio.Event()
        engine = FakeEngine(log, holds_prefix=False, add_hold=hold)
        node = make_node(log, engine=engine, consumer=FakeConsumer(log, arrive=arrive))
        collecting = asyncio.create_task(collect(node))
        await logged(log, "prefill")
        assert "add_remote_request" not in names(log)  # the call did not wait for the engine
        hold.set()
        await logged(log, "expect")
        arrive.set()  # its KV comes after the rows are known: in place
        tokens, error = await collecting
        assert (tokens, error) == ([FIRST, DECODED], None)
        assert names(log) == ["pick", "pull_hint", "prefill", "sent", "drop_select", "add_remote_request", "expect",
                              "finish_remote_prefill"]
        rid = request_id(log)
        assert called(log, "prefill")[0][1] == PrefillCall(rid, PROMPT, SamplingParams(max_tokens=4), ADVERTISE)
        assert called(log, "add_remote_request")[0][3] == 0  # no wait for an arriving prefix: none was
        (into,) = called(log, "expect")[0][2]
        assert into.tensor is CACHE and into.rows is ROWS
        assert called(log, "finish_remote_prefill") == [("finish_remote_prefill", rid, engine.slot, None, FIRST, 0)]
        assert node.arriving == {} and node.adding == {}  # counted only while it was fetched, and added

    asyncio.run(main())


def test_the_engine_adds_a_request_that_called_first_once_its_call_is_there():
    """The engine thread's hop waits until the prefill node has the call: both want the event loop (and
    the GIL), and the prefill node has the longer way to go."""
    async def main():
        log: list[tuple] = []
        node = make_node(log, engine=FakeEngine(log, holds_prefix=False))
        node.pool.clients[0].send_hold = sending = asyncio.Event()
        collecting = asyncio.create_task(collect(node))
        await logged(log, "prefill")
        await asyncio.sleep(0.05)
        assert "add_remote_request" not in names(log)
        sending.set()
        assert await collecting == ([FIRST, DECODED], None)
        assert names(log).index("sent") < names(log).index("add_remote_request")

    asyncio.run(main())


def test_a_prefix_cached_after_the_call_went_first_is_cut_from_the_kv():
    """The engine thread found 4 of the prompt's tokens cached (cached since the node looked): the whole
    prompt's KV comes into a buffer, not the rows, and only what the cache lacks is loaded."""
    async def main():
        log: list[tuple] = []
        engine = FakeEngine(log, cached_tokens=4, holds_prefix=False)
        kv = torch.arange(2 * 2 * len(PROMPT)).view(2, 2, len(PROMPT), 1, 1)
        node = make_node(log, engine=engine, consumer=FakeConsumer(log, in_place=False, kv=kv))
        tokens, error = await collect(node)
        assert (tokens, error) == ([FIRST, DECODED], None)
        assert "expect" not in names(log)
        assert called(log, "prefill")[0][1].skip_tokens == 0
        loaded, start = called(log, "finish_remote_prefill")[0][3:6:2]
        assert start == 4 and torch.equal(loaded, kv[:, :, 4:])

    asyncio.run(main())


def test_a_prompt_whose_prefix_is_on_its_way_or_cached_here_waits_for_its_blocks_before_calling():
    async def main():
        for holds, arriving in ((True, False), (False, True)):
            log: list[tuple] = []
            node = make_node(log, engine=FakeEngine(log, holds_prefix=holds))
            if arriving:  # another request's fetch brings the same first block
                node.arriving[next(iter(LazyBlockHashes(PROMPT, 4)))] = 1
            assert (await collect(node))[1] is None
            assert names(log)[:4] == ["pick", "add_remote_request", "expect", "pull_hint"]
            assert called(log, "add_remote_request")[0][3] == LOOKUP_TIMEOUT  # it may wait for that prefix

    asyncio.run(main())


def test_a_burst_of_one_prompt_calls_first_once_and_the_rest_wait_for_its_prefix():
    """Requests for the same prompt that reach the node in one turn of the loop, before any fetch of theirs has
    run: the first calls first, the others wait in the engine for the prefix it brings (else each would
    fetch all of it)."""
    async def main():
        log: list[tuple] = []
        node = make_node(log, engine=FakeEngine(log, holds_prefix=False))
        results = await asyncio.gather(*(collect(node) for _ in range(3)))
        assert results == [([FIRST, DECODED], None)] * 3
        assert len(called(log, "sent")) == 1  # one call went first
        # its request added first, so that the engine has its prefix arriving; the others may wait for it
        assert [add[3] for add in called(log, "add_remote_request")] == [0, LOOKUP_TIMEOUT, LOOKUP_TIMEOUT]
        assert node.arriving == {} and node.adding == {}

    asyncio.run(main())


def test_a_fetch_cancelled_before_its_first_step_stops_counting_its_prefix():
    async def main():
        log: list[tuple] = []
        node = make_node(log)
        first_block = next(iter(LazyBlockHashes(PROMPT, 4)))
        added = asyncio.get_running_loop().create_future()
        fetch = node._start_fetch("r", PROMPT, SamplingParams(), "recompute", None, {}, first_block, added)
        assert node.arriving == {first_block: 1}
        fetch.cancel()  # before it ran any of its code
        with pytest.raises(asyncio.CancelledError):
            await fetch
        assert log == [] and node.arriving == {}

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_call_that_went_first_and_failed_before_the_request_was_added(policy):
    """The Prefill call fails while the engine thread still adds the request: the failure is handled
    once the request is there (recomputed or failed by the policy), not before."""
    async def main():
        log: list[tuple] = []
        hold = asyncio.Event()
        engine = FakeEngine(log, holds_prefix=False, add_hold=hold)
        node = make_node(log, engine=engine, policy=policy, answer=PrefillNodeUnavailable("prefill-0:50051 gone"),
                         consumer=FakeConsumer(log, lookup=WAIT))
        collecting = asyncio.create_task(collect(node))
        await logged(log, "prefill")
        await asyncio.sleep(0.05)
        assert "prefill_locally" not in names(log) and "fail" not in names(log)
        hold.set()
        tokens, error = await collecting
        assert_failed_over(log, tokens, error, policy)
        assert node.arriving == {} and node.adding == {}

    asyncio.run(main())


def test_a_kv_that_came_before_its_rows_were_known_is_handed_over_as_a_tensor():
    """Called first, the KV came before the engine thread had reserved the blocks: no destination is
    registered for a lookup that ended (none would be taken off again), and the tensor is loaded."""
    async def main():
        log: list[tuple] = []
        hold = asyncio.Event()
        node = make_node(log, engine=FakeEngine(log, holds_prefix=False, add_hold=hold))
        collecting = asyncio.create_task(collect(node))
        await logged(log, "drop_select")
        await asyncio.sleep(0.01)
        hold.set()
        assert await collecting == ([FIRST, DECODED], None)
        assert "expect" not in names(log)
        assert called(log, "finish_remote_prefill")[0][3:6:2] == (KV, 0)

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_call_that_fails_before_it_reaches_the_node_adds_the_request_then_fails_over(policy):
    """The Prefill call raised before the node had it (its `sent` never set by the client): the engine
    still gets the request, which is recomputed or failed by the policy, and nothing waits forever."""
    async def main():
        log: list[tuple] = []
        node = make_node(log, engine=FakeEngine(log, holds_prefix=False), policy=policy,
                         answer=RuntimeError("channel closed"), consumer=FakeConsumer(log, lookup=WAIT))
        node.pool.clients[0].send_hold = asyncio.Event()  # never set: it fails first
        node.pool.clients[0].fail_before_send = True
        tokens, error = await asyncio.wait_for(collect(node), 5)
        assert_failed_over(log, tokens, error, policy)
        assert node.arriving == {} and node.adding == {}

    asyncio.run(main())


def test_a_client_gone_before_the_call_reached_the_node_adds_nothing():
    async def main():
        log: list[tuple] = []
        node = make_node(log, engine=FakeEngine(log, holds_prefix=False), consumer=FakeConsumer(log, lookup=WAIT))
        node.pool.clients[0].send_hold = asyncio.Event()
        collecting = asyncio.create_task(collect(node))
        await logged(log, "drop_select")
        collecting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await collecting
        assert names(log)[-2:] == ["discard", "abort"]
        assert "add_remote_request" not in names(log) and "drop" not in names(log)
        assert node.arriving == {} and node.adding == {}

    asyncio.run(main())


def test_a_client_gone_before_the_request_was_added_stops_the_call_then_drops_the_request():
    async def main():
        log: list[tuple] = []
        hold = asyncio.Event()
        node = make_node(log, engine=FakeEngine(log, holds_prefix=False, add_hold=hold),
                         consumer=FakeConsumer(log, lookup=WAIT))
        collecting = asyncio.create_task(collect(node))
        await logged(log, "drop_select")
        collecting.cancel()
        await asyncio.sleep(0.05)
        assert names(log)[-2:] == ["discard", "abort"]  # the fetch ended; the request is not added yet
        hold.set()
        with pytest.raises(asyncio.CancelledError):
            await collecting
        rid = request_id(log)
        assert names(log)[-2:] == ["add_remote_request", "drop"] and called(log, "drop") == [("drop", rid)]
        assert node.arriving == {} and node.adding == {}

    asyncio.run(main())


def test_a_request_that_waited_for_an_arriving_prefix_asks_for_the_rest_and_is_counted():
    """The engine made the request wait (bounded by lookup_timeout) for its prefix, arriving for another
    request: the Prefill call skips what its slot, made after the wait, holds; /metrics counts the wait."""
    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    async def main():
        log: list[tuple] = []
        engine = FakeEngine(log, cached_tokens=4)
        engine.waited = PrefixWait(arriving=4, saved=4)
        hits, tokens = sample("disagg_arriving_prefix_waits_total", outcome="hit"), \
            sample("disagg_arriving_prefix_tokens_total")
        assert (await collect(make_node(log, engine=engine)))[1] is None
        assert called(log, "add_remote_request")[0][3] == LOOKUP_TIMEOUT
        assert called(log, "prefill")[0][1].skip_tokens == 4
        assert sample("disagg_arriving_prefix_waits_total", outcome="hit") == hits + 1
        assert sample("disagg_arriving_prefix_tokens_total") == tokens + 4

    asyncio.run(main())


def test_the_prefill_call_carries_the_pools_pull_hint_for_the_picked_node():
    async def main():
        log: list[tuple] = []
        node = make_node(log)
        node.pool.hint = ("prefill-1:50051", 5)
        assert (await collect(node))[1] is None
        assert called(log, "pull_hint") == [("pull_hint", node.pool.clients[0])]
        call = called(log, "prefill")[0][1]
        assert (call.pull_from, call.pull_blocks) == ("prefill-1:50051", 5)
        picked, hinted = node.pool.block_hashes
        assert picked is hinted  # the prompt's block hashes, computed once for both

    asyncio.run(main())


def test_happy_path_without_reserved_blocks_hands_the_tensor_over():
    async def main():
        log: list[tuple] = []
        node = make_node(log, engine=FakeEngine(log, rows=None), consumer=FakeConsumer(log, in_place=False))
        tokens, error = await collect(node)
        assert (tokens, error) == ([FIRST, DECODED], None)
        assert "expect" not in names(log)  # no blocks yet: nothing to receive into
        assert called(log, "prefill")[0][1].skip_tokens == 0
        assert called(log, "finish_remote_prefill")[0][3] == KV

    asyncio.run(main())


def test_prompt_logprobs_are_computed_here():
    async def main():
        log: list[tuple] = []
        node = make_node(log)
        tokens, error = await collect(node, SamplingParams(max_tokens=4, prompt_logprobs=1))
        assert (tokens, error) == ([LOCAL], None)
        assert names(log) == ["add_local_request"]

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_no_healthy_prefill_node(policy):
    async def main():
        log: list[tuple] = []
        node = make_node(log, available=False, policy=policy)
        tokens, error = await collect(node)
        rid = request_id(log)
        # The route's pick finds none; the fetch picks again to say why.
        assert names(log)[:4] == ["pick", "add_remote_request", "pick", "discard"]
        assert "prefill" not in names(log) and "abort" not in names(log)  # no client to tell
        if policy == "recompute":
            assert names(log)[4:] == ["prefill_locally"]  # nothing dropped: it runs on here
            assert (tokens, error) == ([LOCAL], None)
        else:
            assert names(log)[4:] == ["fail", "drop"]
            assert called(log, "fail")[0][1] == rid
            assert tokens == [] and isinstance(error, PrefillUnavailable)
            assert "no prefill node" in str(error) and "no healthy prefill node" in str(error)

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("prefill_error", [
    PrefillFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill node prefill-0:50051 made no progress within 5s"),
    PrefillNodeUnavailable("prefill node prefill-0:50051 is unreachable"),
    RuntimeError("unexpected"),
], ids=["idle-timeout", "unavailable", "other"])
def test_prefill_call_fails(prefill_error, policy):
    async def main():
        log: list[tuple] = []
        node = make_node(log, answer=prefill_error, policy=policy, consumer=FakeConsumer(log, lookup=WAIT))
        tokens, error = await collect(node)
        rid = request_id(log)
        assert ("drop_select cancelled", rid) in log  # the lookup begun with the call ends with it
        assert_failed_over(log, tokens, error, policy)
        if policy == "fail":
            assert str(prefill_error) in str(error)

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("lookup_error", [
    LookupTimeout("no KV for request arrived within 30s"),
    ProducerLost("the connection from producer 127.0.0.12:7200 broke while we waited"),
    EntryCancelled("the prefill node cancelled the KV on its way"),
    BufferFullError("KV arrived before its lookup and was dropped"),
    DigestMismatch("KV was computed for other tokens"),
], ids=["timeout", "producer-lost", "entry-cancelled", "buffer-full", "consumer-digest"])
def test_lookup_fails(lookup_error, policy):
    async def main():
        log: list[tuple] = []
        node = make_node(log, policy=policy, consumer=FakeConsumer(log, lookup=lookup_error))
        tokens, error = await collect(node)
        assert names(log).index("drop_select") < names(log).index("discard")
        assert_failed_over(log, tokens, error, policy)
        if policy == "fail":
            assert str(lookup_error) in str(error)
        assert node.kv_received_at == {}

    asyncio.run(main())


def test_the_first_token_goes_out_with_the_kv_before_the_call_answers():
    """The KV and the first token behind it on the pipe came; the Prefill call's answer, on its longer
    way, has not: the tokens stream at once, and the answer, when it comes, only feeds the route's costs."""
    async def main():
        log: list[tuple] = []
        hold = asyncio.Event()
        node = make_node(log, hold=hold)
        tokens, error = await asyncio.wait_for(collect(node), 2)
        assert (tokens, error) == ([FIRST, DECODED], None)
        assert "answered" not in names(log) and node.costs.control_seconds is None
        hold.set()
        await asyncio.sleep(0.05)
        assert names(log)[-1] == "answered"
        assert node.costs.control_seconds is not None and node.costs.bandwidth is not None

    asyncio.run(main())


def test_a_call_that_fails_after_its_kv_and_first_token_came_costs_the_request_nothing():
    async def main():
        log: list[tuple] = []
        hold = asyncio.Event()
        node = make_node(log, hold=hold, answer=PrefillNodeUnavailable("prefill node prefill-0:50051 is unreachable"))
        assert await asyncio.wait_for(collect(node), 2) == ([FIRST, DECODED], None)
        hold.set()
        await asyncio.sleep(0.05)
        assert names(log)[-1] == "answered"
        for name in ("discard", "abort", "prefill_locally", "fail"):
            assert name not in names(log)
        assert node.costs.control_seconds is None  # nothing learned from a failed call

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_kv_that_does_not_follow_the_answer_within_lookup_timeout_fails_over(policy):
    async def main():
        log: list[tuple] = []
        node = make_node(log, policy=policy, consumer=FakeConsumer(log, lookup=WAIT), lookup_timeout=0.2)
        start = time.perf_counter()
        tokens, error = await asyncio.wait_for(collect(node), 2)
        assert time.perf_counter() - start < 1.0
        assert_failed_over(log, tokens, error, policy)
        if policy == "fail":
            assert "within 0.2s of the prefill node's answer" in str(error)

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_blocks_a_peer_may_write_are_kept_aside(policy):
    async def main():
        log: list[tuple] = []
        consumer = FakeConsumer(log, lookup=ProducerLost("producer lost"), peer_may_write=True)
        node = make_node(log, policy=policy, consumer=consumer)
        tokens, error = await collect(node)
        rid = request_id(log)
        last = "prefill_locally" if policy == "recompute" else "fail"
        handoff = [name for name in names(log) if name != "drop"]
        assert handoff[-4:] == ["discard", "keep_remote_blocks_aside", "abort", last]
        assert called(log, "keep_remote_blocks_aside") == [("keep_remote_blocks_aside", rid)]
        assert "finish_remote_prefill" not in names(log)

    asyncio.run(main())


async def cancel_while_kv_awaited(peer_may_write: bool = False) -> tuple[list[tuple], DecodeNode]:
    """A caller (the API's pump task) cancelled while the node waits for the request's KV."""
    log: list[tuple] = []
    consumer = FakeConsumer(log, lookup=WAIT, peer_may_write=peer_may_write)
    node = make_node(log, consumer=consumer)
    caller = asyncio.create_task(collect(node))
    await asyncio.wait_for(consumer.waiting.wait(), 1)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    return log, node


def test_client_gone_while_kv_awaited_stops_the_fetch():
    async def main():
        log, node = await cancel_while_kv_awaited()
        rid = request_id(log)
        assert ("drop_select cancelled", rid) in log  # the fetch task was cancelled in its lookup
        assert names(log).index("discard") < names(log).index("abort")
        assert called(log, "discard") == [("discard", rid)]
        assert called(log, "abort") == [("abort", rid, ADVERTISE)]
        assert called(log, "drop") == [("drop", rid)]  # the engine aborted the request
        for name in ("finish_remote_prefill", "prefill_locally", "fail", "keep_remote_blocks_aside"):
            assert name not in names(log)
        assert node.kv_received_at == {}

    asyncio.run(main())


def test_client_gone_cuts_the_receive_before_the_blocks_are_given_back():
    async def main():
        log, _ = await cancel_while_kv_awaited(peer_may_write=True)
        order = names(log)
        assert order.index("discard") < order.index("keep_remote_blocks_aside") < order.index("drop")

    asyncio.run(main())


def test_client_gone_during_a_failed_fetch_still_keeps_blocks_aside_and_aborts():
    async def main():
        log: list[tuple] = []
        release = threading.Event()
        consumer = FakeConsumer(log, lookup=ProducerLost("producer lost"), peer_may_write=True,
                                hold_discard=release)
        node = make_node(log, consumer=consumer)
        caller = asyncio.create_task(collect(node))
        try:
            for _ in range(100):  # until the failure branch's discard runs in its thread
                if consumer.discarding.is_set():
                    break
                await asyncio.sleep(0.01)
            assert consumer.discarding.is_set()
            caller.cancel()
            await asyncio.sleep(0.05)
        finally:
            release.set()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.sleep(0.05)
        rid = request_id(log)
        assert called(log, "keep_remote_blocks_aside") == [("keep_remote_blocks_aside", rid)]
        assert called(log, "abort") == [("abort", rid, ADVERTISE)]

    asyncio.run(main())


def test_prefill_node_unhealthy_after_answering_cuts_the_wait():
    async def main():
        log: list[tuple] = []
        consumer = FakeConsumer(log, lookup=WAIT)
        node = make_node(log, consumer=consumer)
        client = node.pool.clients[0]
        caller = asyncio.create_task(collect(node))
        await asyncio.wait_for(consumer.waiting.wait(), 1)
        start = time.perf_counter()
        client.healthy = False  # the pool's health check found it down
        tokens, error = await asyncio.wait_for(caller, 2)
        assert time.perf_counter() - start < 1.0  # not the 30 s lookup timeout
        rid = request_id(log)
        # cut by the watch's discard, then failed over as any lookup failure (a second discard)
        assert names(log)[-4:] == ["discard", "discard", "abort", "prefill_locally"]
        assert called(log, "abort") == [("abort", rid, ADVERTISE)]
        assert "finish_remote_prefill" not in names(log)
        assert (tokens, error) == ([LOCAL], None)

    asyncio.run(main())


def test_healthy_prefill_node_is_not_cut():
    async def main():
        log: list[tuple] = []
        consumer = FakeConsumer(log, lookup=WAIT)
        node = make_node(log, consumer=consumer)
        caller = asyncio.create_task(collect(node))
        await asyncio.wait_for(consumer.waiting.wait(), 1)
        await asyncio.sleep(0.5)  # two of the watch's health polls
        assert "discard" not in names(log) and not caller.done()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller

    asyncio.run(main())
