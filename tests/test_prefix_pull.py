"""Prefix pull between prefill nodes (issue 26): a prefill node told by the decode node that another
prefill node holds a prompt's prefix pulls those blocks (FetchBlocks, KV over the pipe) into its
prefix cache instead of computing them, and computes them when the pull fails."""

import asyncio
import re
import uuid

import httpx
import pytest
import torch
from prompts import CODE, PASSAGE, hf_greedy
from servers import PAIR_MAX_MODEL_LEN, free_port, metric_sum, start_node

from disagg.config import KVTransferConfig
from disagg.control_plane import NodeInfo, PrefillCall
from disagg.decode_node.prefill_client import PrefillClient, PrefillPool
from disagg.engine.block_hash import LazyBlockHashes, prompt_block_hashes
from disagg.engine.block_manager import BlockManager
from disagg.engine.kv_cache import KVCache
from disagg.engine.prefix_blocks import PrefixBlocks
from disagg.engine.sampling_params import SamplingParams
from disagg.engine.sequence import Sequence
from disagg.lookup_buffer import LookupBufferConsumer
from disagg.pipes.base import PipeConfig
from disagg.proto import convert
from disagg.proto import disagg_pb2 as pb

BLOCK = 16


def cache_with_blocks(num_blocks: int = 12) -> tuple[KVCache, BlockManager]:
    kv_cache = KVCache(2, num_blocks, BLOCK, 2, 4, torch.float32, torch.device("cpu"))
    return kv_cache, BlockManager(num_blocks, BLOCK)


