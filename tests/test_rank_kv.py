"""A decode node's worker ranks receiving their own KV heads (decode_node/rank_kv.py) and the prefill
node's entries per decode rank, with fakes and no model (the fast lane). The real processes are in
test_tensor_parallel.py."""

import asyncio
import multiprocessing
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from disagg.control_plane import HeadsEntry, KVRank, NodeInfo, PrefillCall, plan_entries
from disagg.decode_node.rank_kv import RankGone, RankReceiver, RankReceivers
from disagg.engine.sampling_params import SamplingParams
from disagg.lookup_buffer.errors import BufferFullError, LookupDiscarded, ProducerLost
from disagg.prefill_node.layer_sender import LayerSender, RankEntry
from disagg.prefill_node.node import PrefillNode
from disagg.prefill_node.rank_send import Abort, Finish, RankSender, RankSenders
from disagg.rank_calls import RankCallFailed, RankCalls, RankNoAnswer

pytestmark = pytest.mark.timeout(10)

KV_DEST = ("127.0.0.1", 7100)  # rank 0's endpoint
PRODUCER = ("127.0.0.1", 7200)


class FakeConsumer:
    """A worker's consumer: its entry arrives in place once released, or its lookup fails."""

    def __init__(self, error: Exception | None = None):
        self.error = error
        self.calls: list[tuple] = []
        self.discarded = threading.Event()

    def expect(self, entry_id, into):
        self.calls.append(("expect", entry_id, into[0].rows.tolist(), into[0].heads))

    def drop_select(self, entry_id, token_ids, timeout, source):
        self.calls.append(("select", entry_id, source))
        if self.error is not None:
            raise self.error
        if self.discarded.wait(timeout):
            raise LookupDiscarded(f"lookup for request {entry_id!r} ended: the request was discarded")
        return SimpleNamespace(in_place=True)

    def discard(self, entry_id):
        self.calls.append(("discard", entry_id))
        self.discarded.set()

    def peer_may_write(self, entry_id):
        return False

    def close(self):
        pass


def worker(consumer: FakeConsumer | None) -> tuple[RankReceivers, multiprocessing.connection.Connection]:
    """RankReceivers of one worker rank (heads 1-3 of 3) whose receiver runs on a thread here (None: the
    test plays the worker's end itself)."""
    mine, theirs = multiprocessing.Pipe()
    theirs.send(("127.0.0.1", 7101))
    if consumer is not None:
        kv_cache = SimpleNamespace(kv=torch.zeros(1), rows=lambda blocks, start, end: torch.arange(start, end))
        receiver = RankReceiver(consumer, kv_cache, theirs, [0])
        threading.Thread(target=receiver.serve, daemon=True).start()
    return RankReceivers([mine], [(0, 1), (1, 3)], "127.0.0.1"), theirs


def test_each_rank_is_named_with_its_heads_and_expects_its_own_entry():
    consumer = FakeConsumer()
    ranks, _ = worker(consumer)
    assert ranks.kv_ranks(KV_DEST) == [KVRank(KV_DEST, (0, 1)), KVRank(("127.0.0.1", 7101), (1, 3))]

    entries = plan_entries("r", [(0, 1), (1, 3)], [(0, 3)])

    async def main():
        await ranks.expect(entries, [4, 5], 3, 20)
        await ranks.discard(entries)

    asyncio.run(main())
    assert consumer.calls == [("expect", "r.1", list(range(3, 20)), None), ("discard", "r.1")]


def test_a_rank_expects_an_entry_from_each_prefill_rank_into_its_heads_of_the_rows():
    # Prefill TP=2 (heads 0 and 1-2) -> this worker (heads 1-2): one entry from prefill rank 1, of all
    # its heads; prefill TP=3 (one head each): an entry of head 1 and one of head 2, each in its place.
    consumer = FakeConsumer()
    ranks, _ = worker(consumer)
    three = plan_entries("s", [(0, 1), (1, 3)], [(0, 1), (1, 2), (2, 3)])

    async def main():
        await ranks.expect(plan_entries("r", [(0, 1), (1, 3)], [(0, 1), (1, 3)]), [4], 0, 16)
        await ranks.expect(three, [4], 0, 16)
        await ranks.discard(three)

    asyncio.run(main())
    rows = list(range(16))
    assert consumer.calls == [("expect", "r.r1.p1", rows, None), ("expect", "s.r1.p1", rows, (0, 1)),
                              ("expect", "s.r1.p2", rows, (1, 2)), ("discard", "s.r1.p1"), ("discard", "s.r1.p2")]


