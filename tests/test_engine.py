"""The engine against Hugging Face transformers, float32 on CPU, token for token."""

import asyncio
import json
import time

import pytest
import torch
from kv_export import KVCollector
from prompts import PASSAGE, PROMPTS, hf_greedy, penalized_reference
from servers import KV_CACHE_BYTES

from disagg import LLM, SamplingParams
from disagg.engine.async_engine import AsyncEngine, PrefixWait, RequestFailed
from disagg.engine.sampling_params import StructuredOutputSpec
from disagg.engine.scheduler import ScheduledSeq
from disagg.engine.sequence import Sequence

# Tokens per prompt: as many as later tests of this module ask of the same prompts (transformers' answers are memoized).
MAX_TOKENS = [32, 24, 24, 24, 24, 24, 24, 8, 16, 16, 16]


def reference(hf_model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    return hf_greedy(hf_model, prompt_ids, max_tokens)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    # Room for all of PROMPTS at once with their answers (about 2,900 tokens), so that no test of it preempts;
    # the CPU default (512 MiB) would hold twice that, zeroed, for the whole module.
    return LLM(str(model_dir), device="cpu", dtype="float32", kv_cache_memory=2 * KV_CACHE_BYTES)


def assert_matches_reference(llm: LLM, hf_model, prompts: list, max_tokens: list[int]) -> list:
    outs = llm.generate(prompts, [greedy(m) for m in max_tokens])
    for prompt, m, out in zip(prompts, max_tokens, outs):
        expected = reference(hf_model, out.prompt_token_ids, m)
        assert out.token_ids == expected, f"prompt {str(prompt)[:40]!r}: {out.token_ids} != {expected}"
        assert out.text == llm.tokenizer.decode(out.token_ids)
    return outs


def full_forward_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prompt, through the paged cache."""
    engine = llm.engine
    seq = Sequence("logits", token_ids, greedy(1))
    engine.block_manager.allocate(seq)
    try:
        return engine.runner.all_logits([ScheduledSeq(seq, len(token_ids))])
    finally:
        engine.block_manager.free(seq)


def test_logits_match_transformers(llm, hf_model):
    ids = llm.tokenizer.encode(PASSAGE * 2)
    ours = full_forward_logits(llm, ids)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0].float()
    assert (ours - theirs).abs().max().item() < 1e-3


def test_batch_of_mixed_lengths_matches_transformers(llm, hf_model):
    free = llm.engine.block_manager.num_free_blocks
    outs = assert_matches_reference(llm, hf_model, [[42]] + PROMPTS[1:], MAX_TOKENS)
    assert {len(o.prompt_token_ids) for o in outs} >= {1, 1448}
    assert llm.engine.block_manager.num_free_blocks == free


def test_prefix_cache_hits_match_transformers(llm, hf_model):
    system = "You are the assistant of the prefix-cache test.\n" + PASSAGE * 4
    questions = ["What is a compiler?", "Who shared computers?", "Name one abstraction.", "Why networks?"]
    prompts = [system + q for q in questions]
    first = assert_matches_reference(llm, hf_model, prompts[:1], [24])
    second = assert_matches_reference(llm, hf_model, prompts, [24, 16, 32, 8])
    shared = len(llm.tokenizer.encode(system)) // 16 * 16
    assert first[0].num_cached_tokens < shared
    assert all(o.num_cached_tokens >= shared - 16 for o in second)


def test_chunked_prefill_matches_transformers(model_dir, hf_model):
    llm = LLM(str(model_dir), device="cpu", max_num_batched_tokens=96, enable_prefix_caching=False,
              kv_cache_memory=KV_CACHE_BYTES)
    assert_matches_reference(llm, hf_model, [PROMPTS[5], PROMPTS[6], PROMPTS[9]], [16, 16, 16])


def test_preemption_matches_transformers(model_dir, hf_model):
    # 24 blocks of 16 tokens cannot hold these requests at once, so some are preempted and recomputed.
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory=24 * block_bytes)
    prompts = [PROMPTS[6], PROMPTS[5], PROMPTS[3], PROMPTS[4], PROMPTS[1]]
    assert_matches_reference(llm, hf_model, prompts, [24, 24, 24, 24, 24])
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 24


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_random_llama_gqa_matches_transformers(tiny_llama_dir, num_heads, num_kv_heads):
    from transformers import AutoModelForCausalLM

    path = tiny_llama_dir(num_heads=num_heads, num_kv_heads=num_kv_heads, hidden_size=128, head_dim=32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=128)
    ids = llm.tokenizer.encode(PASSAGE)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    assert (full_forward_logits(llm, ids) - theirs).abs().max().item() < 1e-3
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:8]]
    outs = llm.generate(prompts, greedy(24))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, ids, 24)


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24)
    alone = llm.generate("Tell me a story about a dragon.", params)[0]
    batched = llm.generate(["Tell me a story about a dragon.", "Another prompt"],
                           [params, SamplingParams(temperature=1.0, max_tokens=24)])[0]
    assert alone.token_ids == batched.token_ids
    other = llm.generate("Tell me a story about a dragon.",
                         SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=24))[0]
    assert other.token_ids != alone.token_ids


def test_stop_strings_and_stop_tokens(llm):
    base = llm.generate("1, 2, 3, 4, 5,", greedy(32))[0]
    assert " 8" in base.text
    out = llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=32, stop=[" 8"]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 8"
    assert out.text == base.text[:base.text.index(" 8")]
    k = next(i for i, t in enumerate(base.token_ids) if i >= 3 and t not in base.token_ids[:i])
    stop_id = base.token_ids[k]
    out = llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == base.token_ids[:k + 1] and out.stop_reason == stop_id


def test_logprobs_match_transformers(llm, hf_model):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    ids = out.prompt_token_ids + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(out.prompt_token_ids) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-3
        assert [t for t, _ in lp.top] == torch.topk(row, 3).indices.tolist()


def test_abort_frees_every_block(llm):
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    for i, prompt in enumerate(PROMPTS[5:9]):
        engine.add_request(f"abort-{i}", prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < free
    for i in range(4):
        assert engine.abort_request(f"abort-{i}")
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == free
    assert not engine.abort_request("abort-0")


@pytest.mark.parametrize("prompt,params,message", [
    ("", greedy(4), "empty"),
    ([], greedy(4), "empty"),
    ([1, 2, 10**6], greedy(4), "token ids"),
    ([-1], greedy(4), "token ids"),
    ("hi", dict(temperature=-1.0), "temperature"),
    ("hi", dict(temperature=float("nan")), "temperature"),
    ("hi", dict(top_p=0.0), "top_p"),
    ("hi", dict(top_p=1.5), "top_p"),
    ("hi", dict(max_tokens=0), "max_tokens"),
    ("hi", dict(repetition_penalty=0.0), "repetition_penalty"),
    ("hi", dict(presence_penalty=2.5), "presence_penalty"),
    ("hi", dict(frequency_penalty=float("inf")), "frequency_penalty"),
    ("hi", dict(logit_bias={5: 101.0}), "logit_bias"),
    ("hi", dict(logit_bias={60_000: 1.0}), "vocabulary"),  # the engine knows the vocabulary
    ("hi", dict(min_tokens=17), "min_tokens"),
    ("hi", dict(prompt_logprobs=21), "prompt_logprobs"),
    # Each of these used to pass, then make the sampler raise or cost every request a slower step.
    ("hi", dict(temperature=1e-300), "temperature"),
    ("hi", dict(temperature=10**400), "temperature"),
    ("hi", dict(seed=2**70), "seed"),
    ("hi", dict(seed=-1), "seed"),
    ("hi", dict(top_k=2**70), "top_k"),
    ("hi", dict(min_p=float("nan")), "min_p"),
    ("hi", dict(stop=["x"] * 17), "stop"),
    ("hi", dict(stop=["x" * 257]), "stop"),
    ("hi", dict(stop_token_ids=list(range(65))), "stop_token_ids"),
    ("hi", dict(stop_token_ids=[2**70]), "stop_token_ids"),
    # A finished grammar allows only EOS, which min_tokens would mask: junk tokens, or nothing to sample.
    ("hi", dict(min_tokens=3, structured=StructuredOutputSpec("choice", '["yes", "no"]')), "min_tokens"),
])
def test_bad_input_is_refused_and_engine_keeps_serving(llm, hf_model, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        if isinstance(params, dict):
            params = SamplingParams(**params)
        llm.engine.add_request("bad", prompt, params)
    assert not llm.engine.has_unfinished_requests()
    assert_matches_reference(llm, hf_model, [PROMPTS[1]], [8])


def test_prompt_longer_than_the_cache_is_refused(model_dir):
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory=8 * block_bytes)
    assert llm.engine.max_model_len == 7 * 16
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(PASSAGE * 2, greedy(4))
    assert llm.generate("Hello", greedy(4))[0].finish_reason == "length"


def test_remote_prefill_continues_like_local(llm, model_dir, hf_model):
    """A prompt prefilled by one engine, in chunks, and decoded by another gives transformers' tokens;
    each chunk's KV is handed out in the step that computes it, or all of it at the end (at_end)."""
    prefill = LLM(str(model_dir), device="cpu", max_num_batched_tokens=32, enable_prefix_caching=False,
                  kv_cache_memory=KV_CACHE_BYTES)
    decode = llm.engine
    free = decode.block_manager.num_free_blocks
    prompts = [PROMPTS[2], PROMPTS[6], PROMPTS[5]]
    exports = [KVCollector(30, layers) for layers in (1, 7, 30)]  # 30 layers: each, in groups, whole
    exports[2].export.at_end = True  # as layerwise: false sends it: once the whole prompt is computed
    firsts = {}
    for i, prompt in enumerate(prompts):
        prefill.engine.add_request(f"p{i}", prompt, greedy(1), kv_export=exports[i].export)
        decode.add_request(f"r{i}", prompt, greedy(32), remote_prefill=True)
        firsts[f"r{i}"] = decode.remote_slot(f"r{i}").first
    assert decode.step() == []  # nothing to compute while the KV is away
    done, early = {}, False
    while prefill.engine.has_unfinished_requests():
        outs = prefill.engine.step()
        # The long prompt's first chunks' KV is out while its later chunks are still to compute.
        early |= bool(exports[1].parts) and "p1" not in [out.request_id for out in outs]
        for out in outs:
            i = int(out.request_id[1:])
            firsts[f"r{i}"].output(out.token_ids[0], None)
            decode.finish_remote_prefill(f"r{i}", exports[i].kv(), firsts[f"r{i}"])
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                done[out.request_id] = out
    for i in range(len(prompts)):
        out = done[f"r{i}"]
        assert out.token_ids == reference(hf_model, out.prompt_token_ids, 32)
    assert decode.block_manager.num_free_blocks == free
    assert early and len(exports[1].chunks()) > 1 and len(exports[2].chunks()) == 1
    # From token 100 on (the decode node holds the rest), still chunk by chunk: the chunks that end
    # before it send nothing, the one across it sends from it.
    tail = KVCollector(30, 7, start=100)
    prefill.engine.add_request("tail", prompts[1], greedy(1), kv_export=tail.export)
    while prefill.engine.has_unfinished_requests():
        prefill.engine.step()
    # Alone, its chunks start at other tokens than in the batch above, so attention sums in another order:
    # up to 1.2e-5 apart (one value in 1.1 million beyond 1e-5) on an AMD EPYC's AVX2 kernels.
    assert len(tail.chunks()) > 1 and torch.allclose(tail.kv(), exports[1].kv()[:, :, 100:], atol=1e-4)


def test_a_failing_kv_export_costs_its_own_layers_only(model_dir):
    """A put that raises (its receiver broke) ends that request's export; the step and the other
    request's export go on, and both get their first token."""
    prefill = LLM(str(model_dir), device="cpu", kv_cache_memory=KV_CACHE_BYTES).engine
    good, bad = KVCollector(30), KVCollector(30)

    def failing_put(first: int, end: int, kv: torch.Tensor) -> None:
        if first == 3:
            raise RuntimeError("injected: no pinned memory")
        bad.put(first, end, kv)

    bad.export.put = failing_put
    prefill.add_request("good", PROMPTS[2], greedy(1), kv_export=good.export)
    prefill.add_request("bad", PROMPTS[3], greedy(1), kv_export=bad.export)
    outs = []
    while prefill.has_unfinished_requests():
        outs += prefill.step()
    assert sorted(o.request_id for o in outs if o.finished and o.error is None) == ["bad", "good"]
    assert [p[0] for p in bad.parts] == [0, 1, 2]
    assert good.kv().shape[0] == 30


def test_remote_prefill_can_fall_back_to_local(llm, hf_model):
    decode = llm.engine
    free = decode.block_manager.num_free_blocks
    decode.add_request("fallback", PROMPTS[4], greedy(16), remote_prefill=True)
    assert decode.block_manager.num_free_blocks < free
    decode.prefill_locally("fallback")
    outs = []
    while decode.has_unfinished_requests():
        outs += [o for o in decode.step() if o.finished]
    assert outs[0].token_ids == reference(hf_model, outs[0].prompt_token_ids, 16)
    assert decode.block_manager.num_free_blocks == free


def test_blocks_a_peer_may_still_write_are_never_given_out_again(llm, hf_model):
    """A remote request whose one-sided receive was cut off mid-write keeps its reserved blocks out
    of use for good; recomputed here, it is still answered token-exact, in blocks of its own."""
    decode = llm.engine
    free = decode.block_manager.num_free_blocks
    seq = decode.add_request("written-on", PROMPTS[2], greedy(8), remote_prefill=True)
    reserved = set(seq.block_table)
    assert decode.keep_remote_blocks_aside("written-on") == len(reserved)
    decode.prefill_locally("written-on")
    assert not reserved & set(seq.block_table)
    outs = []
    while decode.has_unfinished_requests():
        outs += [o for o in decode.step() if o.finished]
    assert outs[0].token_ids == reference(hf_model, outs[0].prompt_token_ids, 8)
    assert decode.block_manager.num_free_blocks == free - len(reserved)


def test_values_at_the_bounds_sample(llm):
    params = SamplingParams(temperature=1e-5, top_k=2**31 - 1, seed=2**63 - 1, stop=["x" * 256] * 16,
                            stop_token_ids=[2**31 - 1] * 64, max_tokens=8)
    # A temperature this small picks the most likely token here, as greedy does.
    assert llm.generate(PROMPTS[1], params)[0].token_ids == llm.generate(PROMPTS[1], greedy(8))[0].token_ids


def run_to_end(llm: LLM) -> dict:
    """Step the engine until every request has finished; their final outputs by request id."""
    done = {}
    while llm.engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in llm.engine.step() if out.finished)
    return done


