"""Structured output (docs/ARCHITECTURE.md, "Structured output"): each request's grammar as an
llguidance matcher, and the token bitmask the sampler applies to the whole batch at once.

llguidance was picked over xgrammar by measurement (BENCHMARKS.md, "Structured output"): at
batch 32 on CPU it fills the masks about 4x faster, compiles a schema in about a millisecond
instead of hundreds, and reads tokenizer.json itself, with no dependency on transformers.
"""

import ctypes
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance
import torch

from disagg.engine.sampling_params import SamplingParamError, StructuredOutputSpec
from disagg.engine.sequence import Sequence

# Where a grammar's memory goes (measured on the embedded 49k-token tokenizer, scripts in the commit
# that added this): not the grammar, nor the matcher, which cost nothing when built, but the lexer
# llguidance builds lazily at the first token mask (regex derivatives and DFA states, for the whole
# token trie) and grows at later masks. Every deep copy of a matcher shares that lexer, so the
# cached template owns what its requests' masks built. `a{1000}{1000}` at llguidance's default
# limits: 0.75 s and +180 MB at the first mask, then its first token runs out of step fuel ("too
# many expressions constructed"), the request failed (a 500), and the template kept ~165 MB.
#
# llguidance's own limits bound that work; tightened here where its defaults let one grammar cost
# hundreds of MB (every grammar we and vLLM's tests use needs far less: JSON schemas of 60 fields,
# tool schemas, dates, e-mails all build their lexer in under 10,000 fuel).
GRAMMAR_LIMITS = {
    # The lexer's build at the first mask: <= ~0.15 s, ~40 MB (default 1M: 0.75 s, 180 MB).
    "initial_lexer_fuel": 200_000,
    "step_lexer_fuel": 200_000,  # each later mask (llguidance's default)
    "max_lexer_states": 50_000,  # 1-2 kB each: <= ~100 MB of DFA (default 250,000)
    "max_grammar_size": 200_000,  # symbols in the grammar (default 500,000)
    # Earley items in one row: a rule of N alternatives puts N in the row after its first token, so
    # the default 2,000 failed a guided_choice of 5,000 entries (or a 6,000-alternative GBNF) at
    # its second token, a 500 (issue 24). Served instead, up to the work llguidance allows one
    # step (step_max_items, 50,000 by default): such rows take under a millisecond a mask.
    "max_items_in_row": 50_000,
    "verbose_errors": False,  # errors go to the client: no dump of the parser's state
}
DEFAULT_GRAMMAR_CACHE_BYTES = 256 * 2**20  # --grammar-cache-mb
# Every request in the batch waits for its token until the step's masks are computed (issue 24: 64
# choices of one costly grammar stretched other requests' token gaps to 14.7 s); they overlap the
# forward, but past it they are the step's time. Once the batch has waited MASK_STEP_BUDGET_S for
# them past the forward, a row whose last mask took over EXPENSIVE_MASK_S is failed instead of
# computed ("grammar too expensive"), that request alone; cheap rows are computed first and always.
# Ordinary grammars take well under a millisecond a mask.
MASK_STEP_BUDGET_S = 0.25
EXPENSIVE_MASK_S = 0.005
# An entry's smallest cost: its RSS growth reads 0 when it reused memory freed before.
MIN_GRAMMAR_BYTES = 256 * 2**10
MAX_START_MARKERS = 8  # start markers kept (one per reasoning parser's end in practice)


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**GRAMMAR_LIMITS)


