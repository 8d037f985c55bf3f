"""The engine's bookkeeping on its own, with no model: BlockManager, Scheduler, KVCache and the
device block table (on the CPU)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from disagg.engine.block_manager import BlockManager
from disagg.engine.block_table import DeviceBlockTable
from disagg.engine.kv_arrival import KVArrival
from disagg.engine.kv_cache import KVCache
from disagg.engine.layers import attention
from disagg.engine.layers.attention import PrefillSegment, SdpaAttention, SdpaMetadata
from disagg.engine.remote_prefill import RemotePrefills
from disagg.engine.sampling_params import SamplingParams
from disagg.engine.scheduler import PROMPT_LOGPROB_TOKENS, Scheduler
from disagg.engine.sequence import RemotePrefill, Sequence, SequenceStatus
from disagg.pipes import RowScatter

BS = 4


def seq(request_id: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(temperature=0.0))


def computed(manager: BlockManager, s: Sequence) -> None:
    """As if the whole sequence had been computed this step."""
    s.num_computed_tokens = s.num_tokens
    manager.commit(s)


def test_allocate_and_free_return_every_block():
    manager = BlockManager(8, BS)
    a = seq("a", list(range(10)))
    manager.allocate(a)
    assert len(a.block_table) == 3 and manager.num_free_blocks == 5
    manager.free(a)
    assert a.block_table == [] and manager.num_free_blocks == 8


def test_prefix_hits_share_blocks_and_leave_the_last_token_to_compute():
    manager = BlockManager(8, BS)
    a = seq("a", list(range(12)))
    manager.allocate(a)
    computed(manager, a)
    b = seq("b", list(range(8)) + [99, 98])  # the same first two blocks
    manager.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    assert manager.blocks[a.block_table[0]].ref_count == 2
    c = seq("c", list(range(12)))  # all three blocks cached, but the last token must be computed
    manager.allocate(c)
    assert c.num_cached_tokens == 8
    d = seq("d", [5, 6, 7, 8] + list(range(4, 8)))  # block 2's tokens behind another prefix: no hit
    manager.allocate(d)
    assert d.num_cached_tokens == 0


def test_freed_cached_blocks_are_hit_again_and_evicted_least_recently_used_first():
    manager = BlockManager(4, BS)
    a = seq("a", list(range(9)))
    manager.allocate(a)
    computed(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 4
    b = seq("b", list(range(9)))
    assert manager.can_allocate(b)
    manager.allocate(b)
    assert b.num_cached_tokens == 8 and manager.num_free_blocks == 1
    manager.free(b)
    # Three fresh blocks: the uncached tail block and the never used one first, then the cached
    # ones, the later block first (a sequence frees its tail first).
    c = seq("c", [50 + i for i in range(12)])
    manager.allocate(c)
    manager.free(c)
    d = seq("d", list(range(9)))
    manager.allocate(d)
    assert d.num_cached_tokens == 4  # the second cached block was evicted, the first survived


def test_scheduler_chunks_long_prompts_under_the_token_budget():
    manager = BlockManager(64, BS)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=16)
    a, b = seq("a", list(range(40))), seq("b", list(range(100, 105)))
    scheduler.add(a)
    scheduler.add(b)
    chunks, sampled = [], []
    while a.num_computed_tokens < a.num_tokens:
        batch = scheduler.schedule()
        chunks.append([(item.seq.request_id, item.num_new_tokens) for item in batch])
        sampled.append([s.request_id for s in scheduler.postprocess(batch)])
    assert chunks == [[("a", 16)], [("a", 16)], [("a", 8), ("b", 5)]]
    assert sampled == [[], [], ["a", "b"]]  # a prompt's token is sampled once its last chunk ran
    assert len(manager.block_hashes["a"]) == 10  # its full blocks went into the prefix cache


def test_prompt_scoring_takes_a_capped_share_of_each_step_and_twins_score_once():
    """Issue 24: echo + logprobs + n on a long prompt filled whole steps while every stream waited.
    Prompts that ask for prompt logprobs take PROMPT_LOGPROB_TOKENS of a step together; a twin waits
    for the one scoring its prompt, takes its prompt logprobs and hits the prefix cache."""
    manager = BlockManager(256, BS)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=2048)
    victim = seq("victim", [7] * 5)
    scheduler.add(victim)
    victim.append_token(scheduler.postprocess(scheduler.schedule())[0].request_id == "victim")  # decoding now
    prompt = list(range(1000, 1000 + 2 * PROMPT_LOGPROB_TOKENS + 10))
    scorers = [Sequence(f"s{i}", prompt, SamplingParams(temperature=0.0, prompt_logprobs=1)) for i in range(3)]
    for s in scorers:
        scheduler.add(s)
    other = seq("other", list(range(50)))  # no prompt logprobs: not held back by them
    scheduler.add(other)
    steps = []
    while scorers[0].num_computed_tokens < len(prompt):
        batch = scheduler.schedule()
        steps.append({item.seq.request_id: item.num_new_tokens for item in batch})
        for item in batch:  # as the runner's prompt logprobs would
            if item.seq.scores_prompt:
                end = min(item.seq.num_computed_tokens + item.num_new_tokens, len(prompt) - 1)
                item.seq.prompt_logprobs += [None] * (end + 1 - len(item.seq.prompt_logprobs))
        for sampled in scheduler.postprocess(batch):
            sampled.append_token(1)
    assert steps == [{"victim": 1, "s0": PROMPT_LOGPROB_TOKENS, "other": 50},
                     {"victim": 1, "s0": PROMPT_LOGPROB_TOKENS, "other": 1},
                     {"victim": 1, "s0": 10, "other": 1}]
    twin = scorers[1]
    assert twin.status == SequenceStatus.WAITING and not twin.scores_prompt  # handed over
    assert twin.prompt_logprobs == scorers[0].prompt_logprobs
    cached = (len(prompt) - 1) // BS * BS  # its whole blocks but the last token's, from the prefix cache
    batch = scheduler.schedule()
    rest = len(prompt) - cached
    assert {item.seq.request_id: item.num_new_tokens for item in batch} == {"victim": 1, "other": 1, "s0": 1,
                                                                           "s1": rest, "s2": rest}
    assert twin.num_cached_tokens == cached


def test_scheduler_caps_running_sequences():
    manager = BlockManager(64, BS)
    scheduler = Scheduler(manager, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        scheduler.add(seq(str(i), [i] * 5))
    batch = scheduler.schedule()
    assert [item.seq.request_id for item in batch] == ["0", "1"] and len(scheduler.waiting) == 1


def test_scheduler_preempts_the_newest_when_blocks_run_out():
    manager = BlockManager(4, BS)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = seq("a", list(range(8))), seq("b", list(range(20, 28)))
    scheduler.add(a)
    scheduler.add(b)
    for item in scheduler.schedule():  # both prompts: all 4 blocks
        item.seq.num_computed_tokens += item.num_new_tokens
        item.seq.append_token(1)
    batch = scheduler.schedule()  # each needs a fifth block for its new token
    assert [item.seq.request_id for item in batch] == ["a"]
    assert b.status == SequenceStatus.WAITING and scheduler.waiting[0] is b and b.block_table == []
    assert scheduler.num_preemptions == 1


class FakeArrival(KVArrival):
    """A KV source whose KV arrives when the test says: every remote sequence waits for it."""

    def __init__(self):
        self.started: list[str] = []
        self.arrived: set[str] = set()

    def start(self, s: Sequence) -> None:
        self.started.append(s.request_id)

    def pending(self, s: Sequence) -> bool:
        return s.remote and s.request_id not in self.arrived

    def poll(self) -> None:
        pass

    def arrive(self, s: Sequence) -> None:
        """Its whole prompt's KV is in its blocks, and its first token was appended."""
        self.arrived.add(s.request_id)
        s.num_computed_tokens = s.num_prompt_tokens
        s.append_token(7)