def fail_sampling(engine, request_id: str, after_tokens: int, monkeypatch) -> None:
    """Make sampling `request_id`'s next token raise once it has `after_tokens` output tokens, where a
    seed of 2**70 used to raise before SamplingParams refused it: in its generator."""
    generator_for = engine.sampler.generator_for
    calls = 0

    def failing(seq: Sequence):
        nonlocal calls
        if seq.request_id == request_id:
            calls += 1
            if calls > after_tokens:
                raise RuntimeError("injected sampling failure")
        return generator_for(seq)

    monkeypatch.setattr(engine.sampler, "generator_for", failing)


def test_a_sampling_failure_fails_that_request_alone(llm, hf_model, monkeypatch):
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    fail_sampling(engine, "bad", 3, monkeypatch)
    engine.add_request("good-0", PROMPTS[1], greedy(16))
    engine.add_request("bad", PROMPTS[2], SamplingParams(temperature=0.8, max_tokens=16))
    engine.add_request("good-1", PROMPTS[4], greedy(16))
    done = run_to_end(llm)
    bad = done["bad"]
    assert bad.finish_reason == "error" and len(bad.token_ids) == 3
    assert bad.error == "sampling its next token failed: RuntimeError: injected sampling failure"
    for request_id in ("good-0", "good-1"):  # decoded in the same batches, untouched
        out = done[request_id]
        assert out.error is None and out.token_ids == reference(hf_model, out.prompt_token_ids, 16)
    assert engine.block_manager.num_free_blocks == free


