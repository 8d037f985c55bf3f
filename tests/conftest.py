"""Shared fixtures: the embedded model converted once (into the default cache, so reruns are fast),
its transformers twin as the reference, and tiny random Llama directories for fast engine tests.

Two lanes: a test that starts processes or loads the real model is marked `slow`, and
`pytest -m "not slow"` runs the rest in under a minute. A test that uses one of SLOW_FIXTURES
(model_dir, and so hf_model, hf_tokenizer and tiny_llama_dir, which build on it) is marked here;
one that starts processes otherwise is marked in its module."""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from servers import PAIR_MAX_MODEL_LEN, Node, start_node, wait_all_ready

from disagg.engine.loader import resolve_model

# Small matrix products run faster on one thread than on two that wait on each other, and the
# suite shares two cores with the server processes it starts.
torch.set_num_threads(1)

SLOW_FIXTURES = {"model_dir", "pair_1p1d"}  # the real model; a 1P1D pair of node processes
# Modules that hold three node processes or more at once.
MANY_NODE_MODULES = {"test_serving", "test_cache_aware_routing", "test_router", "test_tensor_parallel",
                     "test_prefill_pick", "test_prefill_route", "test_kv_plane_hardening", "test_quickstart"}


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES & set(item.fixturenames):  # fixturenames: those it uses through other fixtures too
            item.add_marker(pytest.mark.slow)
    # The modules that use the shared pair run first, so that its two nodes stop before the rest start theirs
    # (pytest_runtest_teardown); a stable sort keeps each module's tests together and in their order.
    pair_modules = {item.module for item in items if "pair_1p1d" in item.fixturenames}
    items.sort(key=lambda item: item.module not in pair_modules)
    # Under pytest-xdist (`-n 2 --dist loadgroup`, the README's command) a worker takes whole modules, so that
    # a module's servers start once. The pair's modules and those that start three node processes or more
    # go to one worker together, one after the other: one pair starts, and two such modules never hold
    # their processes at once (the suite's memory).
    for item in items:
        heavy = item.module in pair_modules or item.module.__name__ in MANY_NODE_MODULES
        item.add_marker(pytest.mark.xdist_group("many_nodes" if heavy else item.module.__name__))


_pair_nodes: list[Node] = []  # the shared pair's nodes, once started


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the shared pair after the last test that uses it: two idle nodes are about 1 GB the rest would carry."""
    if _pair_nodes and nextitem is not None and "pair_1p1d" in item.fixturenames:
        session_items = item.session.items
        if not any("pair_1p1d" in later.fixturenames for later in session_items[session_items.index(item) + 1:]):
            for node in _pair_nodes:
                node.kill()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a Hugging Face directory ($DISAGG_CACHE or ~/.cache/disagg)."""
    return resolve_model(None)


@pytest.fixture(scope="session")
def pair_1p1d(tmp_path_factory: pytest.TempPathFactory) -> tuple[Node, Node]:
    """One CPU 1P1D pair (prefill node, decode node) shared by the modules that test through it."""
    tmp = tmp_path_factory.mktemp("pair-1p1d")
    # The profiler's routes (test_vllm_metrics) cost nothing until a test starts it.
    args = ["--max-model-len", str(PAIR_MAX_MODEL_LEN),
            "--profiler-config", json.dumps({"profiler": "torch", "torch_profiler_dir": str(tmp / "traces")})]
    prefill = start_node("producer", tmp, extra_args=args, wait=False)
    # "fail": a request the prefill node does not serve is an error, not a silent recompute; "always":
    # every prompt crosses, however short (the modules test the handoff under load).
    decode = start_node("consumer", tmp, prefill_nodes=[prefill.grpc_address], extra_args=args, wait=False,
                        kv_extra={"prefill_policy": "fail", "remote_prefill": "always", "prefill_timeout": 120.0,
                                  "lookup_timeout": 60.0})
    wait_all_ready(prefill, decode)
    _pair_nodes[:] = [prefill, decode]
    yield prefill, decode
    decode.kill()
    prefill.kill()


@pytest.fixture(scope="session")
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def write_tiny_llama(out_dir: Path, tokenizer_dir: Path, *, num_heads: int = 4, num_kv_heads: int = 2,
                     num_layers: int = 2, hidden_size: int = 64, intermediate_size: int = 128,
                     head_dim: int | None = None, tie_word_embeddings: bool = True, seed: int = 0,
                     **config_overrides) -> Path:
    """A complete Hugging Face Llama directory with random weights and the embedded model's tokenizer.

    The vocabulary is the tokenizer's (49152) so token ids from the real tokenizer are valid here;
    everything else is small so a forward pass takes milliseconds.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads, max_position_embeddings=2048, rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=1, eos_token_id=2, **config_overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


@pytest.fixture
def tiny_llama_dir(tmp_path: Path, model_dir: Path) -> Callable[..., Path]:
    """Factory: tiny_llama_dir(num_heads=4, num_kv_heads=2, ...) -> a fresh tiny Llama directory."""
    count = 0

    def make(**kwargs) -> Path:
        nonlocal count
        count += 1
        return write_tiny_llama(tmp_path / f"tiny-llama-{count}", model_dir, **kwargs)

    return make
