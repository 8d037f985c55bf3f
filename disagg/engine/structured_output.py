"""Structured output (docs/ARCHITECTURE.md, "Structured output"): each request's grammar as an
llguidance matcher, and the token bitmask the sampler applies to the whole batch at once.

llguidance was picked over xgrammar by measurement (BENCHMARKS.md, "Structured output"): at
batch 32 on CPU it fills the masks about 4x faster, compiles a schema in about a millisecond
instead of hundreds, and reads tokenizer.json itself, with no dependency on transformers.
"""

import threading
from collections import OrderedDict
from pathlib import Path

import llguidance
import torch

from disagg.engine.sampling_params import SamplingParamError, StructuredOutputSpec
from disagg.engine.sequence import Sequence

MAX_CACHED_GRAMMARS = 256  # distinct specs kept compiled; the oldest goes first


class GrammarCompiler:
    """Specs -> matchers for this tokenizer, compiled once per distinct spec.

    The API thread compiles (to answer a bad grammar with a 400) and the engine thread copies
    matchers out of the cache: a lock keeps the two apart."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.compiled: OrderedDict[StructuredOutputSpec, llguidance.LLMatcher] = OrderedDict()
        self.lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built at the first grammar (it takes a few hundred ms), so engines that never see one do not pay."""
        with self.lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(str(self.tokenizer_json), n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids)
            return self._tokenizer

    def compile(self, spec: StructuredOutputSpec) -> llguidance.LLMatcher:
        """The spec's matcher at its start, shared: copy it before use. Raises SamplingParamError
        ("structured") with llguidance's reason when the spec does not compile."""
        with self.lock:
            if spec in self.compiled:
                self.compiled.move_to_end(spec)
                return self.compiled[spec]
        try:
            grammar = llguidance.grammar_from(spec.kind, spec.value)
        except Exception as e:  # noqa: BLE001  not JSON, not GBNF, ...: the client's text, the client's 400
            raise SamplingParamError("structured", f"the {spec.kind} does not compile: {e}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise SamplingParamError("structured", f"the {spec.kind} does not compile: {matcher.get_error()}")
        with self.lock:
            self.compiled[spec] = matcher
            if len(self.compiled) > MAX_CACHED_GRAMMARS:
                self.compiled.popitem(last=False)
        return matcher

    def matcher(self, spec: StructuredOutputSpec) -> llguidance.LLMatcher:
        template = self.compile(spec)
        with self.lock:
            return template.deep_copy()


class StructuredOutput:
    """The matchers of the engine's requests that have a grammar, by request id. A matcher
    advances with every token the request gets (sampled here or sent by a prefill node)."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.matchers: dict[str, llguidance.LLMatcher] = {}
        self.failed: dict[str, str] = {}  # request id -> why its mask could not be computed

    def add(self, request_id: str, spec: StructuredOutputSpec) -> None:
        self.matchers[request_id] = self.compiler.matcher(spec)

    def release(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self.failed.pop(request_id, None)

    def accept(self, request_id: str, token: int) -> None:
        """Raises ValueError if the token breaks the request's grammar (the engine fails that request)."""
        if request_id in self.failed:
            raise ValueError(self.failed[request_id])
        matcher = self.matchers.get(request_id)
        if matcher is None or matcher.is_stopped():  # done (with ignore_eos only EOS comes after): nothing to check
            return
        if not matcher.consume_token(token):
            raise ValueError(f"token {token} does not follow the request's grammar: {matcher.get_error()}")

    def check(self, request_id: str, token: int) -> None:
        """accept's ValueError, without advancing the matcher (a token about to be sent early)."""
        if request_id in self.failed:
            raise ValueError(self.failed[request_id])
        matcher = self.matchers.get(request_id)
        if matcher is not None and not matcher.is_stopped() and matcher.validate_tokens([token]) != 1:
            raise ValueError(f"token {token} does not follow the request's grammar")

    def mask(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits [B, vocab] with the tokens each row's grammar forbids at -inf (rows without one
        untouched). EOS is allowed only where the grammar accepts what came so far."""
        rows = [row for row, seq in enumerate(seqs) if seq.request_id in self.matchers]
        if not rows:
            return logits
        bitmask = torch.full((len(rows), (self.compiler.vocab_size + 31) // 32), -1, dtype=torch.int32)
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        for i, row in enumerate(rows):  # llguidance writes row i of the (contiguous, CPU) bitmask in place
            request_id = seqs[row].request_id
            try:
                self.matchers[request_id].unsafe_compute_mask_ptr(bitmask[i].data_ptr(), row_bytes)
            except Exception as e:  # noqa: BLE001  that request alone fails, when its token is accepted
                self.failed[request_id] = f"computing the grammar's token mask failed: {e}"
        index = torch.tensor(rows, device=logits.device)
        logits = logits.clone()
        logits[index] = apply_token_bitmask(logits[index], bitmask.to(logits.device))
        return logits


BIT_VALUES = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, vocab] with every token whose bit is 0 in `bitmask` [B, ceil(vocab / 32)] int32
    (bit j of word i: token 32 * i + j, as llguidance and xgrammar write it) set to -inf, the
    whole batch in one operation. Bytes are read little-endian, as every supported CPU and GPU stores them."""
    vocab = logits.shape[-1]
    bits = bitmask.view(torch.uint8)[:, :, None] & BIT_VALUES.to(bitmask.device)
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    return torch.where(allowed, logits, float("-inf"))