def test_a_forward_failure_fails_its_step_and_the_engine_goes_on(llm, hf_model, monkeypatch):
    engine = llm.engine
    free = engine.block_manager.num_free_blocks
    run = engine.runner.run
    steps = 0

    def failing_third_step(batch):
        nonlocal steps
        steps += 1
        if steps == 3:
            raise RuntimeError("injected forward failure")
        return run(batch)

    monkeypatch.setattr(engine.runner, "run", failing_third_step)
    engine.add_request("a", PROMPTS[1], greedy(16))
    engine.add_request("b", PROMPTS[4], greedy(16))
    done = run_to_end(llm)
    for out in done.values():
        assert out.finish_reason == "error" and len(out.token_ids) == 2
        assert out.error == "the model forward failed: RuntimeError: injected forward failure"
    assert engine.block_manager.num_free_blocks == free
    assert_matches_reference(llm, hf_model, [PROMPTS[3]], [8])


def test_async_engine_ends_a_failed_request_alone_and_counts_it(llm, hf_model, monkeypatch):
    fail_sampling(llm.engine, "bad", 0, monkeypatch)
    engine = AsyncEngine(llm.engine)

    async def last_output(request_id: str, params: SamplingParams):
        outputs = [out async for out in engine.generate(request_id, llm.tokenizer.encode(PROMPTS[1]), params)]
        return outputs[-1]

    async def both():
        return await asyncio.gather(last_output("good", greedy(12)), last_output("bad", SamplingParams(max_tokens=12)),
                                    return_exceptions=True)

    try:
        good, bad = asyncio.run(both())
    finally:
        engine.stop()
    assert isinstance(bad, RequestFailed) and "injected sampling failure" in str(bad)
    assert good.token_ids == reference(hf_model, good.prompt_token_ids, 12)
    assert engine.stats.num_request_errors == 1


