"""What a step of this engine costs, measured from its own steps (IterationStats), so that a node can
estimate how long a prompt takes to compute: a decode node to choose between computing a prompt
itself and sending it to a prefill node, a prefill node to report its throughput and how long the
step it is running should take.

A step takes a base (what any step costs: the weights read, the fixed overheads; a step of decodes
costs about that) plus a cost per prompt token it computes: seconds = base + per_token x prompt
tokens, fitted by least squares over the recent steps (sums that decay, so the fit follows the
machine's current load). A decode node's many decode-only steps pin the base; a prefill node's
chunks of different sizes do. Where the sizes do not spread enough to fit a line (a prefill node
fed prompts of one length), the base is taken as 0 and the cost per token is the time over the
tokens, which is still the node's throughput.
"""

from disagg.engine.request_stats import IterationStats

DECAY = 0.98  # each step keeps this much of the sums before it
MIN_MEASURED_TOKENS = 64  # prompt tokens measured before the fit is trusted to route by


class StepCost:
    """A stat logger (AsyncEngine.stat_loggers): `record` runs on the engine thread; the estimates
    are read from any thread (each reads a few floats, a step's update at worst half applied, which
    only nudges an estimate)."""

    def __init__(self):
        # Decayed sums over the steps of: 1, prompt tokens n, n^2, seconds t, n x t.
        self.w = self.n = self.nn = self.t = self.nt = 0.0
        self.prompt_tokens = 0.0  # decayed sum of n over the steps that computed some, and their seconds:
        self.prompt_seconds = 0.0  # the fallback fit's
        self.measured_tokens = 0  # in all, undecayed: whether enough has been measured
        self.largest_step = 0  # the most prompt tokens one step computed: how far the fit has seen

    def record(self, stats: IterationStats) -> None:
        if stats.step_seconds is None:
            return
        n, t = stats.step_prompt_tokens, stats.step_seconds
        self.w = DECAY * self.w + 1
        self.n = DECAY * self.n + n
        self.nn = DECAY * self.nn + n * n
        self.t = DECAY * self.t + t
        self.nt = DECAY * self.nt + n * t
        if n:
            self.prompt_tokens = DECAY * self.prompt_tokens + n
            self.prompt_seconds = DECAY * self.prompt_seconds + t
            self.measured_tokens += n
            self.largest_step = max(self.largest_step, n)

    def fit(self, min_tokens: int = MIN_MEASURED_TOKENS) -> tuple[float, float] | None:
        """(base seconds, seconds per prompt token), or None before `min_tokens` were measured."""
        if self.measured_tokens < max(1, min_tokens) or self.prompt_tokens <= 0:
            return None
        spread = self.w * self.nn - self.n * self.n
        if spread > 1e-9 * self.w * self.nn:
            per_token = (self.w * self.nt - self.n * self.t) / spread
            base = (self.t - per_token * self.n) / self.w
            if per_token > 0 and base >= 0:
                return base, per_token
        return 0.0, self.prompt_seconds / self.prompt_tokens

    def tokens_per_second(self) -> float:
        """Measured prefill throughput (beyond the steps' base); 0 before it is measured."""
        fit = self.fit()
        return 1.0 / fit[1] if fit and fit[1] > 0 else 0.0

    def base_seconds(self) -> float:
        """A step's measured base; 0 before it is measured."""
        fit = self.fit()
        return fit[0] if fit else 0.0

    def step_seconds(self, prompt_tokens: int) -> float | None:
        """How long a step computing `prompt_tokens` prompt tokens should take, by whatever was measured
        (the first step's own cost is better than none), or None before any step that computed some."""
        fit = self.fit(min_tokens=1)
        if fit is None:
            return None
        return fit[0] + prompt_tokens * fit[1]
