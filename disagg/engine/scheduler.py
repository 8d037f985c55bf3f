"""Scheduler: continuous batching of prompt chunks and decodes under a token budget.

Every step is one batch. Running sequences go first (a decode is one token, a long prompt
continues with its next chunk), then waiting ones are admitted while blocks, the sequence
cap and the token budget allow. When a running sequence needs a block and none is free,
the newest running sequence is preempted: its blocks are freed and it goes back to the
head of the queue, to be recomputed from its tokens later.
"""

from collections import deque
from dataclasses import dataclass

from disagg.engine.block_manager import BlockManager
from disagg.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Sequences whose KV is computed elsewhere: first they wait for blocks, then for the KV.
        self.reserving: deque[Sequence] = deque()
        self.waiting_for_kv: dict[str, Sequence] = {}
        # Sequences with blocks whose prefix is being loaded from a lower KV tier (KVOffload).
        self.loading: dict[str, Sequence] = {}
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_remote(self, seq: Sequence) -> list[Sequence]:
        """Queue a remote sequence for blocks; the sequences that got blocks now (see reserve)."""
        seq.status = SequenceStatus.WAITING_FOR_KV
        self.reserving.append(seq)
        return self.reserve()

    def reserve(self) -> list[Sequence]:
        """Give blocks to remote sequences, in arrival order, while blocks are free; those that got them."""
        reserved = []
        while self.reserving and self.block_manager.can_allocate(self.reserving[0]):
            seq = self.reserving.popleft()
            self.block_manager.allocate(seq)
            self.waiting_for_kv[seq.request_id] = seq
            reserved.append(seq)
        return reserved

    def start_remote(self, seq: Sequence) -> None:
        """Its KV has been loaded into its blocks: decode it from now on."""
        del self.waiting_for_kv[seq.request_id]
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def start_loading(self, seq: Sequence) -> None:
        """Give a waiting sequence its blocks now: a lower KV tier fills its prefix, then it runs."""
        self.waiting.remove(seq)
        self.block_manager.allocate(seq)
        self.loading[seq.request_id] = seq

    def finish_loading(self, seq: Sequence) -> None:
        """Its prefix is loaded: it computes the rest from the next step, as a running sequence."""
        del self.loading[seq.request_id]
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_append(seq, n):
                preempted = True
                victim = self.running.pop()
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slots(seq, n)
                batch.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        # Admitting new work right after a preemption would only evict it again.
        i = 0
        while (i < len(self.waiting) and not preempted and budget > 0
               and len(self.running) + len(self.loading) < self.max_num_seqs):
            seq = self.waiting[i]
            if seq.tier_blocked:  # its prefix is being loaded for another request: the others go on
                i += 1
                continue
            if not self.block_manager.can_allocate(seq):
                break
            del self.waiting[i]
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def postprocess(self, batch: list[ScheduledSeq]) -> list[Sequence]:
        """The batch was computed: advance each sequence and register its newly full blocks in
        the prefix cache. Returns the sequences that now need a sampled token, in batch order."""
        sampled = []
        for item in batch:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.commit(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                sampled.append(seq)
        return sampled

    def preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.tier_looked_up = False  # its blocks may be in a lower KV tier by now
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.reserving:
            self.reserving.remove(seq)
        self.waiting_for_kv.pop(seq.request_id, None)
        self.loading.pop(seq.request_id, None)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