def remote_seq(request_id: str, tokens: list[int]) -> Sequence:
    s = seq(request_id, tokens)
    s.remote = True
    return s


def run_batch(scheduler: Scheduler) -> list[str]:
    """Schedule and compute one batch; a sequence that computed its last token gets one more."""
    batch = scheduler.schedule()
    for s in scheduler.postprocess(batch):
        s.append_token(1)
    return [item.seq.request_id for item in batch]


def test_remote_sequences_get_blocks_in_arrival_order_and_run_once_their_kv_arrived():
    manager = BlockManager(4, BS)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=100)
    arrival = FakeArrival()
    scheduler.arrivals = [arrival]
    a, b = remote_seq("a", list(range(12))), remote_seq("b", list(range(8)))
    for s in (a, b):
        scheduler.add(s)
        scheduler.reserve()
    assert a.status == SequenceStatus.WAITING_FOR_KV and len(a.block_table) == 3
    assert b.status == SequenceStatus.WAITING and b.block_table == []  # one block left: it waits
    assert run_batch(scheduler) == [] and not scheduler.has_work()  # nothing to compute while KV is away
    scheduler.finish(a)
    scheduler.reserve()
    assert b.status == SequenceStatus.WAITING_FOR_KV and arrival.started == ["a", "b"]
    arrival.arrive(b)
    assert scheduler.has_work()
    assert run_batch(scheduler) == ["b"]  # its first token's decode
    assert scheduler.running == [b] and b.status == SequenceStatus.RUNNING


