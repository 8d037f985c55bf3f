"""Prefix pull between prefill nodes (issue 26): a prefill node told by the decode node that another
prefill node holds a prompt's prefix pulls those blocks (FetchBlocks, KV over the pipe) into its
prefix cache instead of computing them, and computes them when the pull fails."""

import asyncio
import re
import uuid

import pytest
import torch
from prompts import CODE, PASSAGE, hf_greedy
from servers import PAIR_MAX_MODEL_LEN, free_port, start_node

from disagg.config import KVTransferConfig
from disagg.control_plane import NodeInfo, PrefillCall
from disagg.decode_node.prefill_client import PrefillClient, PrefillPool
from disagg.engine.block_hash import prompt_block_hashes
from disagg.engine.config import EngineConfig
from disagg.engine.engine import LLMEngine
from disagg.engine.sampling_params import SamplingParams
from disagg.lookup_buffer import LookupBufferConsumer
from disagg.pipes.base import PipeConfig
from disagg.proto import convert
from disagg.proto import disagg_pb2 as pb

BLOCK = 16


def greedy(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int):
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final


def test_blocks_exported_from_one_engine_and_inserted_in_another_are_hit_there(tiny_llama_dir):
    """Engine 1 computes a prompt; the KV of its leading blocks, exported by hash, goes into engine 2's
    prefix cache under engine 2's own hashes of the tokens; the same prompt on engine 2 then hits them
    and answers as engine 1 did. An export stops at the first hash not held."""
    config = EngineConfig(model=str(tiny_llama_dir()), device="cpu", block_size=BLOCK, kv_cache_memory=2**22)
    one, two = LLMEngine(config), LLMEngine(config)
    prompt = list(range(100, 180))  # 5 full blocks, 4 of which a cache may serve
    expected = greedy(one, "a", prompt, 4)
    hashes = prompt_block_hashes(prompt, BLOCK)
    assert one.prefix_blocks.export([hashes[0], 12345, hashes[1]])[0] == prompt[:BLOCK]
    tokens, kv = one.prefix_blocks.export(hashes[1:])
    assert tokens == prompt[BLOCK:len(hashes) * BLOCK] and kv.shape[2] == len(tokens)
    # Blocks 1.. alone: not hit without block 0; then block 0 too.
    assert two.prefix_blocks.insert(prompt, 1, kv) == len(hashes) - 1
    assert two.prefix_blocks.held(prompt, len(hashes)) == 0
    assert two.prefix_blocks.insert(prompt, 0, one.prefix_blocks.export(hashes)[1]) == 1  # the rest are in
    assert two.prefix_blocks.held(prompt, len(hashes)) == len(hashes)
    out = greedy(two, "b", prompt, 4)
    assert out.num_cached_tokens == len(hashes) * BLOCK
    assert out.token_ids == expected.token_ids


def test_the_hint_names_the_healthy_node_holding_more_of_the_prefix_than_the_picked_one():
    async def run() -> None:
        info = NodeInfo("m", "float32", 2, 2, 16, BLOCK, "tcp", "127.0.0.1", 1)
        pool = PrefillPool(["a:1", "b:2", "c:3"], None, info)
        prompt = list(range(100))
        hashes = prompt_block_hashes(prompt, BLOCK)
        a, b, c = pool.clients
        for client, held in ((a, hashes[:1]), (b, hashes[:3]), (c, hashes[1:])):  # c lacks the first block
            client.mark_healthy()
            client.view.snapshot(0, BLOCK, {"device": list(held), "host": hashes})
        assert pool.pull_hint(a, prompt) == ("b:2", 3)
        assert pool.pull_hint(b, prompt) == ("", 0)  # none holds more than b
        b.mark_unhealthy("test")
        assert pool.pull_hint(a, prompt) == ("", 0)  # host blocks do not count: a pull takes device blocks
        await pool.close()

    asyncio.run(run())


