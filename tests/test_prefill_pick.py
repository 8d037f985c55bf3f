"""A decode node picks its prefill node by cache and load: each prefill node's Watch stream tells it
which blocks the node's prefix cache holds, so prompts sharing a prefix go where that prefix is."""

import re

import httpx
import pytest
from prompts import CODE, PASSAGE, hf_greedy
from servers import start_node, wait_all_ready, wait_for

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 8


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_prompts_sharing_a_prefix_go_to_the_prefill_node_that_holds_it(tmp_path, hf_model, hf_tokenizer):
    """2 prefill nodes + 1 decode node (every prompt sent out: remote_prefill "always"). Two prefixes
    go one to each node (both idle: the first, then the one with fewer calls). Then the second
    prefix's next prompt comes first: picking by load alone would send it to the first node (the
    calls are even, ties go to the first), by cache it goes to the node that holds its prefix, and so
    does the first prefix's. Each node's log shows its prefix served from its cache; the answers are
    transformers' token for token."""
    prefills = [start_node("producer", tmp_path, wait=False) for _ in range(2)]
    decode = start_node("consumer", tmp_path, prefill_nodes=[p.grpc_address for p in prefills], wait=False,
                        kv_extra={"prefill_policy": "fail", "remote_prefill": "always", "prefill_timeout": 120.0,
                                  "lookup_timeout": 60.0})
    nodes = [*prefills, decode]
    prefixes = [PASSAGE * 3, CODE * 2]  # a few hundred tokens each, sharing no block
    prompts = {(p, q): prefixes[p] + f"\nQuestion {q}: what is this about?" for p in (0, 1) for q in (1, 2)}
    assert all(len(hf_tokenizer(prefix).input_ids) > 150 for prefix in prefixes)

    def ask(key: tuple[int, int]) -> str:
        r = httpx.post(f"{decode.url}/v1/completions", timeout=240, json={
            "model": MODEL, "prompt": prompts[key], "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def expected(key: tuple[int, int]) -> str:
        ids = hf_tokenizer(prompts[key]).input_ids
        return hf_tokenizer.decode(hf_greedy(hf_model, ids, MAX_TOKENS), skip_special_tokens=True)

    def cached_blocks() -> list[int]:
        state = httpx.get(f"{decode.url}/health", timeout=10).json()["prefill_state"]
        return [state[p.grpc_address]["cached_blocks"].get("device", 0) for p in prefills]

    def served(node) -> list[tuple[int, int]]:
        """(prompt tokens, of which cached) of each prefill the node's log reports, in order."""
        found = re.findall(r"prefill d\S+: (\d+) prompt tokens \((\d+) cached\)", node.log())
        return [(int(total), int(cached)) for total, cached in found]

    try:
        wait_all_ready(*nodes)  # started together: their loads overlap
        answers = {}
        for key in ((0, 1), (1, 1)):
            answers[key] = ask(key)
        # Both prefixes are in the views the decode node follows.
        wait_for(lambda: all(cached_blocks()), 10, "each prefill node's cache in the decode node's view")
        for key in ((1, 2), (0, 2)):
            answers[key] = ask(key)
        assert answers == {key: expected(key) for key in prompts}
        for i, node in enumerate(prefills):
            first, second = served(node)
            prefix_tokens = len(hf_tokenizer(prefixes[i]).input_ids)
            assert first[1] == 0  # computed in full the first time ...
            assert second[1] >= prefix_tokens - 16  # ... and its prefix's blocks served from its cache
    finally:
        for node in nodes:
            node.kill()