def test_each_head_goes_once_from_the_lowest_prefill_rank_holding_it_to_each_decode_rank_holding_it():
    three = [(0, 3)]
    # One prefill rank: the entry ids decode nodes knew before prefill ranks sent their own.
    assert plan_entries("r", three, three) == [HeadsEntry("r", 0, 0, (0, 3))]
    assert plan_entries("r", [(0, 1), (1, 3)], three) == [HeadsEntry("r", 0, 0, (0, 1)),
                                                          HeadsEntry("r.1", 1, 0, (1, 3))]
    # Prefill TP=2 (the embedded model's 3 KV heads go 1 + 2) -> decode TP=1, and -> decode TP=2 alike.
    assert plan_entries("r", three, [(0, 1), (1, 3)]) == [HeadsEntry("r.r0.p0", 0, 0, (0, 1)),
                                                          HeadsEntry("r.r0.p1", 0, 1, (1, 3))]
    assert plan_entries("r", [(0, 1), (1, 3)], [(0, 1), (1, 3)]) == [HeadsEntry("r.r0.p0", 0, 0, (0, 1)),
                                                                     HeadsEntry("r.r1.p1", 1, 1, (1, 3))]
    # Splits that differ: prefill TP=3 -> decode TP=2.
    assert plan_entries("r", [(0, 1), (1, 3)], [(0, 1), (1, 2), (2, 3)]) == [
        HeadsEntry("r.r0.p0", 0, 0, (0, 1)), HeadsEntry("r.r1.p1", 1, 1, (1, 2)), HeadsEntry("r.r1.p2", 1, 2, (2, 3))]
    # Replicated on the prefill node (2 KV heads on 4 ranks): ranks 1 and 3 hold copies and send nothing.
    assert plan_entries("r", [(0, 2)], [(0, 1), (0, 1), (1, 2), (1, 2)]) == [HeadsEntry("r.r0.p0", 0, 0, (0, 1)),
                                                                             HeadsEntry("r.r0.p2", 0, 2, (1, 2))]
    # Replicated on the decode node: each decode rank holding a head gets it.
    assert plan_entries("r", [(0, 1), (0, 1)], [(0, 1), (0, 1)]) == [HeadsEntry("r.r0.p0", 0, 0, (0, 1)),
                                                                     HeadsEntry("r.r1.p0", 1, 0, (0, 1))]


def test_a_worker_lookup_that_fails_fails_the_request_naming_the_rank():
    lost = ProducerLost(f"no KV for request 'r.1': the connection from producer {PRODUCER} broke")
    ranks, _ = worker(FakeConsumer(lost))
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1: ProducerLost: no KV for request 'r.1'"):
        asyncio.run(ranks.drop_select(plan_entries("r", [(0, 1), (1, 3)], [(0, 3)]), [1, 2, 3], 5.0, PRODUCER))


def test_a_worker_rank_that_dies_mid_lookup_fails_it_at_once_and_every_later_call():
    ranks, theirs = worker(None)

    async def main():
        lookup = asyncio.ensure_future(ranks.drop_select(plan_entries("r", [(0, 1), (1, 3)], [(0, 3)]), [1, 2, 3],
                                                         30.0, PRODUCER))
        call = await asyncio.to_thread(theirs.recv)
        assert call.message.entry_ids == ["r.1"]
        start = time.monotonic()
        theirs.close()  # its process gone: the driver's end of the channel sees it closed
        with pytest.raises(RankGone, match="rank 1's process ended"):
            await lookup
        assert time.monotonic() - start < 2  # not the lookup's 30 s
        with pytest.raises(RankGone):
            await ranks.expect(plan_entries("s", [(0, 1), (1, 3)], [(0, 3)]), [1], 0, 16)

    asyncio.run(main())


def prefill_node(num_kv_heads: int = 3) -> PrefillNode:
    info = NodeInfo("m", "float32", 2, num_kv_heads, 4, 16, "tcp", "127.0.0.1", 7200)
    return PrefillNode(SimpleNamespace(stat_loggers=[]), producer=None, info=info)


def test_a_prefill_node_opens_one_entry_per_decode_rank_with_its_heads():
    node = prefill_node()
    call = PrefillCall("r", [1, 2, 3], SamplingParams(), KV_DEST,
                       kv_ranks=[KVRank(KV_DEST, (0, 1)), KVRank(("127.0.0.1", 7101), (1, 3))])
    assert node.rank_entries_of(call) == [RankEntry("r", KV_DEST, (0, 1)),
                                          RankEntry("r.1", ("127.0.0.1", 7101), (1, 3))]
    whole = PrefillCall("r", [1], SamplingParams(), KV_DEST)  # a decode node without TP: every head to kv_dest
    assert node.rank_entries_of(whole) == [RankEntry("r", KV_DEST, None)]
    # Replicated KV heads (fewer than the decode ranks): each rank gets the one it holds.
    one_head = prefill_node(num_kv_heads=1)
    replicated = PrefillCall("r", [1], SamplingParams(), KV_DEST,
                             kv_ranks=[KVRank(KV_DEST, (0, 1)), KVRank(("127.0.0.1", 7101), (0, 1))])
    assert [e.heads for e in one_head.rank_entries_of(replicated)] == [(0, 1), (0, 1)]
    with pytest.raises(ValueError, match=r"decode rank heads \[2, 4\] are not a run of this model's 3 KV heads"):
        node.rank_entries_of(PrefillCall("r", [1], SamplingParams(), KV_DEST, kv_ranks=[KVRank(KV_DEST, (2, 4))]))