def test_prefix_pull_is_on_by_default_and_must_be_a_bool():
    assert KVTransferConfig().extra("prefix_pull") is True
    assert KVTransferConfig(kv_connector_extra_config={"prefix_pull": False}).extra("prefix_pull") is False
    with pytest.raises(ValueError, match="prefix_pull must be true or false"):
        KVTransferConfig(kv_connector_extra_config={"prefix_pull": "no"})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_prefix_pulled_from_a_peer_gives_what_computing_it_gives(tmp_path, pair_1p1d, hf_model, hf_tokenizer):
    """Two prefill nodes: B, the shared pair's, and A, started here; this test is their decode node (its
    pipe endpoint registered with both, its Prefill calls sent straight to the node it names). B
    computes a prompt; the next prompt with that prefix goes to A with the hint that B holds it: A pulls
    the prefix's blocks from B (its /metrics and its log say so) and serves them from its cache; its
    first token is transformers', and the KV it sends is the KV that B, computing the same prompt,
    sends. Then a prompt hinted to be on a node that is gone (its address closed) is computed by A in
    full, still token-exact."""
    b = pair_1p1d[0]
    a = start_node("producer", tmp_path, extra_args=["--max-model-len", str(PAIR_MAX_MODEL_LEN)])
    gone = f"127.0.0.1:{free_port()}"  # nothing listens there
    prefix = PASSAGE * 2 + "Pulled once. "  # its blocks are new to B, which other tests share
    prompts = [hf_tokenizer(prefix + f"\nQuestion {q}: what is this about?").input_ids for q in (1, 2)]
    other = hf_tokenizer(CODE * 2 + "\nWhat does it do?").input_ids
    shared = next(i for i, (x, y) in enumerate(zip(*prompts)) if x != y) // BLOCK  # blocks both prompts have

    async def run() -> dict:
        consumer = LookupBufferConsumer("tcp", PipeConfig("127.0.0.1", 0))
        clients = {}
        for node in (a, b):
            client = clients[node.grpc_address] = PrefillClient(node.grpc_address, None)
            info = convert.node_info_from_proto(await client.stub.Info(pb.InfoRequest()))
            await client.connect(info, 30, consumer.address)

        async def prefill(node, rid: str, prompt: list[int], hint: tuple[str, int] = ("", 0)):
            client = clients[node.grpc_address]
            call = PrefillCall(rid, prompt, SamplingParams(temperature=0.0), consumer.address, 0, *hint)
            result = await client.prefill(call, idle_timeout=120)
            entry = await consumer.drop_select_async(rid, prompt, 60, (client.info.kv_ip, client.info.kv_port))
            return result, entry.kv_tensors[0]

        try:
            out = {}
            out["b1"] = await prefill(b, f"b1-{uuid.uuid4().hex}", prompts[0])
            out["a2"] = await prefill(a, "a2", prompts[1], (b.grpc_address, shared))
            out["b2"] = await prefill(b, f"b2-{uuid.uuid4().hex}", prompts[1])
            out["a3"] = await prefill(a, "a3", other, (gone, 4))
            return out
        finally:
            for client in clients.values():
                await client.close()
            consumer.close()

    try:
        out = asyncio.run(run())
        (a2, kv_a2), (b2, kv_b2), (a3, _) = out["a2"], out["b2"], out["a3"]
        assert a2.num_cached_tokens == shared * BLOCK  # all of it pulled: A had computed nothing
        assert a2.first_token == b2.first_token == hf_greedy(hf_model, prompts[1], 1)[0]
        assert torch.equal(kv_a2, kv_b2)
        assert a.labelled("disagg_prefix_pulls_total", "outcome") == {"pulled": 1.0, "failed": 1.0}
        assert a.metric("disagg_prefix_pulled_blocks_total") == shared
        assert re.search(rf"prefill a2: {len(prompts[1])} prompt tokens \({shared * BLOCK} cached, "
                         rf"{shared * BLOCK} of them pulled from {b.grpc_address}\)", a.log())
        assert a3.num_cached_tokens == 0 and a3.first_token == hf_greedy(hf_model, other, 1)[0]
        assert f"pull of 4 prefix blocks from {gone} failed" in a.log()
    finally:
        a.kill()
