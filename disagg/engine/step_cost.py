"""What a prompt token costs this engine, measured from its own steps (IterationStats), so that a
node can estimate how long a prompt takes to compute: a decode node to choose between computing a
prompt itself and sending it to a prefill node, a prefill node to report its throughput and how long
the step it is running should take.

A step costs a base (what a step of decodes alone takes: the weights read, the fixed overheads)
plus a cost per prompt token it computes. The base is a moving average of the steps that computed no
prompt token; the cost per token is the time of the steps that did, less the base, over the prompt
tokens they computed, both sums decaying so that the estimate follows the machine's current load. A
prefill node runs no decode-only steps, so its base stays unknown (0) and the per-token cost takes
the whole step: tokens over seconds is its prefill throughput.
"""

from disagg.engine.request_stats import IterationStats

DECAY = 0.9  # each step that computed prompt tokens keeps this much of the sums before it
BASE_WEIGHT = 0.1  # of a decode-only step in the base's moving average
MIN_MEASURED_TOKENS = 256  # prompt tokens measured before the per-token cost is trusted to route by


class StepCost:
    """A stat logger (AsyncEngine.stat_loggers): `record` runs on the engine thread, the estimates are
    read from any thread (plain floats, each written at once)."""

    def __init__(self):
        self.base_seconds: float | None = None
        self.tokens = 0.0  # decayed sum of the prompt tokens of the steps that computed some
        self.seconds = 0.0  # decayed sum of those steps' time beyond the base
        self.measured_tokens = 0  # in all, undecayed: whether enough has been measured

    def record(self, stats: IterationStats) -> None:
        if stats.step_seconds is None:
            return
        if stats.step_prompt_tokens == 0:
            base = self.base_seconds
            self.base_seconds = stats.step_seconds if base is None else (
                (1 - BASE_WEIGHT) * base + BASE_WEIGHT * stats.step_seconds)
            return
        extra = max(0.0, stats.step_seconds - (self.base_seconds or 0.0))
        self.seconds = DECAY * self.seconds + extra
        self.tokens = DECAY * self.tokens + stats.step_prompt_tokens
        self.measured_tokens += stats.step_prompt_tokens

    def seconds_per_token(self, min_tokens: int = MIN_MEASURED_TOKENS) -> float | None:
        """A prompt token's measured cost, or None before `min_tokens` were measured."""
        if self.measured_tokens < max(1, min_tokens) or self.tokens <= 0:
            return None
        return self.seconds / self.tokens

    def tokens_per_second(self) -> float:
        """Measured prefill throughput; 0 before it is measured."""
        per_token = self.seconds_per_token()
        return 1.0 / per_token if per_token else 0.0

    def step_seconds(self, prompt_tokens: int) -> float | None:
        """How long a step computing `prompt_tokens` prompt tokens should take, by whatever was measured
        (the first step's own cost is better than none), or None before any step that computed some."""
        per_token = self.seconds_per_token(min_tokens=1)
        if per_token is None:
            return None
        return (self.base_seconds or 0.0) + prompt_tokens * per_token
