"""What the engine did, for the metrics: each request's times and token counts, and each step's
tokens, recorded by the engine thread (AsyncEngine) and handed to its stat loggers after each turn
of its loop, as vLLM's engine hands its loggers IterationStats. Plain numbers: the engine imports
nothing outside disagg/engine, so disagg/metrics.py turns them into Prometheus families.

A request's times, on the engine thread's clock:
- queued: added to the engine;
- scheduled: given its blocks the first time (a remote request: its KV is on its way from then); a
  preemption does not reset it, as in vLLM;
- first: its first token (a remote request: when the prefill node's token came);
- last: its last token.
Queue time is scheduled - queued, prefill time first - scheduled, decode time last - first and
inference time last - scheduled. Each engine request counts as one request: an API request with n
choices is n of them.
"""

from dataclasses import dataclass, field

from disagg.engine.output import RequestOutput
from disagg.engine.sequence import Sequence, SequenceStatus

# Where a prompt token's KV came from, as vLLM's prompt_tokens_by_source names it: computed here,
# found in this engine's prefix cache (its host and disk tiers included), or received from a prefill node.
LOCAL_COMPUTE, LOCAL_CACHE_HIT, EXTERNAL_KV_TRANSFER = "local_compute", "local_cache_hit", "external_kv_transfer"
PROMPT_SOURCES = (LOCAL_COMPUTE, LOCAL_CACHE_HIT, EXTERNAL_KV_TRANSFER)


@dataclass(frozen=True)
class FinishedRequest:
    finish_reason: str  # stop, length, abort or error
    num_prompt_tokens: int
    num_computed_prompt_tokens: int  # of those, computed by this engine (neither cached nor received)
    num_generation_tokens: int
    max_tokens: int
    queue_time: float
    prefill_time: float
    decode_time: float
    inference_time: float


@dataclass
class IterationStats:
    """One turn of the engine loop: the calls run between two steps, and the step."""
    # The step's tokens as vLLM counts them: the prompts of the prefills it finished, and the tokens it
    # sampled. None: no step ran.
    step_tokens: int | None = None
    step_seconds: float | None = None  # how long the step ran
    step_prompt_tokens: int = 0  # prompt tokens the step computed (chunks included), for its measured cost
    prompt_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROMPT_SOURCES, 0))  # first tokens'
    finished: list[FinishedRequest] = field(default_factory=list)


@dataclass
class _Times:
    seq: Sequence
    queued: float
    scheduled: float | None = None
    first: float | None = None
    last: float | None = None
    computed: int = 0  # prompt tokens this engine computed, known at the first token


class RequestStats:
    """Kept by the engine thread only."""

    def __init__(self):
        self.requests: dict[str, _Times] = {}
        self.unscheduled: dict[str, _Times] = {}  # waiting for their first blocks
        self.turn = IterationStats()
        self.step_tokens = 0

    def added(self, seq: Sequence, now: float) -> None:
        times = _Times(seq, now)
        self.requests[seq.request_id] = self.unscheduled[seq.request_id] = times

    def check_scheduled(self, now: float) -> None:
        """After the engine may have given blocks: the requests that got theirs were scheduled `now`."""
        for request_id, times in list(self.unscheduled.items()):
            if times.seq.status is not SequenceStatus.WAITING:
                times.scheduled = now
                del self.unscheduled[request_id]

    def output(self, out: RequestOutput, now: float) -> None:
        """An output of the step that just ran (the prompt's own first token, or the next ones)."""
        times = self.requests.get(out.request_id)
        if times is None:
            return
        if out.new_token_ids:
            if times.first is None:
                num_prompt = len(out.prompt_token_ids)
                self._first(times, now, {LOCAL_CACHE_HIT: out.num_cached_tokens,
                                         LOCAL_COMPUTE: num_prompt - out.num_cached_tokens})
                self.step_tokens += num_prompt
            times.last = now
            self.step_tokens += len(out.new_token_ids)
        if out.finished:
            self.finished(out.request_id, out.finish_reason or "stop", now)

    def remote_first_token(self, request_id: str, at: float, kv_start: int) -> None:
        """A remote request's first token came `at`, with the KV of its prompt from token `kv_start` on
        (those before were in this engine's cache)."""
        times = self.requests.get(request_id)
        if times is None or times.first is not None:
            return
        num_prompt = times.seq.num_prompt_tokens
        self._first(times, at, {LOCAL_CACHE_HIT: kv_start, EXTERNAL_KV_TRANSFER: num_prompt - kv_start})
        times.last = at

    def _first(self, times: _Times, at: float, sources: dict[str, int]) -> None:
        times.first = at
        times.computed = sources.get(LOCAL_COMPUTE, 0)
        if times.scheduled is None:  # a remote prompt computed while it waited here for blocks: all queue
            times.scheduled = at
            self.unscheduled.pop(times.seq.request_id, None)
        for source, count in sources.items():
            self.turn.prompt_tokens[source] += count

    def finished(self, request_id: str, reason: str, now: float) -> None:
        times = self.requests.pop(request_id, None)
        if times is None:
            return
        self.unscheduled.pop(request_id, None)
        scheduled = now if times.scheduled is None else times.scheduled
        first = now if times.first is None else times.first
        last = first if times.last is None else times.last
        seq = times.seq
        self.turn.finished.append(FinishedRequest(
            reason, seq.num_prompt_tokens, times.computed, seq.num_output_tokens, seq.params.max_tokens,
            scheduled - times.queued, first - scheduled, last - first, last - scheduled))

    def stepped(self, seconds: float = 0.0, prompt_tokens: int = 0) -> None:
        """A step ran, for `seconds`, computing `prompt_tokens` prompt tokens: its tokens go into this turn."""
        self.turn.step_tokens = self.step_tokens
        self.turn.step_seconds = seconds
        self.turn.step_prompt_tokens = prompt_tokens
        self.step_tokens = 0

    def take(self) -> IterationStats | None:
        """This turn's stats, if anything happened in it, and a fresh turn."""
        turn, self.turn = self.turn, IterationStats()
        if turn.step_tokens is None and not turn.finished and not any(turn.prompt_tokens.values()):
            return None
        return turn
