"""Scheduler: continuous batching of prompt chunks and decodes under a token budget.

Every step is one batch. Running sequences go first (a decode is one token, a long prompt continues
with its next chunk), then waiting ones, in arrival order, while the sequence cap, blocks and the
token budget allow; one that must wait for blocks or a place stops the admissions behind it, not the
sequences behind it that hold their blocks and have their KV. A waiting sequence that gets its
blocks asks each KV source (`KVArrival`: the KV tiers, remote prefill) for what it holds of its KV;
if any of it is still on its way, the sequence stays in the queue as WAITING_FOR_KV, holding its
blocks, until it has arrived, and then runs. max_num_seqs caps every sequence that holds blocks,
running or waiting for its KV, so a batch never has more. When a running sequence needs a block and
none is free, the newest running sequence is preempted: its blocks are freed and it goes back to the
head of the queue, to be recomputed from its tokens later.

Prompts that ask for prompt logprobs (which skip the prefix cache, and a decode node computes itself)
take at most PROMPT_LOGPROB_TOKENS of a step together, and a request's n choices score their prompt
once: a twin (same prompt, same prompt_logprobs) waits while another computes it, then takes its
prompt logprobs and its KV from the prefix cache.
"""

from collections import deque
from dataclasses import dataclass

from disagg.engine.block_manager import BlockManager
from disagg.engine.kv_arrival import KVArrival
from disagg.engine.sequence import Sequence, SequenceStatus

# Prompt tokens that sequences scoring their prompt may compute in one step, together. echo + logprobs
# with n = 4 on a 1,000-token prompt filled two whole steps of a CPU decode node (4,000 tokens, each
# with a full-vocabulary log-softmax row): every stream in the batch waited ~10 s a token (issue 24).
PROMPT_LOGPROB_TOKENS = 256


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last token, and so samples its next one."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()  # WAITING, or WAITING_FOR_KV (holding blocks)
        self.running: list[Sequence] = []
        self.arrivals: list[KVArrival] = []  # in the order their KV lies in a prompt: tiers, then remote
        self.num_preemptions = 0

    @property
    def num_holding(self) -> int:
        """Sequences that hold blocks: running, or waiting for their KV. Capped by max_num_seqs."""
        return len(self.running) + sum(1 for seq in self.waiting if seq.status == SequenceStatus.WAITING_FOR_KV)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def admit(self, seq: Sequence) -> bool:
        """Give a waiting sequence its blocks if the cap and the free blocks allow, and start the KV
        sources on it; it runs now if none of its KV is on its way, else waits for it. False: it
        must wait for blocks or a place."""
        if (self.num_holding >= self.max_num_seqs or self.blocked(seq)
                or not self.block_manager.can_allocate(seq)):
            return False
        self.block_manager.allocate(seq)
        for arrival in self.arrivals:
            arrival.start(seq)
        seq.status = SequenceStatus.WAITING_FOR_KV if self.kv_pending(seq) else SequenceStatus.RUNNING
        return True

    def kv_pending(self, seq: Sequence) -> bool:
        return any(arrival.pending(seq) for arrival in self.arrivals)

    def reserve(self) -> None:
        """Between steps: give blocks, in arrival order, to the waiting sequences whose KV comes from
        elsewhere (remote prefill), so that it lands in them as it comes. Stops at the first that must
        wait for blocks or a place, or that computes its prompt (the next schedule admits that one):
        nobody is overtaken. One whose prefix is arriving for another request is passed, as schedule
        passes it."""
        for seq in self.waiting:
            if seq.status != SequenceStatus.WAITING or self.blocked(seq):
                continue
            if not (seq.remote and self.admit(seq)):
                return

    def blocked(self, seq: Sequence) -> bool:
        return any(arrival.blocked(seq) for arrival in self.arrivals)

    def has_work(self) -> bool:
        """A step would run something: a running sequence, one whose KV has arrived, or the first
        waiting one that is not waiting for a prefix arriving for another, if it can get its blocks
        (else the loop would spin until blocks are freed, or the prefix has come)."""
        if self.running:
            return True
        first = True
        for seq in self.waiting:
            if seq.status == SequenceStatus.WAITING_FOR_KV:
                if not self.kv_pending(seq):
                    return True
            elif first and not self.blocked(seq):
                first = False
                if self.num_holding < self.max_num_seqs and self.block_manager.can_allocate(seq):
                    return True
        return False

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scoring_budget = PROMPT_LOGPROB_TOKENS
        batch: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.scores_prompt:
                n = min(n, scoring_budget)
                scoring_budget -= n
                if n == 0:  # its next chunk waits for the next step
                    i += 1
                    continue
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
        admitting = True
        while i < len(self.waiting) and not preempted and budget > 0:
            seq = self.waiting[i]
            if seq.status == SequenceStatus.WAITING_FOR_KV and self.kv_pending(seq):
                i += 1  # the others go on meanwhile
                continue
            if seq.scores_prompt and (scoring_budget == 0 or self.twin_scoring(seq)):
                i += 1  # the others go on meanwhile
                continue
            if seq.status == SequenceStatus.WAITING:
                if admitting and not self.admit(seq):
                    # No place or no blocks: the ones behind it are not admitted before it. Those that hold
                    # their blocks and have their KV still run: they take no place, and their blocks come
                    # back only once they have run.
                    admitting = self.blocked(seq) and self.num_holding < self.max_num_seqs
                if seq.status != SequenceStatus.RUNNING:  # not admitted, or admitted to wait for its KV
                    i += 1
                    continue
            del self.waiting[i]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.scores_prompt:
                n = min(n, scoring_budget)
                scoring_budget -= n
            if not self.block_manager.can_append(seq, n):  # a remote first token's slot: the next step preempts
                break
            self.block_manager.append_slots(seq, n)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def postprocess(self, batch: list[ScheduledSeq]) -> list[Sequence]:
        """The batch was computed: advance each sequence and register its newly full blocks in
        the prefix cache. Returns the sequences that now need a sampled token, in batch order."""
        sampled = []
        for item in batch:
            seq, samples = item.seq, item.samples
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.commit(seq)
            if samples:
                sampled.append(seq)
                if seq.num_output_tokens == 0 and seq.prompt_logprobs is not None and not seq.scores_prompt:
                    self.hand_prompt_logprobs_to_twins(seq)
        return sampled

    def twin_scoring(self, seq: Sequence) -> bool:
        """A running twin of this sequence is scoring the prompt: this one waits and takes the result."""
        return any(is_twin(other, seq) and other.scores_prompt for other in self.running)

    def hand_prompt_logprobs_to_twins(self, seq: Sequence) -> None:
        """The sequence has scored its whole prompt: its waiting twins take its prompt logprobs (the
        same computation, so the same values) and need compute only what the prefix cache lacks."""
        for other in self.waiting:
            if other.status == SequenceStatus.WAITING and other.scores_prompt and is_twin(other, seq):
                other.prompt_logprobs = list(seq.prompt_logprobs)

    def preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def requeue(self, seq: Sequence) -> None:
        """A sequence waiting for its KV is to compute its prompt instead: its blocks go back (the
        prefix cache keeps what it can) and it waits for new ones where it stood in the queue."""
        self.block_manager.free(seq)
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED


def is_twin(a: Sequence, b: Sequence) -> bool:
    """Same prompt, same prompt logprobs asked (n choices of one request, or equal requests)."""
    return (a is not b and a.params.prompt_logprobs == b.params.prompt_logprobs
            and a.prompt_token_ids == b.prompt_token_ids)
