"""The engine's CUDA path (Triton attention, device block table, CUDA graphs) against transformers.

Skipped without a GPU. The model is the embedded SmolLM2-135M when its package is installed;
otherwise (the GPU machines carry no 98 MB GGUF) a random-weight Llama of exactly its shape
with its tokenizer, from DISAGG_TEST_TOKENIZER_DIR.
"""

import dataclasses
import multiprocessing
import os
from pathlib import Path

import httpx
import pytest
import torch

from disagg import LLM, SamplingParams
from disagg.engine.loader import resolve_model
from disagg.engine.scheduler import ScheduledSeq
from disagg.engine.sequence import KVExport, Sequence

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_TOKENS = 16
PROMPT_LENGTHS = (1, 2, 15, 16, 17, 64, 100, 333, 700, 1000)


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory) -> Path:
    try:
        return resolve_model(None)
    except Exception:  # noqa: BLE001  any reason the embedded model is missing: use the tokenizer dir instead
        tokenizer_dir = os.environ.get("DISAGG_TEST_TOKENIZER_DIR")
        if not tokenizer_dir:
            pytest.skip("neither the embedded model nor DISAGG_TEST_TOKENIZER_DIR is available")
    from conftest import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("smol-shaped"), Path(tokenizer_dir), num_heads=9,
                            num_kv_heads=3, num_layers=30, hidden_size=576, intermediate_size=1536, head_dim=64,
                            tie_word_embeddings=True, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def hf_cuda(gpu_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gpu_model_dir, dtype=torch.float32).cuda().eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 49152, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(hf_cuda, prompts) -> list[list[int]]:
    out = []
    for ids in prompts:
        x = torch.tensor([ids], device="cuda")
        with torch.no_grad():
            y = hf_cuda.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, temperature=None, top_p=None, top_k=None)
        out.append(y[0, len(ids):].tolist())
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("enforce_eager,async_scheduling", [(False, False), (True, False), (False, True)],
                         ids=["graphs", "eager", "graphs-async"])
def test_float32_greedy_equals_transformers(gpu_model_dir, prompts, reference, enforce_eager, async_scheduling):
    # 512 tokens a step: every step with prompt tokens fits the prefill graphs (the 700- and 1000-token
    # prompts in chunks, some steps beside decodes), in buckets of every size the prompts give.
    llm = LLM(str(gpu_model_dir), device="cuda", dtype="float32", enforce_eager=enforce_eager,
              kv_cache_memory=2**30, max_num_seqs=16, async_scheduling=async_scheduling, max_num_batched_tokens=512)
    runner = llm.engine.runner
    assert (runner.graphs is None) == enforce_eager
    assert (runner.prefill_graphs is None) == enforce_eager
    sizes = []
    if runner.prefill_graphs is not None:
        run = runner.prefill_graphs.run
        runner.prefill_graphs.run = lambda inputs, after_layer=None: sizes.append(inputs.input_ids.shape[0]) or run(
            inputs, after_layer)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert (len(sizes) >= 4 and max(sizes) == 512) != enforce_eager


def test_prefill_graphs_give_the_eager_forwards_logits(gpu_model_dir, prompts):
    """One step of a 700-token prompt beside a decode, through the prefill graphs (the 768-token bucket:
    67 padding rows, the shared buffers filled with NaN first, which no real row may see) and eagerly
    (max_prefill_graph_tokens=0): the same logits up to the matrix products' order of summation, which
    cuBLAS may choose by the number of rows."""
    def step_logits(max_prefill_graph_tokens: int) -> torch.Tensor:
        llm = LLM(str(gpu_model_dir), device="cuda", dtype="float32", kv_cache_memory=2**30,
                  max_prefill_graph_tokens=max_prefill_graph_tokens)
        assert (llm.engine.runner.prefill_graphs is None) == (max_prefill_graph_tokens == 0)
        bm = llm.engine.block_manager
        decoding = Sequence("decoding", prompts[5], GREEDY)  # 64 tokens, then one to decode
        bm.allocate(decoding)
        llm.engine.runner.run([ScheduledSeq(decoding, 64)])
        decoding.num_computed_tokens = 64
        decoding.append_token(7)
        bm.append_slots(decoding, 1)
        prompt = Sequence("prompt", prompts[8], GREEDY)
        bm.allocate(prompt)
        graphs = llm.engine.runner.prefill_graphs
        if graphs is not None:
            graphs.queries.fill_(float("nan"))
            graphs.out.fill_(float("nan"))
        _, logits, _ = llm.engine.runner.run([ScheduledSeq(decoding, 1), ScheduledSeq(prompt, 700)])
        return logits.cpu()

    graphs, eager = step_logits(1024), step_logits(0)
    assert graphs.shape == (2, eager.shape[1]) and graphs.isfinite().all()
    torch.testing.assert_close(graphs, eager, rtol=1e-4, atol=1e-4)