def test_penalties_and_logit_bias_match_a_reference(llm, hf_model):
    prompt = "1, 2, 3, 4, 5,"
    ids = llm.tokenizer.encode(prompt)
    plain = llm.generate(prompt, greedy(8))[0].token_ids
    bias = {plain[0]: -100.0, plain[1]: 3.0}
    params = SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=0.7, logit_bias=bias, ignore_eos=True)
    # Batched with a neutral request: the penalties are applied to its row only.
    penalized, neutral = llm.generate([prompt, PROMPTS[1]], [params, greedy(8)])
    assert penalized.token_ids == penalized_reference(hf_model, ids, 8, 1.3, 0.5, 0.7, bias)
    assert penalized.token_ids != plain
    assert neutral.token_ids == reference(hf_model, neutral.prompt_token_ids, 8)


def test_min_tokens_masks_eos_and_stop_strings(llm):
    eos = min(llm.tokenizer.eos_token_ids)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, min_tokens=3, logit_bias={eos: 100.0}))[0]
    assert out.token_ids[3:] == [eos] and eos not in out.token_ids[:3] and out.finish_reason == "stop"
    # A stop token id outside the vocabulary is allowed (it never comes) and masks nothing.
    far = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, min_tokens=2, stop_token_ids=[2**31 - 1],
                                               ignore_eos=True))[0]
    assert len(far.token_ids) == 3
    base = llm.generate("1, 2, 3, 4, 5,", greedy(16))[0]
    assert base.text.startswith(" 6") and " 8" in base.text
    ignored, included = llm.generate(["1, 2, 3, 4, 5,"] * 2, [
        SamplingParams(temperature=0, max_tokens=16, stop=[" 6"], min_tokens=4),  # " 6" comes before min_tokens
        SamplingParams(temperature=0, max_tokens=16, stop=[" 8"], include_stop_str_in_output=True)])
    assert ignored.text == base.text and ignored.finish_reason == "length"
    assert included.text == base.text[:base.text.index(" 8") + 2] and included.stop_reason == " 8"


