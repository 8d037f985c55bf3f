"""RemotePrefills: a decode node's requests whose prompt KV and first token a prefill node computes
(a KVArrival; docs/ARCHITECTURE.md, "A request, end to end").

Such a sequence is added as `remote`: the scheduler gives it blocks as soon as it can (at once if
it can), and it waits as WAITING_FOR_KV. Its KV comes either straight into its blocks (`rows`,
filled by the lookup buffer's receiver) or as a tensor; `receive` takes that, and `poll` loads it
once the sequence holds its blocks and the sources before this one (the KV tiers, for the prefix
they hold) are done. From then on it is an ordinary sequence.

A request whose prompt's next blocks after its prefix-cache hits are the very blocks another remote
request holds and is about to receive can wait for them (`waits_for_prefix`, `blocked`) instead of
having them sent again: once loaded they are in the prefix cache, and it hits them. Until
then they are not cached: nothing reads KV that has not landed.

Its first token comes with the KV. Its output is made once, by `FirstToken`, where the token
arrives (the decode node's event loop), so it never waits for the engine's step in flight; the
engine then takes over the state that made it.
"""

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagg.engine.block_manager import BlockManager
from disagg.engine.kv_arrival import KVArrival
from disagg.engine.kv_cache import KVCache
from disagg.engine.output import RequestOutput, TextState, advance, make_output
from disagg.engine.sequence import RemotePrefill, Sequence, SequenceStatus, TokenLogprob
from disagg.engine.structured_output import Grammar

logger = logging.getLogger(__name__)


class FirstToken:
    """A remote request's first token made into its output, once, by whoever holds this: made on the
    engine thread when the request is added, from copies of the request's state (its tokens, text
    and, with a grammar, a copy of its own), and from then on the caller's alone, so no thread
    reads the engine's. The engine takes its state over with the KV (LLMEngine.finish_remote_prefill)."""

    def __init__(self, seq: Sequence, text: TextState, grammar: Grammar | None,
                 eos_token_ids: set[int], max_model_len: int, vocab_size: int):
        self.seq = copy.copy(seq)
        self.seq.token_ids, self.seq.logprobs = list(seq.token_ids), list(seq.logprobs)
        self.text = text.copy()
        self.grammar = grammar
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.token: int | None = None

    def output(self, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        """The token's output. Raises ValueError for a token outside the vocabulary or off the
        request's grammar (a prefill node that did not apply it), before it could be sent."""
        if self.token is not None:
            raise ValueError(f"request {self.seq.request_id} has its first token already")
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"first token {token} of {self.seq.request_id} is outside the vocabulary")
        if self.grammar is not None and not self.grammar.allows(token):
            raise ValueError(f"first token {token} of {self.seq.request_id} does not follow the request's grammar")
        advance(self.seq, self.text, token, logprob, self.eos_token_ids, self.max_model_len)
        self.token = token
        return make_output(self.seq, self.text, token)


@dataclass
class RemoteSlot:
    """What a remote request holds once added: the leading prompt tokens whose KV is in its blocks
    already (the prefill node need not send it), the rows of the KV cache (`cache`, [layers, 2, rows,
    kv_heads, head_dim]) for the rest, where the KV can be received in place (None: the request waits
    for blocks, so its KV comes as a tensor), its blocks, and its first token's maker. Under tensor
    parallelism `cache` is rank 0's, which holds its heads only; each rank's cache has the same rows
    (KVCache.rows of `blocks`), where its own heads are received."""
    cached_tokens: int
    cache: torch.Tensor
    rows: torch.Tensor | None
    blocks: list[int]
    first: FirstToken