class GrammarCompiler:
    """Specs -> matchers for this tokenizer, compiled once per distinct spec, the compiled ones
    kept up to `cache_bytes` (least recently used out first).

    Compiling builds the matcher and its lexer (the first mask, then one token on a copy), so that
    a grammar over llguidance's limits is refused here, as a 400 naming the field, not in the middle
    of generating; what that took in resident memory is the entry's cost. Compiles run one at a
    time, in the caller's thread (the API's or a prefill node's worker thread), so that two of them
    neither add up their peaks nor blur each other's cost. The engine thread copies matchers out
    of the cache: a second lock keeps the two apart."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int],
                 cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES):
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.cache_bytes = cache_bytes
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.compiled: OrderedDict[StructuredOutputSpec, tuple[llguidance.LLMatcher, int]] = OrderedDict()
        self.cached_bytes = 0  # the sum of the entries' costs
        self.markers: OrderedDict[tuple[int, ...], StartMarker] = OrderedDict()
        self._token_bytes: list[bytes] | None = None  # each token's bytes, read at the first start marker
        self.lock = threading.Lock()  # the cache
        self.compile_lock = threading.Lock()  # one compile at a time

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built at the first grammar (it takes a few hundred ms), so engines that never see one do not pay."""
        with self.lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(str(self.tokenizer_json), n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids)
            return self._tokenizer

    def cached(self, spec: StructuredOutputSpec) -> llguidance.LLMatcher | None:
        with self.lock:
            if spec not in self.compiled:
                return None
            self.compiled.move_to_end(spec)
            return self.compiled[spec][0]

    def compile(self, spec: StructuredOutputSpec) -> llguidance.LLMatcher:
        """The spec's matcher at its start, shared: copy it before use. Raises SamplingParamError
        ("structured") with llguidance's reason when the spec does not compile, or when it is too
        large or complex for llguidance's limits or the cache."""
        if spec.after_tokens:
            self.start_marker(spec.after_tokens)  # checked and built here, in the caller's thread
        spec = StructuredOutputSpec(spec.kind, spec.value)  # the grammar alone: where it starts is the request's
        matcher = self.cached(spec)
        if matcher is not None:
            return matcher
        tokenizer = self.tokenizer  # before the RSS is read: built once, shared by every grammar
        with self.compile_lock:
            matcher = self.cached(spec)  # another thread may have compiled it meanwhile
            if matcher is not None:
                return matcher
            before = resident_bytes()
            matcher, problem = self._build(spec, tokenizer)
            cost = max(resident_bytes() - before, MIN_GRAMMAR_BYTES)
            if problem is None and cost > self.cache_bytes:
                problem = (f"building it took {cost / 2**20:.0f} MB, more than this server's grammar cache of "
                           f"{self.cache_bytes / 2**20:.0f} MB (--grammar-cache-mb)")
            if problem is not None:
                del matcher
                release_freed_memory()
                raise SamplingParamError("structured", f"the {spec.kind} is too large or complex for this server's "
                                                       f"grammar limits ({problem}); send a smaller or simpler one")
        with self.lock:
            self.compiled[spec] = (matcher, cost)
            self.cached_bytes += cost
            evicted = []
            while self.cached_bytes > self.cache_bytes:
                _, (old, old_cost) = self.compiled.popitem(last=False)
                self.cached_bytes -= old_cost
                evicted.append(old)  # freed outside the lock: the engine thread waits on it
        if evicted:
            del evicted, old
            release_freed_memory()
        return matcher

    def _build(self, spec: StructuredOutputSpec, tokenizer: llguidance.LLTokenizer) \
            -> tuple[llguidance.LLMatcher | None, str | None]:
        """The matcher with its lexer built, or the limit it ran into. Raises SamplingParamError
        when the spec does not compile."""
        try:
            grammar = llguidance.grammar_from(spec.kind, spec.value)
        except Exception as e:  # noqa: BLE001  not JSON, not GBNF, ...: the client's text, the client's 400
            raise SamplingParamError("structured", f"the {spec.kind} does not compile: {e}") from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():  # a syntax error, or a grammar over max_grammar_size
            raise SamplingParamError("structured", f"the {spec.kind} does not compile: {llguidance_error(matcher)}")
        # The first mask builds the lexer; one token more on a copy shows a grammar whose first
        # step already runs out of fuel (the attack above), which would otherwise fail its request
        # after the response started. The first, middle and last allowed tokens are tried: which
        # one costs most depends on the grammar (a choice of "0".."4999" is cheap after "0" only).
        bitmask = torch.full(((self.vocab_size + 31) // 32,), -1, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())
        if matcher.is_error():
            return matcher, llguidance_error(matcher)
        allowed = [t for t in allowed_tokens(bitmask, self.vocab_size) if t not in self.eos_token_ids]
        for token in sorted({allowed[0], allowed[len(allowed) // 2], allowed[-1]} if allowed else set()):
            probe = matcher.deep_copy()
            if probe.consume_token(token):
                probe.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())
            if probe.is_error():
                return matcher, llguidance_error(probe)
        # The bytes the grammar forces, as tokens, on a copy: a vocabulary with no token for one of
        # them (this model's has none for some lone UTF-8 bytes) would otherwise fail the request
        # tokens later, after the response started.
        probe = matcher.deep_copy()
        forced = probe.compute_ff_tokens()
        if forced and (not probe.consume_tokens(forced) or probe.is_error()):
            raise SamplingParamError("structured", f"the {spec.kind} forces text that this model's tokens cannot "
                                                   f"write ({llguidance_error(probe)}); leave such characters out")
        return matcher, None

    def start_marker(self, token_ids: tuple[int, ...]) -> "StartMarker":
        """The start marker written by these tokens. Raises SamplingParamError for ids outside the vocabulary."""
        if any(t >= self.vocab_size for t in token_ids):
            raise SamplingParamError("structured", f"after_tokens has token ids outside the vocabulary "
                                                   f"[0, {self.vocab_size}): {list(token_ids)}")
        tokenizer = self.tokenizer
        with self.lock:
            if token_ids in self.markers:
                self.markers.move_to_end(token_ids)
                return self.markers[token_ids]
        # Built outside the lock, which the engine thread takes: the first scans the vocabulary (~0.25 s).
        if self._token_bytes is None:
            self._token_bytes = [tokenizer.decode_bytes([t]) for t in range(self.vocab_size)]
        marker = StartMarker.of(tokenizer.decode_bytes(list(token_ids)), self._token_bytes)
        with self.lock:
            self.markers[token_ids] = marker
            if len(self.markers) > MAX_START_MARKERS:
                self.markers.popitem(last=False)
        return marker

    def grammar(self, spec: StructuredOutputSpec) -> "Grammar":
        """A request's grammar for this spec, at its start. Raises SamplingParamError as compile does."""
        template = self.compile(spec)
        start = self.start_marker(spec.after_tokens) if spec.after_tokens else None
        with self.lock:
            matcher = template.deep_copy()
        return Grammar(matcher, self.tokenizer, start)


@dataclass(frozen=True)
class StartMarker:
    """The text whose first appearance in the output starts a request's grammar (the reasoning's end,
    </think>: several tokens in some vocabularies, one in others, and the model may write it with
    any tokens that spell it, so it is matched as bytes), and the tokens that can complete it:
    `whole` hold all of it, `rest[k]` start with its bytes from k on (they complete it after output
    that ends in its first k bytes)."""
    text: bytes
    whole: tuple[int, ...]
    rest: dict[int, tuple[int, ...]]

    @classmethod
    def of(cls, text: bytes, token_bytes: list[bytes]) -> "StartMarker":
        whole = tuple(t for t, b in enumerate(token_bytes) if text in b)
        rest = {k: tuple(t for t, b in enumerate(token_bytes) if b.startswith(text[k:]) and text not in b)
                for k in range(1, len(text))}
        return cls(text, whole, rest)


class Grammar:
    """One request's grammar: its llguidance matcher and, until the output writes it, the marker that
    starts it. Before the marker the output is free, as vLLM leaves the reasoning; the token that
    completes it may carry the answer's first bytes, which the matcher takes then."""

    def __init__(self, matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer | None = None,
                 start: StartMarker | None = None):
        self.matcher = matcher
        self.tokenizer = tokenizer
        self.start = start  # None: the grammar holds every token from now on
        self.tail = b""  # while waiting: the output's last bytes, fewer than the marker's

    def answer_start(self, token: int) -> bytes | None:
        """While waiting: this token's bytes after the marker if it completes the marker, else None."""
        text = self.tail + self.tokenizer.decode_bytes([token])
        at = text.find(self.start.text)  # the marker is not in the tail alone, which is shorter
        return None if at == -1 else text[at + len(self.start.text):]

    def allows(self, token: int) -> bool:
        """Whether the grammar would take this token next (accept without advancing)."""
        if self.start is None:
            return self.matcher.is_stopped() or self.matcher.validate_tokens([token]) == 1
        answer = self.answer_start(token)
        if not answer:
            return True
        tokens = self.tokenizer.tokenize_bytes(answer)
        return self.matcher.validate_tokens(tokens) == len(tokens)

    def accept(self, token: int) -> None:
        """Advance by one token. Raises ValueError if it breaks the grammar."""
        if self.start is None:  # a stopped matcher is done (with ignore_eos only EOS comes after)
            if not self.matcher.is_stopped() and not self.matcher.consume_token(token):
                raise ValueError(f"token {token} does not follow the request's grammar: "
                                 f"{llguidance_error(self.matcher)}")
            return
        answer = self.answer_start(token)
        if answer is None:
            keep = len(self.start.text) - 1
            self.tail = (self.tail + self.tokenizer.decode_bytes([token]))[-keep:] if keep else b""
            return
        self.start, self.tail = None, b""
        if answer and not self.matcher.consume_tokens(self.tokenizer.tokenize_bytes(answer)):
            raise ValueError(f"token {token} starts an answer that does not follow the request's grammar: "
                             f"{llguidance_error(self.matcher)}")

    def refused_now(self) -> list[int]:
        """While waiting: the tokens that would complete the marker with bytes the grammar refuses
        (all others are free). Usually none can complete it, and this costs a few comparisons."""
        candidates = [*self.start.whole]
        for k, tokens in self.start.rest.items():
            if self.tail.endswith(self.start.text[:k]):
                candidates += tokens
        return [t for t in candidates if not self.allows(t)]


def llguidance_error(matcher: llguidance.LLMatcher) -> str:
    return matcher.get_error().removesuffix("<non-verbose/>").strip()


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids whose bit is set in one bitmask row (llguidance's layout, apply_token_bitmask's)."""
    bits = bitmask.view(torch.uint8)[:, None] & BIT_VALUES
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


def resident_bytes() -> int:
    """This process's resident memory (Linux; 0 elsewhere, where every grammar costs MIN_GRAMMAR_BYTES)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


MALLOC_TRIM = _malloc_trim()


def release_freed_memory() -> None:
    """Hand memory freed by llguidance back to the system. glibc keeps freed memory in its arenas
    (one per thread that allocated it, and compiles run in worker threads): measured, a cache of
    five pathological grammars dropped from 1116 to 595 MB of RSS when cleared, and to 300 MB only
    after malloc_trim."""
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)


@dataclass
class Masks:
    """One step's grammar masks, computed on the masks' thread (StructuredOutput.start): row i of
    `bitmask` is request_ids[i]'s, and `rows` are (i, its grammar, its last mask's seconds), cheapest
    first. `waited_since` is when the engine thread, its forward done, began to wait for them (None
    until then). `done` gives the rows that failed (request id -> why) and each computed row's seconds."""
    request_ids: list[str]
    bitmask: torch.Tensor
    rows: list[tuple[int, Grammar, float]]
    waited_since: float | None = None
    done: Future[tuple[dict[str, str], dict[str, float]]] | None = None


class StructuredOutput:
    """The grammars of the engine's requests that have one, by request id. A grammar advances with
    every token the request gets (sampled here or sent by a prefill node).

    A step's masks are computed on a thread of their own while the model's forward runs (start,
    then mask after the forward): llguidance drops the GIL while it computes a mask, as torch does
    in its operators, so the two overlap. The engine thread touches the grammars only before start
    and after mask, so the masks' thread has them to itself in between."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.grammars: dict[str, Grammar] = {}
        self.failed: dict[str, str] = {}  # request id -> why its mask could not be computed
        self.mask_seconds: dict[str, float] = {}  # request id -> how long its last mask took
        # One thread: a step's masks wait for the last step's (whose forward failed) to end. Started
        # at the first grammar.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")

    def add(self, request_id: str, spec: StructuredOutputSpec) -> None:
        self.grammars[request_id] = self.compiler.grammar(spec)

    def release(self, request_id: str) -> None:
        self.grammars.pop(request_id, None)
        self.failed.pop(request_id, None)
        self.mask_seconds.pop(request_id, None)

    def close(self) -> None:
        self.worker.shutdown()

    def accept(self, request_id: str, token: int) -> None:
        """Raises ValueError if the token breaks the request's grammar (the engine fails that request)."""
        if request_id in self.failed:
            raise ValueError(self.failed[request_id])
        grammar = self.grammars.get(request_id)
        if grammar is not None:
            grammar.accept(token)

    def start(self, seqs: list[Sequence]) -> Masks | None:
        """Start computing the masks of these sequences' grammars (those to be sampled this step) on
        the masks' thread; None if none has one. Cheap rows are computed first and always; once the
        batch has waited MASK_STEP_BUDGET_S for them past the forward, a row whose last mask took over
        EXPENSIVE_MASK_S is failed instead."""
        request_ids = [seq.request_id for seq in seqs
                       if seq.request_id in self.grammars and seq.request_id not in self.failed]
        if not request_ids:
            return None
        bitmask = torch.full((len(request_ids), (self.compiler.vocab_size + 31) // 32), -1, dtype=torch.int32)
        rows = sorted(((i, self.grammars[rid], self.mask_seconds.get(rid, 0.0)) for i, rid in enumerate(request_ids)),
                      key=lambda row: row[2])
        masks = Masks(request_ids, bitmask, rows)
        masks.done = self.worker.submit(compute_masks, masks)
        return masks

    def mask(self, logits: torch.Tensor, seqs: list[Sequence], masks: Masks | None) -> torch.Tensor:
        """logits [B, vocab] with the tokens each row's grammar forbids at -inf (rows without one
        untouched), once `masks` (start's, for these sequences) are computed. EOS is allowed only
        where the grammar accepts what came so far. A grammar still waiting for its start marker
        forbids only the tokens that would complete it wrongly."""
        if masks is None:
            return logits
        masks.waited_since = time.monotonic()  # the budget's clock starts: the batch waits from now on
        failed, seconds = masks.done.result()
        self.failed.update(failed)  # those requests fail when their token is accepted
        self.mask_seconds.update(seconds)
        index_of = {rid: i for i, rid in enumerate(masks.request_ids)}
        rows = [row for row, seq in enumerate(seqs) if seq.request_id in index_of]
        bitmask = masks.bitmask[[index_of[seqs[row].request_id] for row in rows]]
        index = torch.tensor(rows, device=logits.device)
        logits = logits.clone()
        logits[index] = apply_token_bitmask(logits[index], bitmask.to(logits.device))
        return logits


def compute_masks(masks: Masks) -> tuple[dict[str, str], dict[str, float]]:
    """On the masks' thread: write each row's mask into its row of `masks.bitmask` (llguidance writes
    the contiguous CPU tensor in place; a failed row stays all allowed). Returns the rows that failed
    and each computed row's seconds."""
    failed, seconds = {}, {}
    row_bytes = masks.bitmask.shape[1] * masks.bitmask.element_size()
    for i, grammar, cost in masks.rows:
        request_id = masks.request_ids[i]
        if grammar.start is not None:  # before the start marker: only what would complete it wrongly
            bits = masks.bitmask[i].view(torch.uint8)
            for token in grammar.refused_now():
                bits[token // 8] &= 0xFF ^ (1 << token % 8)
            continue
        waited_since = masks.waited_since  # set by the engine thread: read once
        if (cost > EXPENSIVE_MASK_S and waited_since is not None
                and time.monotonic() - waited_since > MASK_STEP_BUDGET_S):
            failed[request_id] = (f"grammar too expensive: its token mask takes {cost * 1000:.0f} ms a step, and "
                                  f"this step's batch had already waited the {MASK_STEP_BUDGET_S:g} s this server "
                                  "gives masks past the forward; send a simpler grammar, or fewer choices (n) of it")
            continue
        began = time.monotonic()
        try:
            grammar.matcher.unsafe_compute_mask_ptr(masks.bitmask[i].data_ptr(), row_bytes)
        except Exception as e:  # noqa: BLE001  that request alone fails, when its token is accepted
            failed[request_id] = f"computing the grammar's token mask failed: {e}"
        seconds[request_id] = time.monotonic() - began
    return failed, seconds


BIT_VALUES = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [B, vocab] with every token whose bit is 0 in `bitmask` [B, ceil(vocab / 32)] int32
    (bit j of word i: token 32 * i + j, as llguidance and xgrammar write it) set to -inf, the
    whole batch in one operation. Bytes are read little-endian, as every supported CPU and GPU stores them."""
    vocab = logits.shape[-1]
    bits = bitmask.view(torch.uint8)[:, :, None] & BIT_VALUES.to(bitmask.device)
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
    return torch.where(allowed, logits, float("-inf"))