def test_prompt_logprobs_match_transformers_chunked_and_cached(model_dir, hf_model):
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_num_batched_tokens=64, kv_cache_memory=KV_CACHE_BYTES)
    prompt = PASSAGE + "\nSummarize:"
    ids = llm.tokenizer.encode(prompt)
    with torch.no_grad():
        want = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    llm.generate(prompt, greedy(1))  # its blocks are now in the prefix cache, which prompt logprobs skip
    scoring = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    batch = llm.generate([prompt, PROMPTS[3], prompt], [scoring, greedy(4), scoring])
    out = batch[0]
    assert len(ids) > 64 and out.num_cached_tokens == 0  # computed in two chunks, nothing from the cache
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry.token_id == ids[i]
        assert entry.logprob == pytest.approx(want[i - 1, ids[i]].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == torch.topk(want[i - 1], 2).indices.tolist()
    assert out.token_ids == reference(hf_model, ids, 2)
    assert batch[1].prompt_logprobs is None
    twin = batch[2]  # the same prompt scored once: the twin took those logprobs and the prefix cache
    assert twin.num_cached_tokens > 0 and twin.prompt_logprobs == out.prompt_logprobs
    assert twin.token_ids == out.token_ids


def test_a_remote_first_token_off_the_grammar_is_refused_before_it_is_sent(llm):
    """The first token's output is made when it arrives with the KV, before the KV loads: one that
    breaks the request's grammar (a prefill node that did not apply it) is refused there, before
    anything changes."""
    engine = llm.engine
    params = greedy(4)
    params.structured = StructuredOutputSpec("choice", json.dumps(["Paris", "Lyon"]))
    engine.add_request("g", "The capital of France is", params, remote_prefill=True)
    slot = engine.remote_slot("g")
    off_grammar = engine.tokenizer.encode(" 42")[0]
    with pytest.raises(ValueError, match="grammar"):
        slot.first.output(off_grammar, None)
    on_grammar = engine.tokenizer.encode("Paris")[0]
    assert slot.first.output(on_grammar, None).token_ids == [on_grammar]
    engine.finish_remote_prefill("g", None, slot.first, kv_start=slot.cached_tokens)
    assert engine.requests["g"].seq.output_token_ids == [on_grammar]
    assert engine.abort_request("g")


def remote_everything(uncached: int) -> bool:
    return True


def test_a_routed_request_waits_for_its_prefix_arriving_for_another_and_is_slotted_for_the_rest(llm):
    """Issue 26: a second request whose prefix is arriving for a first one (its blocks reserved, KV not
    loaded) gets its slot only once that KV is loaded, with the prefix cached: the prefill node is
    asked for the rest only. A request for another prefix is slotted at once meanwhile."""
    engine = AsyncEngine(llm.engine)
    bs = engine.block_size
    prefix = list(range(1000, 1000 + 8 * bs))  # new to this module's cache

    async def scenario():
        queue, slot, waited = await engine.add_routed_request("first", prefix + [5, 6, 7], greedy(2),
                                                              remote_everything, prefix_wait=30)
        assert waited is None and slot.cached_tokens == 0 and slot.rows is not None
        second = asyncio.create_task(engine.add_routed_request("second", prefix + [8, 9], greedy(2),
                                                               remote_everything, prefix_wait=30))
        _, other, other_waited = await engine.add_routed_request("other", list(range(2000, 2040)), greedy(2),
                                                                 remote_everything, prefix_wait=30)
        assert other_waited is None and other.rows is not None
        await asyncio.sleep(0.3)
        assert not second.done()
        await engine.finish_remote_prefill("first", queue, slot, None, 7)  # its KV landed in its blocks
        _, slot2, waited2 = await asyncio.wait_for(second, 10)
        for request_id in ("first", "second", "other"):
            await engine.drop(request_id)
        return slot2, waited2

    try:
        slot2, waited2 = asyncio.run(scenario())
    finally:
        engine.stop()
    assert waited2 == PrefixWait(arriving=8 * bs, saved=8 * bs)
    assert slot2.cached_tokens == 8 * bs and slot2.rows is not None and len(slot2.rows) == 2


@pytest.mark.parametrize("ending", ["aborted", "recomputed", "never_comes"])
def test_a_request_waiting_for_an_arriving_prefix_goes_on_when_it_will_not_come(llm, ending):
    """The first request ends without its KV (its client left, its prefill node failed) or its KV takes
    longer than the second's bound: the second goes on, slotted for its whole prompt, as without a wait."""
    engine = AsyncEngine(llm.engine)
    bs = engine.block_size
    prefix = list(range(3000 + 100 * len(ending), 3000 + 100 * len(ending) + 4 * bs))  # new to the cache

    async def scenario():
        await engine.add_routed_request("first", prefix + [5], greedy(2), remote_everything, prefix_wait=30)
        second = asyncio.create_task(engine.add_routed_request("second", prefix + [6], greedy(2), remote_everything,
                                                               prefix_wait=0.5 if ending == "never_comes" else 30))
        await asyncio.sleep(0.2)
        assert not second.done()
        if ending == "aborted":
            await engine.drop("first")
        elif ending == "recomputed":
            await engine.prefill_locally("first")
        start = time.monotonic()
        _, slot, waited = await asyncio.wait_for(second, 10)
        for request_id in ("first", "second"):
            await engine.drop(request_id)
        return slot, waited, time.monotonic() - start

    try:
        slot, waited, seconds = asyncio.run(scenario())
    finally:
        engine.stop()
    # Well inside the 30 s bound it would otherwise wait out (the local prefill's steps took 2.4 s on a loaded
    # 2-core machine).
    assert waited == PrefixWait(arriving=4 * bs, saved=0) and slot.cached_tokens == 0 and seconds < 5


# Async scheduling: a greedy decode step is launched before the one in flight is read back.

@pytest.fixture(scope="module")
def ahead(model_dir):
    """An engine with async scheduling, counting the steps it launched ahead."""
    llm = LLM(str(model_dir), device="cpu", dtype="float32", kv_cache_memory=KV_CACHE_BYTES, async_scheduling=True)
    launch = llm.engine._launch
    llm.ahead_steps = 0

    def counted(batch, prev):
        llm.ahead_steps += prev is not None
        return launch(batch, prev)

    llm.engine._launch = counted
    return llm


def no_placeholders(outputs) -> bool:
    return all(t >= 0 for out in outputs for t in out.token_ids)


def test_async_scheduling_gives_transformers_tokens_and_steps_ahead(ahead, hf_model):
    before = ahead.ahead_steps
    outs = assert_matches_reference(ahead, hf_model, PROMPTS[:6], MAX_TOKENS[:6])  # lengths 2-32, ends apart
    assert ahead.ahead_steps - before > 10  # most decode steps went ahead of the read-back
    assert no_placeholders(outs) and ahead.engine.in_flight is None
    assert ahead.engine.block_manager.num_free_blocks == ahead.engine.block_manager.num_blocks


def test_async_scheduling_stops_where_the_synchronous_engine_stops(ahead, llm):
    """Stop strings, stop tokens and EOS are seen a step late: the step launched meanwhile is dropped."""
    cases = [greedy(32), SamplingParams(temperature=0, max_tokens=32, stop=[" 8"]),
             SamplingParams(temperature=0, max_tokens=40, stop=["."]), SamplingParams(temperature=0, max_tokens=64)]
    prompts = ["1, 2, 3, 4, 5,", "1, 2, 3, 4, 5,", PROMPTS[2], PROMPTS[1]]
    want = [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in llm.generate(prompts, cases)]
    got = ahead.generate(prompts, cases)
    assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in got] == want
    k = next(i for i, t in enumerate(want[0][0]) if i >= 3 and t not in want[0][0][:i])
    params = SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[want[0][0][k]])
    assert ahead.generate("1, 2, 3, 4, 5,", params)[0].token_ids == want[0][0][:k + 1]
    assert ahead.engine.block_manager.num_free_blocks == ahead.engine.block_manager.num_blocks


