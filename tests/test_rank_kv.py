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

from disagg.control_plane import KVRank, NodeInfo, PrefillCall
from disagg.decode_node.rank_kv import RankGone, RankReceiver, RankReceivers
from disagg.engine.sampling_params import SamplingParams
from disagg.lookup_buffer.errors import LookupDiscarded, ProducerLost
from disagg.prefill_node.node import LayerSender, PrefillNode, RankEntry

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
        self.calls.append(("expect", entry_id, into[0].rows.tolist()))

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

    async def main():
        await ranks.expect("r", [4, 5], 3, 20)
        await ranks.discard("r")

    asyncio.run(main())
    assert consumer.calls == [("expect", "r.1", list(range(3, 20))), ("discard", "r.1")]


def test_a_worker_lookup_that_fails_fails_the_request_naming_the_rank():
    lost = ProducerLost(f"no KV for request 'r.1': the connection from producer {PRODUCER} broke")
    ranks, _ = worker(FakeConsumer(lost))
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1: ProducerLost: no KV for request 'r.1'"):
        asyncio.run(ranks.drop_select("r", [1, 2, 3], 5.0, PRODUCER))


def test_a_worker_rank_that_dies_mid_lookup_fails_it_at_once_and_every_later_call():
    ranks, theirs = worker(None)

    async def main():
        lookup = asyncio.ensure_future(ranks.drop_select("r", [1, 2, 3], 30.0, PRODUCER))
        call = await asyncio.to_thread(theirs.recv)
        assert call.message.entry_id == "r.1"
        start = time.monotonic()
        theirs.close()  # its process gone: the driver's end of the channel sees it closed
        with pytest.raises(RankGone, match="rank 1's process ended"):
            await lookup
        assert time.monotonic() - start < 2  # not the lookup's 30 s
        with pytest.raises(RankGone):
            await ranks.expect("s", [1], 0, 16)

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
