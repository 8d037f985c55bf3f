"""Grammars bounded by llguidance's limits and a cache bounded by bytes (issue 24): a
pathological grammar is a 400 at compile, never a 500 mid-generation, and distinct ones leave no
memory behind on either node."""

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import Node

from disagg.engine.sampling_params import SamplingParamError, StructuredOutputSpec
from disagg.engine.structured_output import MIN_GRAMMAR_BYTES, GrammarCompiler, resident_bytes

pytestmark = pytest.mark.timeout(300)

VOCAB_SIZE = 49152  # the embedded model's
NUM_PATHOLOGICAL = 10
# Ten `a{1000}{N}` grew each node of a 1P1D pair by ~1.6 GB (issue 24); refused at compile they
# cost a few MB of allocator slack.
MAX_RSS_GROWTH = 150 * 2**20


def pathological(n: int) -> StructuredOutputSpec:
    """a{1000}{N}: a tiny regex whose lexer runs out of llguidance's fuel at its first token."""
    return StructuredOutputSpec("regex", f"a{{1000}}{{{1000 + n}}}")


@pytest.fixture(scope="module")
def compiler(model_dir) -> GrammarCompiler:
    return GrammarCompiler(model_dir / "tokenizer.json", VOCAB_SIZE, [2])


def test_pathological_grammar_refused_at_compile_and_freed(compiler):
    compiler.tokenizer  # noqa: B018  built once, outside what is measured
    before = resident_bytes()
    for n in range(3):
        with pytest.raises(SamplingParamError, match="too large or complex") as raised:
            compiler.compile(pathological(n))
        assert raised.value.param == "structured"
    assert not compiler.compiled
    assert resident_bytes() - before < 64 * 2**20


def test_cache_bounded_by_bytes(model_dir):
    compiler = GrammarCompiler(model_dir / "tokenizer.json", VOCAB_SIZE, [2], cache_bytes=3 * MIN_GRAMMAR_BYTES)
    specs = [StructuredOutputSpec("regex", f"[0-9]{{{n}}}-x") for n in range(1, 9)]
    for spec in specs:
        compiler.compile(spec)
        assert compiler.cached_bytes <= compiler.cache_bytes
        assert compiler.cached_bytes == sum(cost for _, cost in compiler.compiled.values())
    assert 1 <= len(compiler.compiled) <= 3
    assert specs[-1] in compiler.compiled and specs[0] not in compiler.compiled  # least recently used out
    grammar = compiler.grammar(specs[0])  # compiled again, once evicted
    assert not grammar.matcher.is_error()


def test_ordinary_grammars_fit_the_limits(compiler):
    schema = {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer"], "maxLength": 40,
                                                              "pattern": "[a-z]+[0-9]{2,5}"} for i in range(60)}}
    for spec in [StructuredOutputSpec("json", json.dumps(schema)), StructuredOutputSpec("json", '{"type": "object"}'),
                 StructuredOutputSpec("regex", r"[a-zA-Z0-9._%+-]{1,64}@[a-zA-Z0-9.-]{1,255}\.[a-z]{2,10}"),
                 StructuredOutputSpec("regex", "[a-z]{4000}"), StructuredOutputSpec("choice", '["yes", "no"]'),
                 StructuredOutputSpec("grammar", 'start: NUMBER ("+" NUMBER)*\nNUMBER: /[0-9]+/')]:
        assert not compiler.compile(spec).is_error()


def test_text_the_vocabulary_cannot_write_is_refused_at_compile(compiler):
    """A regex forcing U+76719 (UTF-8 F1 B6 9C 99): this model's vocabulary has no token for the lone
    byte F1, and llguidance's mask let a token through that its matcher then refused, failing the
    request after its first token (a 500 the fuzzer found). Now a 400 at compile; text it can write
    still compiles."""
    with pytest.raises(SamplingParamError, match="cannot write"):
        compiler.compile(StructuredOutputSpec("regex", "\u00ba\U00076719\u009d"))
    assert not compiler.compile(StructuredOutputSpec("regex", "\u00ba caf\u00e9 [a-z]+")).is_error()


def rss(node: Node) -> int:
    with open(f"/proc/{node.proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def test_pathological_grammars_on_1p1d_are_400_and_hold_no_memory(pair_1p1d):
    decode = pair_1p1d[1]
    body = {"prompt": "Say a", "max_tokens": 4, "temperature": 0, "guided_regex": "[a-z]{3}"}
    r = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=120)  # warm: one ordinary grammar
    assert r.status_code == 200, r.text
    before = {node.role: rss(node) for node in pair_1p1d}
    statuses = []
    for n in range(NUM_PATHOLOGICAL):
        r = httpx.post(f"{decode.url}/v1/completions", json={**body, "guided_regex": pathological(n).value},
                       timeout=120)
        statuses.append(r.status_code)
        if r.status_code == 400:
            error = r.json()["error"]
            assert error["param"] == "guided_regex" and "too large or complex" in error["message"], error
    growth = {node.role: rss(node) - before[node.role] for node in pair_1p1d}
    print(f"statuses {statuses}; RSS before {before}, growth {growth}")
    assert statuses == [400] * NUM_PATHOLOGICAL
    assert all(g < MAX_RSS_GROWTH for g in growth.values()), growth
    r = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text


# --- fuzzed grammars: compiled or refused with a SamplingParamError, never anything else ----------

ATOMS = st.sampled_from(["a", "b", "[a-z]", r"\d", ".", "(ab|ba)", "x?", r"\w"])


def regexes() -> st.SearchStrategy[str]:
    def grow(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        count = st.integers(0, 2000)
        return st.one_of(
            st.tuples(inner, count).map(lambda t: f"({t[0]}){{{t[1]}}}"),
            st.tuples(inner, count, count).map(lambda t: f"({t[0]}){{{min(t[1:])},{max(t[1:])}}}"),
            st.tuples(inner, st.sampled_from("*+?")).map("".join),
            st.lists(inner, min_size=2, max_size=4).map("".join),
            st.lists(inner, min_size=2, max_size=4).map(lambda parts: "(" + "|".join(parts) + ")"))

    return st.recursive(ATOMS, grow, max_leaves=6)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(regex=regexes())
def test_fuzzed_regexes_compile_or_are_refused(compiler, regex):
    start = time.monotonic()
    try:
        assert not compiler.compile(StructuredOutputSpec("regex", regex)).is_error()
    except SamplingParamError as e:
        assert e.param == "structured"
    assert time.monotonic() - start < 5.0, regex
    assert compiler.cached_bytes <= compiler.cache_bytes