def test_a_sequence_holding_its_blocks_runs_past_one_that_waits_for_blocks():
    """A preempted sequence at the queue's head waits for more blocks than are free; a remote one behind
    it, whose KV has landed in blocks it holds, runs meanwhile (else nothing would free a block: both
    wait for ever), and no sequence behind the first is admitted before it."""
    manager = BlockManager(5, BS)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=100)
    arrival = FakeArrival()
    scheduler.arrivals = [arrival]
    a = seq("a", list(range(12)))
    scheduler.add(a)
    assert run_batch(scheduler) == ["a"]  # its prompt, in 3 blocks
    j, late = remote_seq("j", list(range(50, 58))), seq("late", [9] * 4)
    scheduler.add(j)
    scheduler.reserve()
    assert j.status == SequenceStatus.WAITING_FOR_KV and manager.num_free_blocks == 0
    scheduler.running.remove(a)
    scheduler.preempt(a)  # its 13 tokens need 4 blocks; 3 are free
    scheduler.add(late)  # 1 block would do, but it is behind a
    arrival.arrive(j)
    assert run_batch(scheduler) == ["j"]
    assert [s.request_id for s in scheduler.waiting] == ["a", "late"] and late.block_table == []
    scheduler.finish(j)
    assert run_batch(scheduler) == ["a", "late"]  # a first, then the one behind it


def test_max_num_seqs_caps_every_sequence_that_holds_blocks():
    """12 remote requests under max_num_seqs=4: at most 4 hold blocks (running or waiting for their
    KV) at any time, so a batch never has more than 4 (the GPU's block table has rows for 2x4)."""
    manager = BlockManager(64, BS)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=100)
    arrival = FakeArrival()
    scheduler.arrivals = [arrival]
    seqs = [remote_seq(f"r{i}", list(range(100 * i, 100 * i + 6))) for i in range(12)]
    for s in seqs:
        scheduler.add(s)
        scheduler.reserve()
    finished = []
    for step in range(200):
        for s in seqs:
            if s.status == SequenceStatus.WAITING_FOR_KV and s.request_id not in arrival.arrived and step % 3 == 0:
                arrival.arrive(s)
        batch = run_batch(scheduler)
        holding = [s for s in seqs if s.block_table]
        assert len(batch) <= 4 and len(scheduler.running) <= 4 and len(holding) <= 4
        for s in list(scheduler.running):
            if s.num_output_tokens >= 3:
                scheduler.finish(s)
                finished.append(s.request_id)
        if len(finished) == 12:
            break
    assert sorted(finished) == sorted(s.request_id for s in seqs)
    assert manager.num_free_blocks == 64