def test_async_scheduling_with_arrivals_aborts_and_sampled_requests_between_steps(ahead, hf_model):
    """A request added mid-decode, one aborted while a step is in flight, one that samples (it never goes
    ahead): the greedy ones still get transformers' tokens, the aborted one no placeholder, and every
    block comes back."""
    engine = ahead.engine
    free = engine.block_manager.num_free_blocks
    engine.add_request("a", PROMPTS[1], greedy(24))
    engine.add_request("gone", PROMPTS[3], greedy(24))
    outputs = [out for _ in range(6) for out in engine.step()]
    assert engine.in_flight is not None  # a step is in flight between two calls
    engine.add_request("late", PROMPTS[4], greedy(16))
    assert engine.abort_request("gone")
    outputs += [out for _ in range(3) for out in engine.step()]
    engine.add_request("sampled", PROMPTS[2], SamplingParams(temperature=0.8, max_tokens=12, seed=3,
                                                                  ignore_eos=True))
    done = run_to_end(ahead)
    assert no_placeholders(outputs + list(done.values()))
    assert "gone" not in done and not any(out.request_id == "gone" and out.finished for out in outputs)
    for request_id, max_tokens in (("a", 24), ("late", 16)):
        out = done[request_id]
        assert out.token_ids == reference(hf_model, out.prompt_token_ids, max_tokens)
    assert len(done["sampled"].token_ids) == 12
    assert engine.block_manager.num_free_blocks == free


