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
MAX_PENALTY = 2.0  # presence and frequency penalties, OpenAI's range
MAX_REPETITION_PENALTY = 1e4  # beyond this every repeated token is already ruled out
# Below this a positive logit divided by it overflows float32 (1e-300 was a 500, issue 24); by
# then every repeated token is already the only choice, as MAX_REPETITION_PENALTY rules them out.
MIN_REPETITION_PENALTY = 1 / MAX_REPETITION_PENALTY
MAX_LOGIT_BIAS = 100.0  # OpenAI's range; vLLM clamps to it
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_GRAMMAR_CHARS = 65536  # a JSON schema, regex or grammar; compiling one costs time on the engine's thread
MAX_AFTER_TOKENS = 16  # a reasoning end marker: </think> is one to three tokens in the vocabularies we serve
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


class SamplingParamError(ValueError):
    """A sampling field is out of range; `param` names it (the API answers 400 with it)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What the output must match, as vLLM's structured_outputs names it: `json` (a JSON schema as
    text), `regex`, `choice` (a JSON list of strings) or `grammar` (Lark or GBNF). Plain strings,
    so that it travels to a prefill node as it is; the engine compiles it (structured_output.py).

    `after_tokens`: the grammar holds only the output after the text of these tokens first appears
    in it (the reasoning's end, </think>, with --reasoning-parser: vLLM applies the grammar once the
    reasoning ends); before that the output is free. Empty: the grammar holds all of it."""
    kind: str
    value: str
    after_tokens: tuple[int, ...] = ()


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
    # vLLM's (and OpenAI's) definitions: presence and frequency over output tokens, repetition
    # over prompt and output tokens (dividing a positive logit, multiplying a negative one).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # before this many output tokens, EOS and stop tokens are masked and stop strings ignored
    skip_special_tokens: bool = True  # in the output text
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # as logprobs, for every prompt token after the first
    structured: StructuredOutputSpec | None = None  # the output follows this grammar

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Penalties, logit bias or min_tokens change its logits before sampling."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.min_tokens > 0)

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
            raise SamplingParamError("logprobs",
                                     f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise SamplingParamError("prompt_logprobs", f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, "
                                                        f"got {self.prompt_logprobs!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamError("min_tokens", f"min_tokens must be an integer between 0 and max_tokens="
                                                   f"{self.max_tokens}, got {self.min_tokens!r}")
        self._validate_stops()
        self._validate_penalties()
        spec = self.structured
        if spec is not None and (not isinstance(spec, StructuredOutputSpec) or spec.kind not in STRUCTURED_KINDS
                                 or not isinstance(spec.value, str) or not 0 < len(spec.value) <= MAX_GRAMMAR_CHARS):
            raise SamplingParamError("structured", f"structured output must be one of {STRUCTURED_KINDS} with a "
                                                   f"non-empty text of at most {MAX_GRAMMAR_CHARS} characters")
        if spec is not None and (not isinstance(spec.after_tokens, tuple) or len(spec.after_tokens) > MAX_AFTER_TOKENS
                                 or any(not is_int(t) or not 0 <= t <= MAX_TOKEN_ID for t in spec.after_tokens)):
            raise SamplingParamError("structured", f"structured output's after_tokens must be at most "
                                                   f"{MAX_AFTER_TOKENS} token ids, got {spec.after_tokens!r}")
        if spec is not None and self.min_tokens > 0:
            # A finished grammar allows only EOS, which min_tokens masks: nothing would be left to sample.
            raise SamplingParamError("min_tokens", "min_tokens cannot be combined with structured output: "
                                                   "the grammar decides where the output ends")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise SamplingParamError(name, f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        r = self.repetition_penalty
        if not is_number(r) or not MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY:
            raise SamplingParamError("repetition_penalty", f"repetition_penalty must be between "
                                                           f"{MIN_REPETITION_PENALTY:g} and {MAX_REPETITION_PENALTY:g} "
                                                           f"(1: off), got {r!r}")
        bias = self.logit_bias
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise SamplingParamError("logit_bias", f"logit_bias must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids "
                                                   "to biases")
        for token, value in bias.items():
            if not is_int(token) or not 0 <= token <= MAX_TOKEN_ID:
                raise SamplingParamError("logit_bias", f"logit_bias keys must be token ids, got {token!r}")
            if not is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise SamplingParamError("logit_bias", f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                                                       f"{MAX_LOGIT_BIAS:g}], got {value!r} for token {token}")

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