def test_a_local_sequence_behind_remote_ones_keeps_its_place_in_the_queue():
    manager = BlockManager(16, BS)
    scheduler = Scheduler(manager, max_num_seqs=2, max_num_batched_tokens=100)
    arrival = FakeArrival()
    scheduler.arrivals = [arrival]
    r, local, late = remote_seq("r", list(range(8))), seq("local", list(range(20, 28))), remote_seq("late", [1] * 8)
    for s in (r, local, late):
        scheduler.add(s)
        scheduler.reserve()
    # "late" overtakes nobody: the cap leaves one place, which the local sequence, ahead of it, takes.
    assert r.status == SequenceStatus.WAITING_FOR_KV and late.block_table == []
    assert run_batch(scheduler) == ["local"]
    assert late.status == SequenceStatus.WAITING


def test_kv_cache_gather_scatter_round_trip():
    cache = KVCache(num_layers=2, num_blocks=6, block_size=BS, num_kv_heads=2, head_dim=3,
                    dtype=torch.float32, device=torch.device("cpu"))
    blocks = [4, 1, 3]
    assert cache.slots(blocks, 6).tolist() == [16, 17, 18, 19, 4, 5]
    kv = torch.randn(2, 2, 10, 2, 3)
    cache.scatter(blocks, kv)
    assert torch.equal(cache.kv[:, :, cache.slots(blocks, 10)], kv)
    tail = torch.randn(2, 2, 4, 2, 3)
    cache.scatter(blocks, tail, start=6)  # a prefix already in place: only the rest is written
    assert torch.equal(cache.kv[:, :, cache.slots(blocks, 10)][:, :, :6], kv[:, :, :6])
    assert torch.equal(cache.kv[:, :, cache.slots(blocks, 10)][:, :, 6:], tail)
    k, v = torch.randn(2, 2, 3), torch.randn(2, 2, 3)
    cache.store(1, k, v, torch.tensor([0, 23]))
    assert torch.equal(cache.keys(1)[[0, 23]], k) and torch.equal(cache.values(1)[[0, 23]], v)


def test_device_block_table_sends_only_what_changed():
    table = DeviceBlockTable(num_rows=2, max_blocks=4, device=torch.device("cpu"))
    a, b = seq("a", [0]), seq("b", [0])
    a.block_table, b.block_table = [5, 2], [7]

    def step(*seqs):
        rows, updates = table.assign(list(seqs))
        table.apply(torch.from_numpy(updates))
        return rows, updates.shape[1]

    rows, sent = step(a, b)
    assert sent == 3 and table.table[rows[0], :2].tolist() == [5, 2] and table.table[rows[1], 0] == 7
    assert step(a, b) == (rows, 0)  # nothing changed: nothing sent
    a.block_table.append(9)  # a decode crossed a block boundary
    assert step(a, b) == (rows, 1) and table.table[rows[0], 2] == 9
    a.block_table = [1]  # freed and allocated again: a new list, the whole row is sent
    assert step(a) == (rows[:1], 1) and table.table[rows[0], 0] == 1
    c = seq("c", [0])
    c.block_table = [3, 3]
    rows_c, sent = step(a, c)  # no free row: b, not in this step, gives its row back
    assert rows_c[1] == rows[1] and sent == 2 and "b" not in table.rows