def test_async_scheduling_a_remote_request_joins_a_step_launched_ahead(ahead, llm, hf_model, monkeypatch):
    """A decode node's remote request whose KV has landed joins the next step launched ahead, beside the
    step in flight, instead of waiting for that step to be read back (which idled the GPU at every
    arrival); both requests get transformers' tokens."""
    engine = ahead.engine
    free = engine.block_manager.num_free_blocks
    engine.add_request("a", PROMPTS[1], greedy(24))
    outputs = [out for _ in range(4) for out in engine.step()]
    assert engine.in_flight is not None
    export = KVCollector(30, 7)
    llm.engine.add_request("p", PROMPTS[2], greedy(1), kv_export=export.export)
    engine.add_request("r", PROMPTS[2], greedy(16), remote_prefill=True)
    first = engine.remote_slot("r").first
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            outputs.append(first.output(out.token_ids[0], None))
    engine.finish_remote_prefill("r", export.kv(), first)
    launched = []
    launch = engine._launch

    def recorded(batch, prev):
        launched.append(({item.seq.request_id for item in batch}, prev is not None))
        return launch(batch, prev)

    monkeypatch.setattr(engine, "_launch", recorded)
    outputs += engine.step()
    assert launched == [({"a", "r"}, True)]  # launched while a's step was in flight, r in it
    done = run_to_end(ahead)
    assert no_placeholders(outputs + list(done.values()))
    for request_id, max_tokens in (("a", 24), ("r", 16)):
        assert done[request_id].token_ids == reference(hf_model, done[request_id].prompt_token_ids, max_tokens)
    assert engine.in_flight is None and engine.block_manager.num_free_blocks == free


