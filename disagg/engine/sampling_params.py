"""SamplingParams: how one request picks its tokens, checked up front.

Every field is bounded, so that no value a client can send makes sampling raise: a failure
there would otherwise end the request, and a value the sampler cannot handle is the client's
mistake to hear about (HTTP 400), not the server's.
"""

import sys
from dataclasses import dataclass, field

# Below this, logits / temperature overflows float32 and sampling sees inf and NaN (vLLM's epsilon).
MIN_TEMPERATURE = 1e-5
MAX_TOP_K = 2**31 - 1  # the control plane sends top_k as int32
MAX_SEED = 2**63 - 1  # the control plane sends the seed as int64; torch seeds are 64-bit
# Each output token is checked against every stop string and stop token id.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = 2**31 - 1  # no vocabulary comes near 2^31 tokens
MAX_LOGPROBS = 20


class SamplingParamError(ValueError):
    """A sampling field is out of range; `param` names it (the API answers 400 with it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: also the n most likely
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        t = self.temperature
        if not is_number(t) or not (t == 0 or t >= MIN_TEMPERATURE):
            raise SamplingParamError("temperature", f"temperature must be 0 (greedy) or a finite number "
                                                    f">= {MIN_TEMPERATURE:g}, got {t!r}")
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SamplingParamError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise SamplingParamError("top_k", f"top_k must be an integer between 0 and {MAX_TOP_K} "
                                              f"(0 or -1 turns it off), got {self.top_k!r}")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamError("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise SamplingParamError("seed", f"seed must be an integer between 0 and 2^63 - 1, got {self.seed!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingParamError("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise SamplingParamError("logprobs", f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs!r}")
        if self.n != 1:
            raise SamplingParamError("n", f"n={self.n} is not supported yet; send n=1 (one completion per request)")
        self._validate_stops()

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamError("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop):
            raise SamplingParamError("stop", f"stop must be a list of non-empty strings of at most "
                                             f"{MAX_STOP_STRING_CHARS} characters each")
        ids = self.stop_token_ids
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamError("stop_token_ids", f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, "
                                                       f"got {len(ids)}")
        if any(not is_int(t) or not 0 <= t <= MAX_TOKEN_ID for t in ids):
            raise SamplingParamError("stop_token_ids", f"stop_token_ids must be token ids between 0 and "
                                                       f"{MAX_TOKEN_ID}, got {ids!r}")


def is_number(value: object) -> bool:
    """A finite float, or an int that converts to one (not a bool: True is no temperature)."""
    # NaN compares False; an int beyond the largest float would overflow the sampler's division.
    return (is_int(value) or isinstance(value, float)) and abs(value) <= sys.float_info.max


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