def test_a_layer_group_goes_to_each_rank_as_its_heads_only():
    puts = []
    producer = SimpleNamespace(put=lambda entry_id, first, end, kv, ready: puts.append((entry_id, kv)) or True)
    sender = LayerSender(producer, [RankEntry("r", KV_DEST, (0, 1)), RankEntry("r.1", KV_DEST, (1, 3))], 2, None)
    kv = torch.randn(2, 2, 5, 3, 4)  # [layers, 2, tokens, kv heads, head dim]
    sender.put(0, 2, kv)
    assert [entry_id for entry_id, _ in puts] == ["r", "r.1"]
    assert torch.equal(puts[0][1], kv[:, :, :, :1]) and torch.equal(puts[1][1], kv[:, :, :, 1:])
    assert all(part.is_contiguous() for _, part in puts)
    assert sender.tokens_put == 5


def test_a_tp2_prefill_node_has_each_rank_send_its_own_heads_to_each_decode_rank():
    info = NodeInfo("m", "float32", 2, 3, 4, 16, "tcp", "127.0.0.1", 7200, kv_rank_heads=[(0, 1), (1, 3)])
    node = PrefillNode(SimpleNamespace(stat_loggers=[]), producer=None, info=info)
    worker_dest = ("127.0.0.1", 7101)
    to_tp2 = PrefillCall("r", [1, 2, 3], SamplingParams(), KV_DEST,
                         kv_ranks=[KVRank(KV_DEST, (0, 1)), KVRank(worker_dest, (1, 3))])
    assert node.rank_entries_of(to_tp2) == [RankEntry("r.r0.p0", KV_DEST, (0, 1), 0),
                                            RankEntry("r.r1.p1", worker_dest, (1, 3), 1)]
    to_tp1 = PrefillCall("r", [1, 2, 3], SamplingParams(), KV_DEST, kv_ranks=[KVRank(KV_DEST, (0, 3))])
    assert node.rank_entries_of(to_tp1) == [RankEntry("r.r0.p0", KV_DEST, (0, 1), 0),
                                            RankEntry("r.r0.p1", KV_DEST, (1, 3), 1)]
    # A request still waiting for its blocks takes every head on one endpoint: rank 0 sends them, gathered.
    assert node.rank_entries_of(PrefillCall("r", [1], SamplingParams(), KV_DEST)) == [RankEntry("r", KV_DEST, None)]