class RemotePrefills(KVArrival):
    def __init__(self, kv_cache: KVCache, block_manager: BlockManager, num_layers: int, kv_shape: tuple[int, int],
                 before: list[KVArrival], load: Callable[[list[int], torch.Tensor, int], None] | None = None):
        """load(block_ids, kv, start): writes received KV of every head into the blocks, from token start
        on (ModelRunner.load_kv: under tensor parallelism, each rank's heads to it); None: kv_cache.scatter."""
        self.kv_cache = kv_cache
        self.load = load or kv_cache.scatter
        self.block_manager = block_manager
        self.num_layers = num_layers
        self.kv_shape = kv_shape  # (kv heads, head dim)
        self.before = before  # sources whose KV lies before ours in a prompt: loaded first
        self.received: dict[str, Sequence] = {}  # KV in hand, not loaded yet
        self.failed: list[tuple[Sequence, Exception]] = []  # their load raised in poll
        self.reserved: dict[str, Sequence] = {}  # remote sequences that got blocks; pruned by poll once loaded

    def start(self, seq: Sequence) -> None:
        # Nothing to ask for here: the decode node calls the prefill node. Its KV will land in these blocks.
        seq.waits_for_prefix = False
        if seq.remote:
            self.reserved[seq.request_id] = seq

    def pending(self, seq: Sequence) -> bool:
        return seq.remote

    def blocked(self, seq: Sequence) -> bool:
        """It was added to wait for its prefix arriving for another request, and it still is."""
        return seq.waits_for_prefix and self.arriving_tokens(seq) > 0

    def arriving_tokens(self, seq: Sequence) -> int:
        """How many prompt tokens after the sequence's prefix-cache hits (whole blocks) are in blocks that
        another remote request holds and whose KV it has not loaded yet: equal block keys (chained hashes
        and tokens), so the same prefix. Once loaded, they are hits."""
        bm = self.block_manager
        hits = len(bm.prefix_hits(seq))
        longest = hits
        for other in self.reserved.values():
            if other is seq or not other.remote or other.status != SequenceStatus.WAITING_FOR_KV:
                continue  # loaded, recomputed or ended since (poll prunes it)
            end = min(bm.num_block_keys(seq), other.num_prompt_tokens // bm.block_size)
            i = hits
            while i < end and bm.block_key(seq, i) == bm.block_key(other, i):
                i += 1
            longest = max(longest, i)
        return (longest - hits) * bm.block_size

    def slot(self, seq: Sequence, first: FirstToken) -> RemoteSlot:
        holds = seq.status == SequenceStatus.WAITING_FOR_KV
        rows = self.kv_cache.rows(seq.block_table, seq.num_cached_tokens, seq.num_prompt_tokens) if holds else None
        return RemoteSlot(seq.num_cached_tokens, self.kv_cache.kv, rows, list(seq.block_table), first)

    def receive(self, seq: Sequence, remote: RemotePrefill) -> None:
        """Take a remote sequence's KV (of prompt tokens remote.kv_start on; None: in its blocks
        already, received at its slot's rows). Raises ValueError, before anything changes,
        for KV that does not fit."""
        if not seq.remote or seq.request_id in self.received:
            raise ValueError(f"request {seq.request_id} does not wait for remote KV")
        expected = (self.num_layers, 2, seq.num_prompt_tokens - remote.kv_start, *self.kv_shape)
        holds = seq.status == SequenceStatus.WAITING_FOR_KV
        if remote.kv is None and (not holds or remote.kv_start != seq.num_cached_tokens):
            raise ValueError(f"KV for {seq.request_id} is said to be in its blocks, but they were not reserved "
                             f"with {remote.kv_start} cached tokens")
        if remote.kv is not None and tuple(remote.kv.shape) != expected:
            raise ValueError(f"KV for {seq.request_id} has shape {tuple(remote.kv.shape)}, expected {expected}")
        if holds and remote.kv_start > seq.num_cached_tokens:
            raise ValueError(f"KV for {seq.request_id} starts at token {remote.kv_start}, but only "
                             f"{seq.num_cached_tokens} are in this engine's cache")
        seq.remote_prefill = remote
        self.received[seq.request_id] = seq

    def poll(self) -> None:
        """Load the received KV of the sequences that hold their blocks and whose earlier KV (the
        tiers') is in: they run from the next schedule. One whose load raised goes to `failed` with
        its error (the others go on)."""
        for request_id, seq in list(self.reserved.items()):
            if not seq.remote or seq.status != SequenceStatus.WAITING_FOR_KV:
                del self.reserved[request_id]
        for request_id, seq in list(self.received.items()):
            if seq.status == SequenceStatus.FINISHED or not seq.remote:
                del self.received[request_id]
            elif self._loadable(seq):
                del self.received[request_id]
                try:
                    self._load(seq)
                except Exception as e:
                    logger.exception("loading the received KV of %s failed", request_id)
                    self.failed.append((seq, e))

    def load_now(self, seq: Sequence) -> None:
        """Load a sequence's received KV at once if it can be (it holds its blocks, and the tiers'
        part is in): a request that its first token ended still leaves its prompt's KV in the
        prefix cache."""
        if self.received.pop(seq.request_id, None) is not None and self._loadable(seq):
            self._load(seq)

    def has_loads(self) -> bool:
        """Received KV that the next poll loads."""
        return any(seq.status == SequenceStatus.WAITING_FOR_KV for seq in self.received.values())

    def _loadable(self, seq: Sequence) -> bool:
        """It holds its blocks, and the sources before this one have brought their part."""
        return seq.status == SequenceStatus.WAITING_FOR_KV and not any(a.pending(seq) for a in self.before)

    def _load(self, seq: Sequence) -> None:
        remote = seq.remote_prefill
        start = seq.num_cached_tokens
        if remote.kv is not None and start < seq.num_prompt_tokens:  # else it is in the blocks already
            # Leading blocks hit in our own prefix cache (or the host tier) already hold this KV.
            self.load(seq.block_table, remote.kv[:, :, start - remote.kv_start:], start)
            if remote.kv.is_cuda:  # received on another stream: not reused before this scatter has read it
                remote.kv.record_stream(torch.cuda.current_stream(remote.kv.device))
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.commit(seq)
        seq.remote, seq.remote_prefill = False, None  # the received tensor is not held while it decodes

    def keep_blocks_aside(self, seq: Sequence) -> int:
        """A peer may still write into the blocks reserved for this sequence's KV (a one-sided receive
        cut off before its writes ended): hold them for good, so that no other request is given
        them. Returns how many; call it before the request is aborted or recomputed."""
        blocks = seq.block_table[seq.num_cached_tokens // self.block_manager.block_size:]
        for block_id in blocks:
            self.block_manager.hold(block_id)
        logger.warning("%d KV blocks of %s are kept out of use for good: a peer may still write into them",
                       len(blocks), seq.request_id)
        return len(blocks)