def test_bfloat16_logits_near_float32_reference(gpu_model_dir, hf_cuda, prompts):
    llm = LLM(str(gpu_model_dir), device="cuda", dtype="bfloat16", kv_cache_memory=2**30)
    ids = prompts[-1]  # 1000 tokens
    seq = Sequence("logits", ids, GREEDY)
    llm.engine.block_manager.allocate(seq)
    ours = torch.softmax(llm.engine.runner.all_logits([ScheduledSeq(seq, len(ids))]), -1)
    llm.engine.block_manager.free(seq)
    with torch.no_grad():
        theirs = torch.softmax(hf_cuda(torch.tensor([ids], device="cuda")).logits[0].float(), -1)
    assert (ours - theirs).abs().max().item() < 2e-2


def test_prefix_hits_chunks_and_preemption_equal_the_plain_run(gpu_model_dir, prompts, reference):
    # A block is 16 tokens' KV of 30 layers x 3 heads x 64 dims in float32. The eight prompts up
    # to 333 tokens take 38 of 40 blocks; as they decode, eight of them need a new block each,
    # so sequences are preempted. 128 tokens a step splits the longer prompts into chunks.
    block = 30 * 2 * 16 * 3 * 64 * 4
    llm = LLM(str(gpu_model_dir), device="cuda", dtype="float32", kv_cache_memory=40 * block,
              max_num_batched_tokens=128)
    outs = llm.generate(prompts[:-2], GREEDY)
    assert [o.token_ids for o in outs] == reference[:-2]
    assert llm.engine.scheduler.num_preemptions > 0
    again = llm.generate(prompts[5:-2], GREEDY)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert [o.token_ids for o in again] == reference[5:-2]
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("kv_buffer_device", ["cpu", "cuda"])
def test_layerwise_kv_over_tcp_lands_in_the_decode_engines_blocks(gpu_model_dir, prompts, reference,
                                                                   kv_buffer_device):
    """The prefill node's path on a GPU: each layer's KV is handed to the producer during the forward
    (copied to pinned memory on a stream of its own, or kept on the GPU and sent from the sender's
    stream), crosses a tcp pipe into the rows of a second engine's blocks, and that engine decodes
    transformers' tokens."""
    from disagg.lookup_buffer import LookupBufferConsumer, LookupBufferProducer
    from disagg.pipes import PipeConfig, RowScatter
    from disagg.prefill_node.layer_sender import LayerSender, RankEntry

    kwargs = dict(device="cuda", dtype="float32", kv_cache_memory=2**30)
    prefill, decode = LLM(str(gpu_model_dir), **kwargs).engine, LLM(str(gpu_model_dir), **kwargs).engine
    consumer = LookupBufferConsumer("tcp", PipeConfig(kv_port=0))
    producer = LookupBufferProducer("tcp", PipeConfig(kv_port=0), 1 << 30, 30.0, 5.0)
    copy_stream = torch.cuda.Stream() if kv_buffer_device == "cpu" else None
    try:
        chosen = [6, 8, 9]  # 64, 700 and 1000 tokens
        slots = {}
        for i in chosen:
            ids, request_id = prompts[i], f"r{i}"
            decode.add_request(request_id, ids, GREEDY, remote_prefill=True)
            slots[request_id] = slot = decode.remote_slot(request_id)
            assert slot.cached_tokens == 0
            consumer.expect(request_id, [RowScatter(slot.cache, slot.rows)])
            nbytes = prefill.kv_cache.kv[:, :, :len(ids)].nbytes
            producer.open(request_id, ids, [(layer, layer + 1) for layer in range(30)], len(ids), nbytes,
                          consumer.address)
            sender = LayerSender(producer, [RankEntry(request_id, consumer.address, None)], 30, copy_stream)
            prefill.add_request(request_id, ids, SamplingParams(temperature=0.0, max_tokens=1),
                                kv_export=KVExport(0, [(layer, layer + 1) for layer in range(30)], sender.put))
        first = {}
        while prefill.has_unfinished_requests():
            first |= {out.request_id: out.token_ids[0] for out in prefill.step()}
        for i in chosen:
            entry = consumer.drop_select(f"r{i}", prompts[i], timeout=30)
            assert entry.in_place
            slots[f"r{i}"].first.output(first[f"r{i}"], None)
            decode.finish_remote_prefill(f"r{i}", None, slots[f"r{i}"].first)
        done = {}
        while decode.has_unfinished_requests():
            done |= {out.request_id: out.token_ids for out in decode.step() if out.finished}
        assert [done[f"r{i}"] for i in chosen] == [reference[i] for i in chosen]
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_remote_requests_under_max_num_seqs_on_cuda(gpu_model_dir, prompts, reference, async_scheduling):
    """18 remote requests on a decode engine with max_num_seqs=4, each prompt's KV (computed by a
    prefill engine) handed over as it is ready: at most 4 ever hold blocks, so the device block
    table's 2 x 4 rows suffice (remote requests once bypassed the cap and ran it out of rows,
    failing every request of that step), and every answer is transformers'. Under async scheduling
    a request whose KV has landed joins a decode step launched ahead of the one in flight."""
    from kv_export import KVCollector

    kwargs = dict(device="cuda", dtype="float32", kv_cache_memory=2**30)
    prefill = LLM(str(gpu_model_dir), **kwargs).engine
    decode = LLM(str(gpu_model_dir), max_num_seqs=4, async_scheduling=async_scheduling, **kwargs).engine
    launch, joined_ahead = decode._launch, []

    def recorded(batch, prev):  # a sequence on its first token (the remote one) in a step launched ahead
        joined_ahead.append(prev is not None and any(item.seq.num_output_tokens == 1 for item in batch))
        return launch(batch, prev)

    decode._launch = recorded
    chosen = [i for i in range(len(prompts)) if len(prompts[i]) > 1] * 2  # 18 requests, some prompts twice
    lengths = [4 + k % (MAX_TOKENS - 3) for k in range(len(chosen))]
    firsts, exports = {}, {}
    for k, i in enumerate(chosen):
        request_id = f"r{k}"
        # Lengths apart, so that requests join while others decode.
        decode.add_request(request_id, prompts[i], dataclasses.replace(GREEDY, max_tokens=lengths[k]),
                           remote_prefill=True)
        slot = decode.remote_slot(request_id)
        firsts[request_id] = slot.first
        exports[request_id] = KVCollector(30, start=slot.cached_tokens)
        prefill.add_request(request_id, prompts[i], SamplingParams(temperature=0.0, max_tokens=1),
                            kv_export=exports[request_id].export)
    done, most = {}, 0
    while prefill.has_unfinished_requests() or decode.has_unfinished_requests():
        for out in prefill.step():
            first = firsts[out.request_id]
            first.output(out.token_ids[0], None)
            decode.finish_remote_prefill(out.request_id, exports[out.request_id].kv(), first,
                                         kv_start=exports[out.request_id].export.start)
        done |= {out.request_id: out.token_ids for out in decode.step() if out.finished}
        holding = sum(1 for r in decode.requests.values() if r.seq.block_table)
        most = max(most, holding)
        assert len(decode.scheduler.running) <= 4 and holding <= 4
    assert most == 4
    assert [done[f"r{k}"] for k in range(len(chosen))] == [reference[i][:n] for i, n in zip(chosen, lengths)]
    assert any(joined_ahead) == async_scheduling