def test_a_rank_s_layer_group_goes_as_its_own_heads_counted_once_put():
    puts, counted = [], []
    producer = SimpleNamespace(put=lambda entry_id, first, end, kv, ready: puts.append((entry_id, kv)) or True)
    # Prefill rank 1 holds heads 1-2 of 3: decode rank 0 (heads 0-1) takes head 1, decode rank 1 head 2.
    sender = LayerSender(producer, [RankEntry("r.r0.p1", KV_DEST, (1, 2), 1),
                                    RankEntry("r.r1.p1", KV_DEST, (2, 3), 1)], 2, None, 1, counted.append)
    kv = torch.randn(2, 2, 5, 2, 4)  # the rank's own 2 heads
    sender.put(0, 2, kv)
    assert torch.equal(puts[0][1], kv[:, :, :, :1]) and torch.equal(puts[1][1], kv[:, :, :, 1:])
    assert counted == [kv.nbytes // 2, kv.nbytes // 2] and sender.tokens_put == 5


class FakeProducer:
    def __init__(self):
        self.calls: list[tuple] = []

    def open(self, entry_id, token_ids, layers, tokens, nbytes, dest):
        self.calls.append(("open", entry_id, tokens, nbytes, dest))
        return True

    def put(self, entry_id, first, end, kv, ready):
        self.calls.append(("put", entry_id, first, end, tuple(kv.shape)))
        return True

    def abort(self, entry_id, dest=None):
        self.calls.append(("abort", entry_id))
        return True

    def close(self):
        pass


def test_a_worker_rank_opens_puts_and_reports_its_own_entries():
    mine, theirs = multiprocessing.Pipe()
    producer = FakeProducer()
    rank_sender = RankSender(producer, 2, None, theirs, [0])
    threading.Thread(target=rank_sender.serve, daemon=True).start()
    senders = RankSenders([mine], [(0, 1), (1, 3)], 1.0)

    def entries(request_id: str) -> list[RankEntry]:
        return [RankEntry(f"{request_id}.r0.p0", KV_DEST, (0, 1), 0),
                RankEntry(f"{request_id}.r1.p1", ("127.0.0.1", 7101), (1, 3), 1)]

    async def main():
        await senders.open("r", entries("r"), [10, 20], [1, 2, 3], [(0, 2)], 3)
        rank_sender.put("r", 0, 2, torch.zeros(2, 2, 3, 2, 4))  # as the rank's step does
        assert await senders.finish("r", [1]) == {1: 3}
        await senders.open("s", entries("s"), [10, 20], [1, 2, 3], [(0, 2)], 3)
        assert await senders.abort("s", [1])

    asyncio.run(main())
    worker_dest = ("127.0.0.1", 7101)
    assert producer.calls == [("open", "r.r1.p1", 3, 20, worker_dest), ("put", "r.r1.p1", 0, 2, (2, 2, 3, 2, 4)),
                              ("open", "s.r1.p1", 3, 20, worker_dest), ("abort", "s.r1.p1")]
    assert senders.put == [2 * 2 * 3 * 2 * 4 * 4]  # its bytes put, reported with each reply


def test_a_worker_s_full_buffer_refuses_the_prefill_as_busy_and_leaves_nothing_open():
    mine, theirs = multiprocessing.Pipe()

    class FullProducer(FakeProducer):
        def open(self, entry_id, token_ids, layers, tokens, nbytes, dest):
            raise BufferFullError(f"no room for {entry_id!r} within 5s")

    producer = FullProducer()
    threading.Thread(target=RankSender(producer, 2, None, theirs, [0]).serve, daemon=True).start()
    senders = RankSenders([mine], [(0, 1), (1, 3)], 1.0)
    entries = [RankEntry("r.r0.p0", KV_DEST, (0, 1), 0), RankEntry("r.r1.p1", ("127.0.0.1", 7101), (1, 3), 1)]
    with pytest.raises(BufferFullError, match="tensor-parallel rank 1: BufferFullError: no room for 'r.r1.p1'"):
        asyncio.run(senders.open("r", entries, [10, 20], [1, 2, 3], [(0, 2)], 3))
    assert producer.calls == []  # nothing was opened, so nothing to abort


def test_a_worker_put_that_fails_aborts_its_entries_at_once_and_finish_tells_the_driver():
    mine, theirs = multiprocessing.Pipe()

    class BrokenProducer(FakeProducer):
        def put(self, entry_id, first, end, kv, ready):
            raise ValueError("put of layers [0, 2) for 'r.r1.p1'; layers [0, 1] come next")

    producer = BrokenProducer()
    rank_sender = RankSender(producer, 2, None, theirs, [0])
    threading.Thread(target=rank_sender.serve, daemon=True).start()
    senders = RankSenders([mine], [(0, 1), (1, 3)], 1.0)

    async def main():
        await senders.open("r", [RankEntry("r.r1.p1", ("127.0.0.1", 7101), (1, 3), 1)], [20], [1, 2, 3], [(0, 2)], 3)
        with pytest.raises(ValueError):
            rank_sender.put("r", 0, 2, torch.zeros(2, 2, 3, 2, 4))
        assert producer.calls[-1] == ("abort", "r.r1.p1")  # its decode rank hears it now
        assert await senders.finish("r", [1]) == {1: 0}  # short: the driver fails the request

    asyncio.run(main())


def test_a_worker_that_does_not_answer_fails_the_call_at_its_timeout():
    mine, _theirs = multiprocessing.Pipe()  # nobody serves the other end
    calls = RankCalls([mine])
    calls.start()

    async def main():
        with pytest.raises(RankNoAnswer, match="rank 1 did not answer Finish within 0.2s"):
            await calls.call(1, Finish("r"), 0.2)
        assert calls.calls == {}  # its wait is gone too

    asyncio.run(main())


def test_a_call_that_raises_on_the_worker_is_answered_with_why_and_the_next_calls_still_are():
    mine, theirs = multiprocessing.Pipe()

    class AbortRaises(FakeProducer):
        def abort(self, entry_id, dest=None):
            raise OSError("the pipe layer broke")

    threading.Thread(target=RankSender(AbortRaises(), 2, None, theirs, [0]).serve, daemon=True).start()
    senders = RankSenders([mine], [(0, 1), (1, 3)], 1.0)

    async def main():
        await senders.open("r", [RankEntry("r.r1.p1", ("127.0.0.1", 7101), (1, 3), 1)], [20], [1, 2, 3], [(0, 2)], 3)
        with pytest.raises(RankCallFailed, match="rank 1: OSError: the pipe layer broke"):
            await senders.calls.call(1, Abort("r"), 5.0)
        assert await senders.finish("r", [1]) == {1: 0}  # still served

    asyncio.run(main())
