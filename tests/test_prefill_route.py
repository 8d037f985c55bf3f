"""Conditional disaggregation: a decode node computes a prompt itself when that is cheaper by
measured costs (kv_connector_extra_config.remote_prefill "auto"; the fixed local_prefill_max_tokens
until they are measured), and sends the others to a prefill node; the progress a prefill node
reports lets a long step run past the no-progress limit."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prompts import PASSAGE, hf_greedy
from servers import start_node, wait_all_ready, wait_for

from disagg.config import EXTRA_DEFAULTS, KVTransferConfig
from disagg.control_plane import PrefillProgress
from disagg.decode_node.prefill_client import STEP_SLACK, UNMEASURED_STEP_S, made_progress
from disagg.decode_node.route import RouteCosts
from disagg.engine.request_stats import IterationStats
from disagg.engine.step_cost import StepCost

MAX_TOKENS = 8
KV_BYTES_PER_TOKEN = 46_080  # SmolLM2-135M in float32: 30 layers x 2 x 3 heads x 64 x 4 bytes


def step(seconds: float, prompt_tokens: int = 0) -> IterationStats:
    return IterationStats(step_tokens=prompt_tokens or 1, step_seconds=seconds, step_prompt_tokens=prompt_tokens)


def measured_costs(base: float = 0.02, per_token: float = 0.002) -> RouteCosts:
    """Costs as a decode node has them once it computed prompts here and had one computed remotely."""
    local = StepCost()
    for prompt_tokens in (0, 0, 30, 100):  # decode-only steps, and steps with prompts of two sizes
        local.record(step(base + prompt_tokens * per_token, prompt_tokens))
    costs = RouteCosts(local, KV_BYTES_PER_TOKEN, local_prefill_max_tokens=64)
    costs.remote_done(call_seconds=0.03, node_seconds=0.02, kv_bytes=10**8, tail_seconds=0.1,  # 1 GB/s
                      load_seconds=0.005)
    return costs


# -- the decision, without processes -----------------------------------------------------------

@pytest.mark.parametrize("policy, uncached, remote", [
    ("auto", 1, False),
    ("auto", 64, False),  # the threshold itself is computed here
    ("auto", 65, True),
    ("auto", 1200, True),
    ("always", 1, True),
    ("always", 1200, True),
    ("never", 1, False),
    ("never", 1200, False),
])
def test_before_the_costs_are_measured_the_route_follows_the_policy_and_the_threshold(policy, uncached, remote):
    costs = RouteCosts(StepCost(), KV_BYTES_PER_TOKEN, local_prefill_max_tokens=64)
    route = costs.choose(policy, uncached, num_decoding=0, node_seconds=0.1)
    assert route.remote is remote
    assert route.basis == ("fallback" if policy == "auto" else "policy")


def test_auto_with_threshold_zero_sends_every_prompt_before_measuring():
    costs = RouteCosts(StepCost(), KV_BYTES_PER_TOKEN, local_prefill_max_tokens=0)
    assert costs.choose("auto", 1, num_decoding=0, node_seconds=None).remote  # a prompt leaves one token at least


def test_a_step_costs_a_base_and_a_cost_per_prompt_token_fitted_from_the_steps():
    cost = StepCost()
    assert cost.fit() is None and cost.tokens_per_second() == 0.0 and cost.step_seconds(8) is None
    cost.record(step(0.02))  # decodes alone
    cost.record(step(0.02 + 40 * 0.005, 40))
    assert cost.fit() is None  # too few tokens to route by
    assert cost.step_seconds(40) == pytest.approx(0.22)  # but enough to judge a step in progress
    cost.record(step(0.02 + 200 * 0.005, 200))
    assert cost.fit() == pytest.approx((0.02, 0.005))
    assert cost.tokens_per_second() == pytest.approx(200.0) and cost.base_seconds() == pytest.approx(0.02)


def test_steps_of_one_size_give_a_throughput_without_a_base():
    cost = StepCost()  # a prefill node fed prompts of one length
    for _ in range(3):
        cost.record(step(0.5, 100))
    assert cost.fit() == pytest.approx((0.0, 0.005)) and cost.tokens_per_second() == pytest.approx(200.0)


def test_measured_costs_compute_a_short_prompt_here_and_a_long_one_remotely_while_decodes_run():
    costs = measured_costs()
    node_seconds = 0.02 + 5 * 0.002  # an idle prefill node with our costs
    short = costs.choose("auto", 5, num_decoding=1, node_seconds=node_seconds)
    assert (short.remote, short.basis) == (False, "measured")
    # 1,200 tokens: 2.4 s here, held up for the running decode too; on an idle prefill node a step's base
    # and the same 2.4 s, plus the control path and 55 MB at 1 GB/s.
    long = costs.choose("auto", 1200, num_decoding=1, node_seconds=0.02 + 1200 * 0.002)
    assert long.remote and long.local_seconds == pytest.approx(4.8)
    assert long.remote_seconds == pytest.approx(0.02 + 2.4 + 0.015 + 1200 * KV_BYTES_PER_TOKEN / 1e9)
    # With nothing decoding here, the handoff only adds to the same compute: computed here.
    assert not costs.choose("auto", 1200, num_decoding=0, node_seconds=0.02 + 1200 * 0.002).remote


def test_a_prefill_pool_whose_queue_takes_longer_than_computing_here_is_skipped():
    costs = measured_costs()
    queued = 0.02 + (20_000 + 1200) * 0.002  # 20,000 tokens queued before it on the prefill node
    assert not costs.choose("auto", 1200, num_decoding=4, node_seconds=queued).remote
    assert costs.choose("auto", 1200, num_decoding=4, node_seconds=0.02 + 1200 * 0.002).remote


def test_a_node_with_no_measured_throughput_leaves_the_choice_to_the_threshold():
    route = measured_costs().choose("auto", 1200, num_decoding=0, node_seconds=None)
    assert (route.remote, route.basis) == (True, "fallback")


# -- progress of a Prefill call ----------------------------------------------------------------

def test_a_long_step_within_its_expected_time_is_progress_and_a_hung_one_is_not():
    last = PrefillProgress(engine_steps=7, num_computed_tokens=0, step_seconds=1.0, step_expected_seconds=12.0)
    assert made_progress(PrefillProgress(8, 0), last)  # a new step
    assert made_progress(PrefillProgress(7, 16), last)  # more of the prompt computed
    assert made_progress(PrefillProgress(7, 0, 11.0, 12.0), last)  # a 12 s chunk, 11 s in
    assert made_progress(PrefillProgress(7, 0, STEP_SLACK * 12.0, 12.0), last)
    assert not made_progress(PrefillProgress(7, 0, STEP_SLACK * 12.0 + 1, 12.0), last)  # hung
    assert not made_progress(PrefillProgress(7, 0), last)  # idle: no step runs
    assert made_progress(PrefillProgress(7, 0, UNMEASURED_STEP_S, 0.0), last)  # the node's first step
    assert not made_progress(PrefillProgress(7, 0, UNMEASURED_STEP_S + 1, 0.0), last)


def test_the_defaults_are_auto_below_64_tokens():
    kv = KVTransferConfig(kv_role="consumer")
    assert (kv.extra("remote_prefill"), kv.extra("local_prefill_max_tokens")) == ("auto", 64)
    assert EXTRA_DEFAULTS["remote_prefill"] == "auto"


def test_the_route_settings_are_read_and_checked():
    kv = KVTransferConfig(kv_role="consumer", kv_connector_extra_config={"remote_prefill": "never",
                                                                         "local_prefill_max_tokens": "128"})
    assert (kv.extra("remote_prefill"), kv.extra("local_prefill_max_tokens")) == ("never", 128)
    with pytest.raises(ValueError, match="remote_prefill must be one of auto, always, never"):
        KVTransferConfig(kv_connector_extra_config={"remote_prefill": "sometimes"})
    with pytest.raises(ValueError, match="local_prefill_max_tokens must be an integer"):
        KVTransferConfig(kv_connector_extra_config={"local_prefill_max_tokens": 1.5})
    with pytest.raises(ValueError, match="local_prefill_max_tokens must be 0 or more"):
        KVTransferConfig(kv_connector_extra_config={"local_prefill_max_tokens": -1})


# -- a real 1P1D pair with the default route ----------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_pair_routes_by_measured_costs(tmp_path, hf_model, hf_tokenizer):
    """Default remote_prefill ("auto"): before anything is measured, prompts of at most 64 uncached
    tokens are computed on the decode node and a ~1,200-token prompt goes to the prefill node; those
    measure both routes. Then, by the measured costs, a prompt of a few tokens is computed here, the
    long prompt again (cached here now) too, and another ~1,200-token prompt, arriving while two
    answers decode here, goes to the idle prefill node. All token for token as transformers."""
    prefill = start_node("producer", tmp_path, wait=False)
    # "fail": a prompt routed remote that the prefill node does not serve is an error, not a recompute.
    decode = start_node("consumer", tmp_path, prefill_nodes=[prefill.grpc_address], wait=False,
                        kv_extra={"prefill_policy": "fail", "prefill_timeout": 120.0, "lookup_timeout": 60.0})
    warm = [PASSAGE[:200], PASSAGE[200:]]  # a few dozen tokens each: computed here under the threshold
    short = "The capital of France is"
    long = PASSAGE * 19 + "\nWhat was the first topic mentioned?"
    other = "Notes for the exam.\n" + PASSAGE * 19 + "\nWhat was the last topic mentioned?"
    assert all(len(hf_tokenizer(p).input_ids) <= 64 for p in warm)
    assert all(1100 < len(hf_tokenizer(p).input_ids) < 1400 for p in (long, other))

    def calls() -> float:
        return decode.metric("disagg_remote_prefill_call_seconds_count")

    def routes() -> dict[str, float]:
        return decode.labelled("disagg_prefill_route_total", "route")

    def bases() -> dict[str, float]:
        return decode.labelled("disagg_prefill_route_basis_total", "basis")

    def ask(prompt: str, max_tokens: int = MAX_TOKENS) -> str:
        r = httpx.post(f"{decode.url}/v1/completions", timeout=240, json={
            "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def expected(prompt: str, max_tokens: int = MAX_TOKENS) -> str:
        ids = hf_tokenizer(prompt).input_ids
        return hf_tokenizer.decode(hf_greedy(hf_model, ids, max_tokens), skip_special_tokens=True)

    try:
        wait_all_ready(prefill, decode)
        for prompt in warm:
            assert ask(prompt) == expected(prompt)
        assert ask(long) == expected(long)
        assert calls() == 1
        assert routes() == {"local": 2.0, "remote": 1.0} and bases() == {"fallback": 3.0}
        assert decode.labelled("disagg_remote_prefill_total", "outcome") == {"ok": 1.0}
        # The prefill node reports its throughput every half second.
        wait_for(lambda: httpx.get(f"{decode.url}/health").json()["prefill_state"][prefill.grpc_address][
            "prefill_tokens_per_s"] > 0, 10, "the prefill node's measured throughput")

        print(httpx.get(f"{decode.url}/health").json())  # the measured costs, for a failure's report
        assert ask(short) == expected(short)
        assert ask(long) == expected(long)  # its blocks are in the decode node's prefix cache now
        assert calls() == 1
        assert routes() == {"local": 4.0, "remote": 1.0} and bases() == {"fallback": 3.0, "measured": 2.0}

        texts = ["", ""]
        with ThreadPoolExecutor(1) as pool, httpx.stream(
                "POST", f"{decode.url}/v1/completions", timeout=240,
                json={"model": "SmolLM2-135M-Instruct", "prompt": short, "max_tokens": 24, "temperature": 0,
                      "n": 2, "stream": True}) as decoding:
            answer = None
            for line in decoding.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[len("data: "):])["choices"]:
                    texts[choice["index"]] += choice["text"]
                if answer is None:  # both answers decode here now
                    answer = pool.submit(ask, other)
            assert answer.result() == expected(other)
        assert texts == [expected(short, 24)] * 2
        assert calls() == 2
        # n=2: two engine requests, each routed
        assert routes() == {"local": 6.0, "remote": 2.0} and bases() == {"fallback": 3.0, "measured": 5.0}
    finally:
        decode.kill()
        prefill.kill()
