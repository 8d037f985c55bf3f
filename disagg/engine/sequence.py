"""Sequence: one request's tokens, state and block table."""

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagg.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for blocks, to compute its prompt or receive its KV
    WAITING_FOR_KV = "waiting_for_kv"  # holds its blocks; some of its KV is on its way (a KVArrival)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the n most likely (token id, logprob), when asked


@dataclass
class RemotePrefill:
    kv: torch.Tensor | None  # [layers, 2, prompt tokens from kv_start on, kv heads, head dim]; None: in the blocks
    kv_start: int = 0  # the prompt tokens before it were in this engine's prefix cache: not sent


@dataclass
class KVExport:
    """Where a prefill node's request hands out its prompt's KV: during each step that computes a
    chunk of the prompt, right after each group of `layers` ([first, end) pairs covering all layers
    in order) has run, `put(first, end, kv)` gets those layers' KV [layers, 2, tokens, kv heads,
    head dim] of the prompt tokens from `start` (or from where the last chunk's ended) to the end of
    the chunk, on the engine's device; a put's CUDA work is queued on the engine thread's current
    stream, so the receiver waits for it there before reading (docs/ARCHITECTURE.md, "Layer-wise
    send")."""

    start: int  # prompt tokens before it are not exported (the decode node holds them)
    layers: list[tuple[int, int]]
    put: Callable[[int, int, torch.Tensor], None]
    at_end: bool = False  # all of it in the step that completes the prompt, not chunk by chunk
    sent: int = 0  # prompt tokens handed out so far (a preempted prompt computed again skips them)
    failed: bool = False  # a put raised (its receiver broke): nothing more is handed out
    # Under tensor parallelism each rank's put gets its own KV heads only (no gather): the driver's the
    # node's put, a worker's what the node's rank_service returned there (EngineConfig.rank_service).
    # Else the driver's put gets every head, gathered from the ranks.
    own_heads: bool = False
    # Gets the prompt's first token and its logprob (if asked for) on the engine thread as soon as it is
    # sampled, after every put: a prefill node sends it behind the KV. None: not wanted (a worker rank's).
    first_token: Callable[[int, TokenLogprob | None], None] | None = None


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.params = params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, how many came from the prefix cache
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        self.logprobs: list[TokenLogprob] = []
        # When asked: one entry per prompt token, None for the first (nothing before it predicts it).
        self.prompt_logprobs: list[TokenLogprob | None] | None = None if params.prompt_logprobs is None else [None]
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.arrival_time = time.monotonic()
        self.kv_export: KVExport | None = None  # prefill node: where its prompt's KV goes
        self.remote = False  # decode node: its prompt's KV and first token come from a prefill node
        self.remote_prefill: RemotePrefill | None = None  # ... the KV has come, not loaded yet
        # Decode node: its prompt's next blocks were arriving for another request when it was added, so it
        # takes no blocks while they still are (RemotePrefills.blocked), then hits them in the prefix cache.
        self.waits_for_prefix = False
        self.block_keys: list[tuple[int, tuple[int, ...]]] = []  # BlockManager.block_keys, kept as they are made

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def scores_prompt(self) -> bool:
        """It asks for prompt logprobs and does not hold them all yet (a twin computing the same prompt
        may have handed them over: Scheduler.postprocess)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