def test_reused_blocks_are_handed_out_in_ascending_order():
    """Blocks come back to the free list tail first (descending); a new sequence still gets them in
    ascending order, so the views a socket receives its KV into merge into one run per layer and K/V
    instead of one per block (32,768 views for an 8k prompt of 32 layers)."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    cache = KVCache(num_layers=2, num_blocks=16, block_size=BS, num_kv_heads=1, head_dim=2,
                    dtype=torch.float32, device=torch.device("cpu"))
    first = Sequence("first", list(range(64)), SamplingParams())
    bm.allocate(first)
    first.num_computed_tokens = 64
    bm.commit(first)  # cached blocks are kept, least recently used first: the tail's first
    bm.free(first)
    assert list(bm.free_ids)[:3] == [15, 14, 13]
    again = Sequence("again", list(range(100, 164)), SamplingParams())
    bm.allocate(again)
    assert again.block_table == list(range(16))
    rows = cache.rows(again.block_table, 0, 64)
    assert torch.equal(rows, torch.arange(64))
    assert len(RowScatter(cache.kv, rows).views()) == 2 * 2


def test_device_block_table_rows_suffice_for_any_batch_of_max_num_seqs():
    """Rows are 2 x max_num_seqs: batches of up to max_num_seqs, whose members come and go, always
    find one; a batch larger than the rows (a cap bypassed) is refused with the reason."""
    max_num_seqs = 3
    table = DeviceBlockTable(num_rows=2 * max_num_seqs, max_blocks=4, device=torch.device("cpu"))
    seqs = [seq(f"s{i}", [i]) for i in range(20)]
    for s in seqs:
        s.block_table = [0]
    for step in range(40):
        batch = [seqs[(step * 2 + k) % 20] for k in range(max_num_seqs)]
        rows, _ = table.assign(batch)
        assert len(set(rows)) == len(batch)
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        table.assign(seqs[:2 * max_num_seqs + 1])


def sdpa_chunk_after_context(context: int, chunk: int, heads: int = 9, kv_heads: int = 3,
                             dim: int = 64) -> torch.Tensor:
    """SdpaAttention's output for the last `chunk` tokens of a `context`-token prompt whose earlier
    tokens are in the cache: a later chunk of a chunked prefill."""
    generator = torch.Generator().manual_seed(0)
    cache = KVCache(num_layers=1, num_blocks=-(-context // 16), block_size=16, num_kv_heads=kv_heads, head_dim=dim,
                    dtype=torch.float32, device=torch.device("cpu"))
    cache.kv.normal_(generator=generator)
    q = torch.randn(chunk, heads, dim, generator=generator)
    k, v = torch.randn(2, chunk, kv_heads, dim, generator=generator)
    meta = SdpaMetadata(slot_mapping=torch.arange(context - chunk, context), num_decodes=0, decode_slots=None,
                        decode_mask=None, prefills=[PrefillSegment(0, chunk, context, torch.arange(context))])
    return SdpaAttention(cache).forward(0, q, k, v, meta)


def test_a_chunk_after_a_long_context_attends_in_blocks_with_the_same_result(monkeypatch):
    """Queries of a chunk after cached context go in blocks bounded by SCORES_BYTES; each row's
    attention is what one call over all rows gives."""
    whole = sdpa_chunk_after_context(context=300, chunk=100)
    monkeypatch.setattr(attention, "SCORES_BYTES", 9 * 300 * 4 * 7)  # 7 query rows a block
    torch.testing.assert_close(sdpa_chunk_after_context(context=300, chunk=100), whole, rtol=0, atol=1e-6)


@pytest.mark.slow  # a few seconds of attention on the CPU
def test_a_2048_token_chunk_after_6k_cached_tokens_stays_within_its_score_budget():
    """Issue 24 item 8: one 8k-token prompt took a CPU node up by 1.5 GB, the whole score matrix of its
    last chunk ([9 heads, 2,048, 8,192] float32 and its softmax) at once. In blocks, the step's peak
    stays a few blocks' worth."""
    script = ("import resource, torch; from tests.test_engine_parts import sdpa_chunk_after_context; "
              "torch.set_num_threads(1); before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
              "sdpa_chunk_after_context(context=8192, chunk=2048); "
              "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)")
    grown_mb = int(subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                                  cwd=Path(__file__).resolve().parents[1]).stdout)
    assert grown_mb < 400, f"the chunk's attention took {grown_mb} MB at its peak"