def test_async_scheduling_holds_a_finished_sequences_block_until_the_step_ahead_is_read(ahead, monkeypatch):
    """A step launched ahead writes each of its sequences' next KV into a block of theirs. One that finishes
    as the step before it is read back frees its blocks while that step still writes: the block it writes
    stays out of the free list until that step is read back (else the next request could be given it at
    once, a remote one's KV receiver writing from another stream, say)."""
    engine = ahead.engine
    bm = engine.block_manager
    free = bm.num_free_blocks
    launched = []
    launch = engine._launch

    def recorded(batch, prev):
        result = launch(batch, prev)
        launched.append(dict(zip((seq.request_id for seq in result[1].seqs), result[1].held)))
        return result

    monkeypatch.setattr(engine, "_launch", recorded)
    engine.add_request("a", PROMPTS[1], greedy(3))
    engine.add_request("b", PROMPTS[2], greedy(12))
    while True:
        outputs = engine.step()
        if any(out.request_id == "a" and out.finished for out in outputs):
            break
    written = launched[-1]["a"]  # launched in this call, before a's last token was read back
    assert engine.in_flight is not None and "a" not in engine.requests
    assert bm.blocks[written].ref_count == 1 and written not in bm.free_ids
    engine.step()  # reads that step back
    assert bm.blocks[written].ref_count == 0 and written in bm.free_ids
    run_to_end(ahead)
    assert engine.in_flight is None and bm.num_free_blocks == free


def test_async_scheduling_a_failed_step_ahead_fails_its_requests_once_the_step_before_is_read(ahead, hf_model,
                                                                                             monkeypatch):
    engine = ahead.engine
    free = engine.block_manager.num_free_blocks
    run_ahead = engine.runner.run_ahead
    calls = 0

    def failing_third_ahead(batch, placeholders):
        nonlocal calls
        calls += placeholders is not None
        if calls == 3 and placeholders is not None:
            raise RuntimeError("injected forward failure")
        return run_ahead(batch, placeholders)

    monkeypatch.setattr(engine.runner, "run_ahead", failing_third_ahead)
    engine.add_request("x", PROMPTS[1], greedy(16))
    engine.add_request("y", PROMPTS[4], greedy(16))
    done = run_to_end(ahead)
    for out in done.values():
        # What came before the failure is the tokens transformers gives, and no placeholder.
        assert out.finish_reason == "error"
        assert out.error == "the model forward failed: RuntimeError: injected forward failure"
        assert no_placeholders([out]) and 2 <= len(out.token_ids) < 16
        assert out.token_ids == reference(hf_model, out.prompt_token_ids, 16)[:len(out.token_ids)]
    assert engine.in_flight is None and engine.block_manager.num_free_blocks == free
    monkeypatch.undo()
    assert_matches_reference(ahead, hf_model, [PROMPTS[3]], [8])