def tp2_generate(model_dir: str, prompts: list[list[int]], options: dict, queue) -> None:
    """A TP=2 engine's greedy tokens for the prompts, then for the last four again (prefix hits), in a process of
    its own: only the first tensor-parallel group of a process gets symmetric memory (parallel.py)."""
    llm = LLM(model_dir, device="cuda", dtype="float32", kv_cache_memory=2**30, max_num_seqs=16,
              tensor_parallel_size=2, **options)
    try:
        outs = llm.generate(prompts, GREEDY)
        again = llm.generate(prompts[6:], GREEDY)
        queue.put((llm.engine.runner.graphs is not None, llm.engine.runner.model.tp.symmetric is not None,
                   [o.token_ids for o in outs], [o.num_cached_tokens for o in again], [o.token_ids for o in again]))
    finally:
        llm.engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs two GPUs")
@pytest.mark.parametrize("enforce_eager,async_scheduling,backend,step_tokens",
                         [(False, False, None, 256), (True, False, None, 256), (False, True, None, 256),
                          (True, False, "sdpa", 256), (False, False, None, 1024)],
                         ids=["graphs", "eager", "graphs-async", "sdpa", "graphs-1024-token-steps"])
def test_tensor_parallel_2_greedy_equals_transformers(gpu_model_dir, prompts, reference, enforce_eager,
                                                      async_scheduling, backend, step_tokens):
    """TP=2 on cuda:0 and cuda:1, each case in a fresh process so that it has symmetric memory: a decode step's
    sums fused with their norms (captured in the decode graphs unless eager; under the sdpa backend, without
    the Triton kernels, summed one-shot), with chunked prefill and a prefix hit, give transformers' float32
    tokens. Steps of up to 1,024 tokens put the prefill graphs' larger buckets on the other paths: a product
    over 1 MiB summed two-shot in place, the embedding's all-reduce through NCCL."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    options = dict(enforce_eager=enforce_eager, async_scheduling=async_scheduling, attention_backend=backend,
                   max_num_batched_tokens=step_tokens)
    child = ctx.Process(target=tp2_generate, args=(str(gpu_model_dir), prompts, options, queue))
    child.start()
    try:
        graphs, symmetric, outs, cached, again = queue.get(timeout=240)
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert graphs != enforce_eager and symmetric
    assert outs == reference
    assert all(n > 0 for n in cached) and again == reference[6:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs two GPUs")
def test_handoff_between_nodes_of_different_tp_sizes_on_two_gpus(tmp_path, gpu_model_dir, prompts, reference):
    """Prefill TP=2 (GPUs 0 and 1) -> decode TP=1 (GPU 1), then prefill TP=1 (GPU 0) -> decode TP=2,
    KV from GPU memory: each prefill rank sends its own heads (no gather), each decode rank receives
    its own heads on its own endpoint, and the answers are transformers' float32 tokens. On two GPUs
    some prefill rank shares its GPU with some decode rank: NCCL (torch_dist) refuses such a pair, with
    a reason that names the way out, and nixl carries it."""
    from servers import start_node, wait_all_ready

    chosen = [2, 6, 8, 9]  # 15, 64, 700 and 1000 tokens
    body = {"prompt": [prompts[i] for i in chosen], "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    kv_extra = {"prefill_policy": "fail", "remote_prefill": "always"}
    args = ["--device", "cuda", "--dtype", "float32", "--kv-cache-memory", str(2**30), "--max-model-len", "2048"]
    tp2 = ["--tensor-parallel-size", "2"]
    nodes = []

    def pair(connector: str, prefill_tp: int, decode_tp: int):
        gpus = {1: "0", 2: "0,1"}
        common = dict(model=str(gpu_model_dir), connector=connector, kv_config={"kv_buffer_device": "cuda"},
                      wait=False)
        prefill = start_node("producer", tmp_path, extra_args=args + (tp2 if prefill_tp == 2 else []),
                             env={"CUDA_VISIBLE_DEVICES": gpus[prefill_tp]}, **common)
        decode = start_node("consumer", tmp_path, prefill_nodes=[prefill.grpc_address], kv_extra=kv_extra,
                            extra_args=args + (tp2 if decode_tp == 2 else []),
                            env={"CUDA_VISIBLE_DEVICES": "1" if decode_tp == 1 else "0,1"}, **common)
        nodes.extend([prefill, decode])
        wait_all_ready(prefill, decode)
        return prefill, decode

    def complete(decode) -> httpx.Response:
        body["model"] = httpx.get(f"{decode.url}/v1/models", timeout=10).json()["data"][0]["id"]
        return httpx.post(f"{decode.url}/v1/completions", json=body, timeout=120)

    def answers(decode) -> list[list[int]]:
        response = complete(decode)
        assert response.status_code == 200, response.text
        return [c["token_ids"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]

    try:
        prefill, decode = pair("torch_dist", 2, 1)
        response = complete(decode)
        assert response.status_code == 503 and "same GPU" in response.text, response.text
        assert "nixl or tcp" in response.text
        for node in nodes:
            node.kill()

        prefill, decode = pair("nixl", 2, 1)
        assert answers(decode) == [reference[i] for i in chosen]
        assert decode.labelled("disagg_prefill_route_total", "route").get("remote") == len(chosen)
        sent = prefill.labelled("disagg_kv_rank_sent_bytes_total", "rank")
        assert sent["1"] == 2 * sent["0"] > 0, sent  # rank 0 holds 1 of the 3 KV heads, rank 1 the other 2
        received = decode.labelled("disagg_kv_transfer_bytes_total", "direction")["received"]
        assert received >= sent["0"] + sent["1"], (sent, received)
        prefill.kill()
        decode.kill()

        prefill, decode = pair("nixl", 1, 2)
        assert answers(decode) == [reference[i] for i in chosen]
        by_rank = decode.labelled("disagg_kv_rank_received_bytes_total", "rank")
        assert 0.33 < by_rank["0"] / (by_rank["0"] + by_rank["1"]) < 0.34, by_rank
    finally:
        for node in nodes:
            node.kill()