def remote_prefills(num_blocks: int = 16) -> tuple[BlockManager, Scheduler, RemotePrefills]:
    """A decode node's bookkeeping: remote prefill as its one KV source, over a small CPU cache."""
    manager = BlockManager(num_blocks, BS)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=100)
    kv_cache = KVCache(1, num_blocks, BS, 1, 1, torch.float32, torch.device("cpu"))
    remote = RemotePrefills(kv_cache, manager, 1, (1, 1), [])
    scheduler.arrivals = [remote]
    return manager, scheduler, remote


def add_remote(scheduler: Scheduler, request_id: str, tokens: list[int], wait: bool = True) -> Sequence:
    """As LLMEngine.add_request(remote_prefill=True, wait_for_prefix=wait) does."""
    s = remote_seq(request_id, tokens)
    s.waits_for_prefix = wait
    scheduler.add(s)
    scheduler.reserve()
    return s


def land(remote: RemotePrefills, s: Sequence) -> None:
    """Its first token and KV came (into its blocks), and the next poll loads it."""
    s.append_token(7)
    remote.receive(s, RemotePrefill(None, s.num_cached_tokens))
    remote.poll()


def test_a_request_waits_for_its_prefix_arriving_for_another_then_hits_it():
    """Issue 26: b's first two blocks are those a holds and is receiving; b takes no blocks (nothing
    reads KV not landed: they are no hits yet) and holds nobody up, then hits them once a's KV is loaded."""
    manager, scheduler, remote = remote_prefills()
    a = add_remote(scheduler, "a", list(range(12)))
    b_tokens = list(range(10)) + [90, 91, 92]  # blocks 0 and 1 as a's, block 2 not
    assert remote.arriving_tokens(remote_seq("probe", b_tokens)) == 2 * BS
    b = add_remote(scheduler, "b", b_tokens)
    other = add_remote(scheduler, "other", list(range(100, 112)))  # another prefix never waits
    assert a.status == other.status == SequenceStatus.WAITING_FOR_KV
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and remote.blocked(b)
    assert manager.prefix_hits(b) == []
    assert run_batch(scheduler) == [] and not scheduler.has_work()  # the engine loop does not spin on b
    land(remote, a)
    assert not remote.blocked(b) and scheduler.has_work()
    assert run_batch(scheduler) == ["a"]  # a decodes; b gets its blocks, the two landed ones shared
    assert b.status == SequenceStatus.WAITING_FOR_KV and b.num_cached_tokens == 2 * BS
    assert b.block_table[:2] == a.block_table[:2] and not b.waits_for_prefix
    assert remote.arriving_tokens(remote_seq("probe", list(range(12)) + [1])) == 0  # a's are hits now
    assert remote.arriving_tokens(remote_seq("probe", b_tokens)) == BS  # b's own third block is arriving


@pytest.mark.parametrize("ending", ["recomputed", "aborted"])
def test_a_request_waiting_for_a_prefix_goes_on_as_before_when_that_request_ends_without_it(ending):
    manager, scheduler, remote = remote_prefills()
    a = add_remote(scheduler, "a", list(range(12)))
    b = add_remote(scheduler, "b", list(range(12)) + [5])
    assert remote.blocked(b)
    if ending == "recomputed":  # as LLMEngine.prefill_locally: the prefill node failed
        a.remote = False
        scheduler.requeue(a)
    else:
        scheduler.finish(a)
    assert not remote.blocked(b)
    run_batch(scheduler)  # a recomputed goes first; b gets its blocks behind it
    assert b.status == SequenceStatus.WAITING_FOR_KV and b.num_cached_tokens == 0  # all of it is asked for


def test_a_request_not_told_to_wait_takes_its_blocks_at_once():
    manager, scheduler, remote = remote_prefills()
    add_remote(scheduler, "a", list(range(12)))
    b = add_remote(scheduler, "b", list(range(12)) + [5], wait=False)
    assert b.status == SequenceStatus.WAITING_FOR_KV and b.num_cached_tokens == 0 and not remote.blocked(b)
