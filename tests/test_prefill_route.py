"""Conditional disaggregation: a decode node computes a prompt itself when few of its tokens miss
its prefix cache (kv_connector_extra_config.remote_prefill "auto", local_prefill_max_tokens), and
sends the others to a prefill node."""

import httpx
import pytest
from prompts import PASSAGE, hf_greedy
from servers import start_node

from disagg.config import EXTRA_DEFAULTS, KVTransferConfig
from disagg.decode_node.node import wants_remote_prefill

MAX_TOKENS = 16


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
def test_the_route_follows_the_policy_and_the_uncached_tokens(policy, uncached, remote):
    assert wants_remote_prefill(policy, uncached, local_prefill_max_tokens=64) is remote


def test_auto_with_threshold_zero_sends_every_prompt():
    assert wants_remote_prefill("auto", 1, local_prefill_max_tokens=0)  # a prompt leaves one token at least


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
def test_default_pair_computes_short_prompts_here_and_sends_long_ones(tmp_path, hf_model, hf_tokenizer):
    """Default remote_prefill ("auto", 64 tokens): a prompt of a few tokens is computed on the decode
    node (no Prefill call, route local); a ~1,200-token prompt goes to the prefill node (route
    remote); the same long prompt again, whose KV the decode node now holds in its prefix cache but
    for its last partial block, is computed here. All token for token as transformers."""
    prefill = start_node("producer", tmp_path)
    # "fail": a prompt routed remote that the prefill node does not serve is an error, not a recompute.
    decode = start_node("consumer", tmp_path, prefill_nodes=[prefill.grpc_address],
                        kv_extra={"prefill_policy": "fail", "prefill_timeout": 120.0, "lookup_timeout": 60.0})
    short = "The capital of France is"
    long = PASSAGE * 19 + "\nWhat was the first topic mentioned?"
    long_ids = hf_tokenizer(long).input_ids
    assert 1100 < len(long_ids) < 1400

    def calls() -> float:
        return decode.metric("disagg_remote_prefill_call_seconds_count")

    def routes() -> dict[str, float]:
        return decode.labelled("disagg_prefill_route_total", "route")

    def ask(prompt: str) -> str:
        r = httpx.post(f"{decode.url}/v1/completions", timeout=240, json={
            "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def expected(prompt: str) -> str:
        ids = hf_tokenizer(prompt).input_ids
        return hf_tokenizer.decode(hf_greedy(hf_model, ids, MAX_TOKENS), skip_special_tokens=True)

    try:
        assert ask(short) == expected(short)
        assert calls() == 0
        assert routes() == {"local": 1.0}
        assert "prefill d" not in prefill.log()  # the prefill node never saw it

        assert ask(long) == expected(long)
        assert calls() == 1
        assert routes() == {"local": 1.0, "remote": 1.0}
        assert decode.labelled("disagg_remote_prefill_total", "outcome") == {"ok": 1.0}

        assert ask(long) == expected(long)  # its blocks are in the decode node's prefix cache now
        assert calls() == 1
        assert routes() == {"local": 2.0, "remote": 1.0}
    finally:
        decode.kill()
        prefill.kill()