def test_blocks_exported_by_hash_are_inserted_under_the_receivers_own_hashes_and_hit_there():
    """One engine's cache holds a prompt's blocks (as its prefill leaves them); their KV, exported by
    hash, goes into another's free blocks under the hashes of the receiver's own tokens, and a sequence
    of that prompt then hits them there, their KV intact. An export stops at the first hash not held; an
    insert keeps blocks cached already and needs the blocks before them to be hit."""
    prompt = list(range(100, 180))  # 5 full blocks, 4 of which a cache may serve
    hashes = prompt_block_hashes(prompt, BLOCK)
    kv_one, bm_one = cache_with_blocks()
    kv_one.kv.copy_(torch.randn_like(kv_one.kv))
    seq = Sequence("a", prompt, SamplingParams())
    bm_one.allocate(seq)
    seq.num_computed_tokens = len(prompt)
    bm_one.commit(seq)
    bm_one.free(seq)  # cached, free
    one = PrefixBlocks(kv_one, bm_one, None)
    assert one.held(prompt, len(hashes)) == len(hashes)
    assert one.export([hashes[0], 12345, hashes[1]])[0] == prompt[:BLOCK]
    assert one.export([12345]) == ([], None)
    tokens, kv = one.export(hashes[1:])
    assert tokens == prompt[BLOCK:len(hashes) * BLOCK] and kv.shape == (2, 2, len(tokens), 2, 4)

    kv_two, bm_two = cache_with_blocks()
    two = PrefixBlocks(kv_two, bm_two, None)
    assert two.insert(prompt, 1, kv) == len(hashes) - 1
    assert two.held(prompt, len(hashes)) == 0  # not hit without block 0
    assert two.insert(prompt, 0, one.export(hashes)[1]) == 1  # the others are in already
    assert two.held(prompt, len(hashes)) == len(hashes)
    assert bm_two.num_free_blocks == bm_two.num_blocks  # cached, held by nobody
    seq = Sequence("b", prompt, SamplingParams())
    bm_two.allocate(seq)
    assert seq.num_cached_tokens == len(hashes) * BLOCK
    rows = kv_two.rows(seq.block_table, 0, seq.num_cached_tokens)
    assert torch.equal(kv_two.kv[:, :, rows], one.export(hashes)[1])
    with pytest.raises(ValueError, match="does not fit whole blocks"):
        two.insert(prompt, 0, kv[:, :, :BLOCK - 1])


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
        computed: dict[int, LazyBlockHashes] = {}
        assert pool.pull_hint(a, prompt, computed) == ("b:2", 3)
        # Kept for the caller, as pick() keeps them: those read so far (b's three, and the fourth it lacks).
        assert list(computed) == [BLOCK] and computed[BLOCK].hashes == hashes[:4]
        assert pool.pull_hint(b, prompt, computed) == ("", 0)  # none holds more than b
        b.mark_unhealthy("test")
        assert pool.pull_hint(a, prompt, {}) == ("", 0)  # host blocks do not count: a pull takes device blocks
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
            return result, entry

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
        (a2, a2_entry), (_, b2_entry), (a3, a3_entry) = out["a2"], out["b2"], out["a3"]
        assert a2.num_cached_tokens == shared * BLOCK  # all of it pulled: A had computed nothing
        assert a2_entry.first_token.token_id == b2_entry.first_token.token_id == hf_greedy(hf_model, prompts[1], 1)[0]
        assert torch.equal(a2_entry.kv_tensors[0], b2_entry.kv_tensors[0])
        assert a.labelled("disagg_prefix_pulls_total", "outcome") == {"pulled": 1.0, "failed": 1.0}
        assert a.metric("disagg_prefix_pulled_blocks_total") == shared
        assert re.search(rf"prefill a2: {len(prompts[1])} prompt tokens \({shared * BLOCK} cached, "
                         rf"{shared * BLOCK} of them pulled from {b.grpc_address}\)", a.log())
        assert a3.num_cached_tokens == 0 and a3_entry.first_token.token_id == hf_greedy(hf_model, other, 1)[0]
        assert f"pull of 4 prefix blocks from {gone} failed" in a.log()
    finally:
        a.kill()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_decode_node_waits_for_a_prefix_already_arriving_instead_of_fetching_it_again(pair_1p1d, hf_model,
                                                                                         hf_tokenizer):
    """Issue 26, on the shared pair (every prompt crosses): a second request for a prefix whose KV is on
    its way to the decode node for a first one (its blocks reserved, not loaded) waits for it, then
    asks the prefill node for its own suffix only: its KV comes for those tokens alone, its answer
    counts the prefix as cached, and both answers are transformers'."""
    decode = pair_1p1d[1]
    prefix = hf_tokenizer("Waited for, not fetched twice. " + PASSAGE * 7).input_ids[:25 * BLOCK]
    assert len(prefix) == 25 * BLOCK
    prompts = [prefix + hf_tokenizer(f" Question {q}: what is this about?").input_ids for q in (1, 2)]
    config = hf_model.config
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * \
        (config.hidden_size // config.num_attention_heads) * 4  # float32 on the CPU
    before = decode.samples()

    async def complete(client: httpx.AsyncClient, prompt: list[int]) -> dict:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
        response = await client.post(f"{decode.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    async def run() -> list[dict]:
        async with httpx.AsyncClient() as client:
            first = asyncio.create_task(complete(client, prompts[0]))
            # The first is added and waits for its KV (the prefill node computes it meanwhile): send the second.
            while metric_sum(decode.samples(), "disagg_num_requests_waiting") < 1:
                assert not first.done(), "the first request ended before it was seen waiting for its KV"
                await asyncio.sleep(0.005)
            return list(await asyncio.gather(first, complete(client, prompts[1])))

    answers = asyncio.run(run())
    after = decode.samples()

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    cached = [answer["usage"]["prompt_tokens_details"]["cached_tokens"] for answer in answers]
    assert cached == [0, len(prefix)]
    assert delta("disagg_arriving_prefix_waits_total", outcome="hit") == 1
    assert delta("disagg_arriving_prefix_tokens_total") == len(prefix)
    # The prefix's KV crossed once: the whole first prompt's, then the second's suffix.
    assert delta("disagg_kv_transfer_bytes_total", direction="received") == \
        (len(prompts[0]) + len(prompts[1]) - len(prefix)) * kv_per_token
    for prompt, answer in zip(prompts, answers):
        assert answer["choices"][0]["text"] == hf_tokenizer.decode(hf_greedy(hf_model, prompt, 8),
                                                                   skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_requests_for_one_prefix_sent_together_fetch_it_once(pair_1p1d, hf_model, hf_tokenizer):
    """Two requests for a prefix that nothing here holds, sent at once: the first calls first (its
    blocks reserved only once its call is there), the second waits until they are and then for its KV,
    so the prefix crosses once, and both answers are transformers'."""
    decode = pair_1p1d[1]
    prefix = hf_tokenizer("Sent together, fetched once. " + PASSAGE * 7).input_ids[:25 * BLOCK]
    prompts = [prefix + hf_tokenizer(f" Part {q}: say what it is.").input_ids for q in (1, 2)]
    config = hf_model.config
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * \
        (config.hidden_size // config.num_attention_heads) * 4  # float32 on the CPU
    before = decode.samples()

    async def run() -> list[dict]:
        async with httpx.AsyncClient() as client:
            async def complete(prompt: list[int]) -> dict:
                body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
                response = await client.post(f"{decode.url}/v1/completions", json=body, timeout=120)
                assert response.status_code == 200, response.text
                return response.json()

            return list(await asyncio.gather(*(complete(prompt) for prompt in prompts)))

    answers = asyncio.run(run())
    after = decode.samples()
    received = metric_sum(after, "disagg_kv_transfer_bytes_total", direction="received") - \
        metric_sum(before, "disagg_kv_transfer_bytes_total", direction="received")
    assert received == (len(prompts[0]) + len(prompts[1]) - len(prefix)) * kv_per_token
    assert sorted(answer["usage"]["prompt_tokens_details"]["cached_tokens"] for answer in answers) == [0, len(prefix)]
    for prompt, answer in zip(prompts, answers):
        assert answer["choices"][0]["text"] == hf_tokenizer.decode(hf_greedy(hf_model, prompt, 8),
                                                                   skip_special_tokens=True)
