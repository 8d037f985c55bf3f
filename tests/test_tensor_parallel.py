"""Tensor parallelism: the shard plan and a worker's mirror of a step (no model), TP=2 against TP=1 on
the embedded model (worker processes, gloo) and on a tiny one with a replicated KV head, the KV handoff
between nodes of different TP sizes, and a rank's death taking its node down."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from kv_export import KVCollector
from prompts import CODE, PASSAGE, hf_greedy
from servers import start_node, wait_all_ready, wait_for

from disagg.engine.builder import build_rank_runner
from disagg.engine.config import EngineConfig
from disagg.engine.kv_cache import KVCache
from disagg.engine.llm import LLM
from disagg.engine.loader import load_config
from disagg.engine.models.llama import LlamaConfig, LlamaForCausalLM, RMSNorm, shard_plan
from disagg.engine.parallel import ONE_SHOT_MAX_BYTES, Symmetric, TPGroup, symmetric_bytes
from disagg.engine.sampling_params import SamplingParams
from disagg.engine.scheduler import ScheduledSeq
from disagg.engine.sequence import Sequence
from disagg.engine.tp_workers import StepSeq, mirror

CPU = torch.device("cpu")


def config(heads: int, kv_heads: int, vocab: int = 49152, intermediate: int = 1536) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=64 * heads, intermediate_size=intermediate, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64)


def plans(c: LlamaConfig, size: int) -> list:
    return [shard_plan(c, TPGroup(rank, size, CPU)) for rank in range(size)]


def test_shard_plan_covers_every_head_column_and_token_once():
    # The embedded model's shape: 3 KV heads over 2 ranks go 1 + 2, each with its 3 query heads per KV head.
    first, second = plans(config(9, 3), 2)
    assert (first.kv_heads, first.q_heads, second.kv_heads, second.q_heads) == ((0, 1), (0, 3), (1, 3), (3, 9))
    assert (first.intermediate, second.intermediate) == ((0, 768), (768, 1536))
    # An odd vocabulary: equal rows per rank (a gather's parts), the last rank's padded.
    a, b = plans(config(8, 8, vocab=11), 2)
    assert (a.vocab, b.vocab, a.vocab_rows) == ((0, 6), (6, 11), 6)
    uneven = plans(config(8, 8), 3)
    assert [p.kv_heads for p in uneven] == [(0, 2), (2, 5), (5, 8)] and [p.q_heads for p in uneven] == \
        [(0, 2), (2, 5), (5, 8)]


def test_shard_plan_replicates_kv_heads_fewer_than_ranks():
    # One KV head, 4 ranks: each holds it, and a quarter of the query heads.
    assert [(p.kv_heads, p.q_heads) for p in plans(config(8, 1), 4)] == \
        [((0, 1), (0, 2)), ((0, 1), (2, 4)), ((0, 1), (4, 6)), ((0, 1), (6, 8))]
    # 2 KV heads of 4 query heads each, 4 ranks: ranks 0-1 attend KV head 0, ranks 2-3 KV head 1.
    assert [(p.kv_heads, p.q_heads) for p in plans(config(8, 2), 4)] == \
        [((0, 1), (0, 2)), ((0, 1), (2, 4)), ((1, 2), (4, 6)), ((1, 2), (6, 8))]
    with pytest.raises(ValueError, match="tensor_parallel_size 6 does not split this model's 9 attention heads"):
        shard_plan(config(9, 3), TPGroup(0, 6, CPU))


class RecordingGroup:
    """A process group's all-reduce as TPGroup calls it, recorded."""

    def __init__(self):
        self.calls = []

    def allreduce(self, tensors):
        self.calls.append(tensors[0].dtype)
        return type("Done", (), {"wait": lambda self: None})()


def test_all_reduce_takes_one_shot_only_for_the_dtypes_its_kernel_has(monkeypatch):
    """bfloat16 and float32 parts of up to ONE_SHOT_MAX_BYTES go one-shot; float16 (which PyTorch's
    kernel lacks) and larger parts go to the process group."""
    one_shot = []
    monkeypatch.setattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out",
                        lambda buffer, x, op, name, out: one_shot.append(x.dtype), raising=False)
    pg = RecordingGroup()
    tp = TPGroup(0, 2, torch.device("cpu"), pg, Symmetric(torch.zeros(3 << 20, dtype=torch.uint8), "g", None, 1 << 20))
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        tp.all_reduce(torch.ones(4096, dtype=dtype))
    tp.all_reduce(torch.ones(1 << 20, dtype=torch.bfloat16))  # 2 MiB
    assert one_shot == [torch.bfloat16, torch.float32]
    assert pg.calls == [torch.float16, torch.bfloat16]


class FusedOps:
    """fused_ops.sum_rms_norm as sum_add_norm calls it, recorded (the kernel itself: test_triton_kernels)."""

    def __init__(self):
        self.calls, self.norms = [], 0

    def sum_rms_norm(self, part_ptrs, pad_ptrs, pad_base, rank, residual, weight, eps):
        self.calls.append((part_ptrs, pad_ptrs, pad_base, rank, residual.shape))
        return torch.zeros_like(residual)

    def rms_norm(self, x, weight, eps, residual):  # the norm after a sum of its own
        self.norms += 1
        return torch.zeros_like(x)


def test_row_parallel_products_are_summed_where_they_are_written(monkeypatch):
    """A prefill's product larger than a one-shot part is written into the symmetric buffer's start and summed
    there in place (two-shot: here a stand-in that adds a second rank's equal part) before the norm; a decode
    step's into the two slots by turns, each summed with its norm by one kernel (without the Triton kernels,
    one-shot from there); one too large for the buffer, with a bias, or float16 is the product's own tensor,
    summed through the process group."""
    two_shot, one_shot = [], []

    def fake_two_shot(x, op, name):  # every rank computed the same product: the sum is twice it
        two_shot.append((x.shape, name))
        x.mul_(2)
        return x

    monkeypatch.setattr(torch.ops.symm_mem, "two_shot_all_reduce_", fake_two_shot, raising=False)
    monkeypatch.setattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out",
                        lambda buffer, x, op, name, out: one_shot.append(x.shape), raising=False)
    pg = RecordingGroup()
    region = symmetric_bytes(2048, 256, torch.float32)
    assert region == 2048 * 256 * 4 > ONE_SHOT_MAX_BYTES
    assert symmetric_bytes(2048, 256, torch.float16) == 0  # PyTorch's kernels have no float16: no buffer
    buffer = torch.zeros(region + 2 * ONE_SHOT_MAX_BYTES, dtype=torch.uint8)
    slots = (torch.tensor([1, 2]), torch.tensor([3, 4]))  # every rank's address of each slot
    tp = TPGroup(0, 2, torch.device("cpu"), pg, Symmetric(buffer, "g", None, region, slots, torch.tensor([5, 6]),
                                                          pad_base=256, max_rows=128))
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 256, bias=False).requires_grad_(False)  # as loaded
    norm = RMSNorm(256, 1e-5)
    x, residual = torch.randn(2048, 32), torch.randn(2048, 256)

    part = tp.row_parallel(x, linear)
    assert part.data_ptr() == buffer.data_ptr()
    out, summed = tp.sum_add_norm(part, residual.clone(), norm)
    assert two_shot == [((2048, 256), "g")]
    expected = norm(2 * linear(x), residual.clone())
    torch.testing.assert_close(out, expected[0])
    torch.testing.assert_close(summed, expected[1])

    norm.fused_ops = FusedOps()  # set on the GPU path, where the slots are
    for turn in range(3):  # 16 KiB each: a slot each, by turns, summed with the norm in one kernel
        part = tp.row_parallel(x[:16], linear)
        assert part.data_ptr() == buffer.data_ptr() + region + (turn % 2) * ONE_SHOT_MAX_BYTES
        torch.testing.assert_close(part, linear(x[:16]))
        tp.sum_add_norm(part, residual[:16], norm)
    assert [(call[0] is slots[turn % 2], call[1] is tp.symmetric.pad_ptrs, call[2:])
            for turn, call in enumerate(norm.fused_ops.calls)] == [(True, True, (256, 0, (16, 256)))] * 3
    assert one_shot == [] and len(two_shot) == 1 and norm.fused_ops.norms == 0
    stream = residual[:16]
    assert tp.sum_add_norm(tp.row_parallel(x[:16], linear), stream, norm)[1] is stream  # summed into in place

    unfused = RMSNorm(256, 1e-5)  # the sdpa backend on CUDA: no Triton kernels, the slot's part summed one-shot
    tp.sum_add_norm(tp.row_parallel(x[:16], linear), residual[:16].clone(), unfused)
    assert one_shot == [(16 * 256,)] and len(norm.fused_ops.calls) == 4
    one_shot.clear()

    tp.sum_add_norm(tp.row_parallel(x[:129], linear), residual[:129], norm)  # more rows than the barrier has
    assert one_shot == [(129 * 256,)] and norm.fused_ops.norms == 1
    tp.symmetric.slot_ptrs = ()  # slots not set up: one-shot, then the norm
    tp.sum_add_norm(tp.row_parallel(x[:16], linear), residual[:16], norm)
    assert one_shot[-1] == (16 * 256,) and len(norm.fused_ops.calls) == 4 and norm.fused_ops.norms == 2
    norm.fused_ops = None

    tp.sum_add_norm(tp.row_parallel(torch.randn(2049, 32), linear), torch.randn(2049, 256), norm)  # beyond it
    tp.sum_add_norm(tp.row_parallel(x, torch.nn.Linear(32, 256).requires_grad_(False)), residual, norm)  # a bias
    tp.sum_add_norm(tp.row_parallel(x.half(), linear.half()), residual.half(), norm.half())
    assert pg.calls == [torch.float32, torch.float32, torch.float16] and len(two_shot) == 1



class PassThroughAttention:
    """An attention backend that returns the queries: what a forward's sums do does not depend on it."""

    def forward(self, layer_idx, q, k, v, meta):
        return q


def test_a_forward_ends_at_the_slot_it_began(monkeypatch):
    """A forward's fused sums take the two slots by turns and leave TPGroup.slot as they found it, so that a
    CUDA graph captured of one forward replays with the slots an eager forward would take."""
    monkeypatch.setattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", lambda *args: None, raising=False)
    c = config(heads=2, kv_heads=2, vocab=64, intermediate=64)
    region = symmetric_bytes(16, c.hidden_size, torch.float32)
    slots = (torch.tensor([1, 2]), torch.tensor([3, 4]))
    tp = TPGroup(0, 2, torch.device("cpu"), RecordingGroup(),
                 Symmetric(torch.zeros(region + 2 * ONE_SHOT_MAX_BYTES, dtype=torch.uint8), "g", None, region, slots,
                           torch.tensor([5, 6]), pad_base=256, max_rows=128))
    model = LlamaForCausalLM(c, max_positions=16, tp=tp).requires_grad_(False)
    ops = FusedOps()
    for norm in [model.model.norm, *(n for layer in model.model.layers
                                      for n in (layer.input_layernorm, layer.post_attention_layernorm))]:
        norm.fused_ops = ops
    before = tp.slot
    for _ in range(2):
        model(torch.tensor([3, 1, 4]), torch.arange(3), PassThroughAttention(), None)
        assert tp.slot == before
    # two parts a layer, each summed by the next norm (the last by the model's final one), slots by turns
    assert len(ops.calls) == 2 * 2 * c.num_hidden_layers
    assert all(call[0] is slots[i % 2] for i, call in enumerate(ops.calls))

def test_a_worker_mirrors_the_driver_s_sequences_step_by_step():
    # The driver's sequence through a prompt chunk, a decode, and a preemption that rebuilds its blocks.
    seq = Sequence("r", list(range(10, 30)), SamplingParams(max_tokens=4))
    seq.block_table = [7, 3]
    step = StepSeq.of(ScheduledSeq(seq, 16))
    mine = mirror(step, None)
    assert mine.token_ids[:17] == list(range(10, 27)) and mine.num_tokens == 20 and mine.block_table == [7, 3]
    table = mine.block_table
    seq.num_computed_tokens, seq.token_ids, seq.block_table = 20, seq.token_ids + [99], [7, 3, 5]
    mine = mirror(StepSeq.of(ScheduledSeq(seq, 1)), mine)
    assert mine.token_ids[20] == 99 and mine.num_computed_tokens == 20 and mine.num_tokens == 21
    assert mine.block_table is table and table == [7, 3, 5]  # grown in place: a device table sends only block 5
    seq.num_computed_tokens, seq.block_table = 0, [1, 2]  # preempted: computed again in new blocks
    mine = mirror(StepSeq.of(ScheduledSeq(seq, 21)), mine)
    assert mine.block_table == [1, 2] and mine.block_table is not table and mine.token_ids == seq.token_ids


# Ten prompts of mixed lengths: four share a preamble of several blocks (prefix hits), five are longer
# than a step's 64 tokens (chunked prefill), and together they need more blocks than the cache has
# (preemption).
PREAMBLE = "You are the assistant of the tensor-parallel test. " + PASSAGE
PROMPTS = [
    "Hello",
    "The capital of France is",
    PREAMBLE + "What is a compiler?",
    PREAMBLE + "Who shared computers?",
    PREAMBLE + "Name one abstraction.",
    PREAMBLE + "Why networks?",
    CODE + "\n# Explain the function above:\n",
    "1, 2, 3, 4, 5,",
    "Q: What is 12 times 12?\nA:",
    "Write a haiku about the sea.",
]
NUM_BLOCKS = 24
MAX_TOKENS = 12


def generate(model_dir: Path, tensor_parallel_size: int) -> tuple[list, int, int]:
    """Outputs of the ten prompts generated together twice (the second time the prefix cache holds
    them), the preemptions, and the blocks."""
    mc = load_config(model_dir)
    # The same number of blocks at either size: a rank holds its heads' share of each (2 of 3 at most).
    heads = shard_plan(mc, TPGroup(tensor_parallel_size - 1, tensor_parallel_size, CPU)).num_kv_heads
    block_bytes = KVCache.bytes_per_block(mc.num_hidden_layers, 16, heads, mc.head_dim, torch.float32)
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory=NUM_BLOCKS * block_bytes, max_num_batched_tokens=64,
              tensor_parallel_size=tensor_parallel_size)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
        scored = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, prompt_logprobs=1)
        # The code prompt asks for prompt logprobs too: every rank scores its chunks.
        outs = llm.generate(PROMPTS, [scored if p == PROMPTS[6] else params for p in PROMPTS])
        outs += llm.generate(PROMPTS[2:6], params)
        return outs, llm.engine.scheduler.num_preemptions, llm.engine.block_manager.num_blocks
    finally:
        llm.engine.close()


def test_tp2_greedy_equals_tp1_with_prefix_hits_chunks_and_preemption(model_dir: Path):
    start = time.monotonic()
    tp1, preempted1, blocks1 = generate(model_dir, 1)
    tp2, preempted2, blocks2 = generate(model_dir, 2)
    assert blocks1 == blocks2 == NUM_BLOCKS
    assert preempted1 > 0 and preempted2 > 0
    assert sum(len(o.prompt_token_ids) > 64 for o in tp2) >= 5  # prefilled in chunks of 64
    assert all(o.num_cached_tokens >= 48 for o in tp2[10:])  # the preamble's blocks, from the prefix cache
    for one, two in zip(tp1, tp2):
        assert two.error is None
        # fp32, but the ranks' partial sums add in another order than one product's: the logprobs agree
        # to 1e-4, and greedy picks the same tokens (no near tie among these prompts' answers).
        assert two.token_ids == one.token_ids, (one.prompt_token_ids[:8], one.token_ids, two.token_ids)
        for a, b in zip(one.logprobs, two.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4
        for a, b in zip((one.prompt_logprobs or [None])[1:], (two.prompt_logprobs or [None])[1:], strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    assert len(tp2[6].prompt_logprobs) == len(tp2[6].prompt_token_ids) > 64
    print(f"TP=1 and TP=2 generations: {time.monotonic() - start:.1f} s")


def test_tp2_async_scheduling_gives_transformers_tokens(model_dir: Path, hf_model):
    """Async scheduling under TP=2: each rank takes the next step's input tokens from the tokens it chose
    itself (the logits are all-gathered, so they are the driver's). Greedy, so steps go ahead. Then a
    remote request whose KV has landed (each worker given its heads of it) joins a step launched ahead,
    its first token beside the others' placeholders."""
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory=2**24, tensor_parallel_size=2, async_scheduling=True)
    engine, launch, ahead = llm.engine, llm.engine._launch, []
    engine._launch = lambda batch, prev: ahead.append(({i.seq.request_id for i in batch}, prev is not None)) \
        or launch(batch, prev)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    try:
        outs = llm.generate(PROMPTS[:5], greedy)
        assert sum(went for _, went in ahead) > 5 and all(o.error is None for o in outs)
        prefill = LLM(str(model_dir), device="cpu", kv_cache_memory=2**24).engine
        export = KVCollector(30, 6)
        prefill.add_request("p", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=1), kv_export=export.export)
        engine.add_request("a", PROMPTS[1], greedy)
        for _ in range(3):
            engine.step()
        engine.add_request("r", PROMPTS[2], greedy, remote_prefill=True)
        first = engine.remote_slot("r").first
        while prefill.has_unfinished_requests():
            for out in prefill.step():
                first.output(out.token_ids[0], None)
        engine.finish_remote_prefill("r", export.kv(), first)
        ahead.clear()
        engine.step()
        assert ahead == [({"a", "r"}, True)]
        done = {}
        while engine.has_unfinished_requests():
            done |= {out.request_id: out for out in engine.step() if out.finished}
    finally:
        llm.engine.close()
    for out in outs + [done["a"], done["r"]]:
        assert out.token_ids == hf_greedy(hf_model, out.prompt_token_ids, MAX_TOKENS)


def rank_logits(model_dir: Path, size: int, token_ids: list[int]) -> torch.Tensor:
    """Every position's logits of one prompt with the model sharded over `size` ranks, the ranks as threads
    of this process (a gloo group like the worker processes'): rank 0's."""
    store = TPGroup.host_store(size)
    mc, config = load_config(model_dir), EngineConfig(kv_cache_memory=2**22, tensor_parallel_size=size)
    logits: list[torch.Tensor | None] = [None] * size

    def run(rank: int) -> None:
        tp = TPGroup.join(rank, size, CPU, store=store if rank == 0 else None, port=store.port)
        runner = build_rank_runner(config, model_dir, mc, CPU, torch.float32, tp)
        seq = Sequence("logits", token_ids, SamplingParams(max_tokens=1))
        seq.block_table = list(range(-(-len(token_ids) // config.block_size)))
        logits[rank] = runner.all_logits([ScheduledSeq(seq, len(token_ids))])

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(t is not None for t in logits)
    assert all(torch.equal(logits[0], t) for t in logits[1:])  # gathered: the same on every rank
    return logits[0]


def test_replicated_kv_heads_and_an_untied_head_shard_exactly(tiny_llama_dir):
    # One KV head on two ranks (each holds it), a separate lm_head, and an MLP of odd width (65 + 65
    # columns): TP=2's logits are TP=1's up to the order of the partial sums.
    path = tiny_llama_dir(num_heads=4, num_kv_heads=1, hidden_size=64, intermediate_size=130,
                          tie_word_embeddings=False)
    token_ids = list(range(100, 140))
    one, two = rank_logits(path, 1, token_ids), rank_logits(path, 2, token_ids)
    assert one.shape == two.shape == (40, 49152)
    assert (one - two).abs().max().item() < 1e-5


def pid_alive(pid: int) -> bool:
    """A process that has not exited (a zombie has: only its parent's wait is missing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


STUCK_WORKER = """
import multiprocessing, threading, time
from disagg.engine.tp_workers import exit_with

def stuck() -> None:  # as worker_main starts, then as a worker in a collective that waits for a dead driver
    threading.Thread(target=exit_with, args=(multiprocessing.parent_process().pid,), daemon=True).start()
    time.sleep(600)

if __name__ == "__main__":
    worker = multiprocessing.get_context("spawn").Process(target=stuck, daemon=True)
    worker.start()
    print(worker.pid, flush=True)
    time.sleep(600)
"""


def test_a_worker_stuck_where_it_never_reads_its_pipe_exits_with_its_killed_driver(tmp_path: Path):
    script = tmp_path / "driver.py"
    script.write_text(STUCK_WORKER)
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(driver.stdout.readline())
        time.sleep(1.0)
        assert pid_alive(worker)  # the driver alive: it waits
        driver.kill()
        driver.wait(timeout=10)
        wait_for(lambda: not pid_alive(worker), 10, "the stuck worker exited after its driver")
    finally:
        driver.kill()


def complete(node, prompts: list[list[int]], max_tokens: int) -> httpx.Response:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True}
    return httpx.post(f"{node.url}/v1/completions", json=body, timeout=60)


def token_ids(response: httpx.Response) -> list[list[int]]:
    assert response.status_code == 200, response.text
    return [choice["token_ids"] for choice in sorted(response.json()["choices"], key=lambda c: c["index"])]


def test_handoff_between_nodes_of_different_tp_sizes_and_a_killed_rank(tmp_path: Path, hf_model, hf_tokenizer):
    # Prefill TP=2 -> decode TP=1, then prefill TP=1 -> decode TP=2, over tcp: every prompt crosses
    # ("always"), layer by layer. Each prefill rank sends its own heads (no gather), the decode node
    # takes an entry from each into those heads of its blocks; each decode rank receives its own heads
    # on its own endpoint. One pair at a time: three processes each, so that the suite's memory stays low.
    kv_extra = {"prefill_policy": "fail", "remote_prefill": "always"}
    args, tp2 = ["--max-model-len", "512", "--max-num-batched-tokens", "64"], ["--tensor-parallel-size", "2"]
    prefill2 = start_node("producer", tmp_path, extra_args=args + tp2, wait=False)
    decode1 = start_node("consumer", tmp_path, prefill_nodes=[prefill2.grpc_address], kv_extra=kv_extra,
                         extra_args=args, wait=False)
    nodes = [prefill2, decode1]
    try:
        prompts = [hf_tokenizer(p).input_ids for p in (PROMPTS[1], PROMPTS[2], PROMPTS[6])]  # 6, 76, 106 tokens
        expected = [hf_greedy(hf_model, p, 8) for p in prompts]  # transformers', while the nodes load
        wait_all_ready(*nodes)  # started together: their loads overlap
        assert token_ids(complete(decode1, prompts, 8)) == expected
        assert decode1.labelled("disagg_prefill_route_total", "route").get("remote") == len(prompts)
        # Each prefill rank sent only its own heads: rank 0 holds 1 of the 3 KV heads, rank 1 the other 2.
        sent = prefill2.labelled("disagg_kv_rank_sent_bytes_total", "rank")
        received = decode1.labelled("disagg_kv_transfer_bytes_total", "direction")["received"]
        assert 0 <= received - (sent["0"] + sent["1"]) < 1024, (sent, received)  # and each chunk's small header
        assert sent["1"] == 2 * sent["0"], sent

        # A rank killed: its node exits (non-zero) within 10 s, and its peer fails the request by its policy.
        pid = int(re.search(r"ranks 1 \(pid (\d+)\)", prefill2.log()).group(1))
        os.kill(pid, signal.SIGKILL)
        assert prefill2.proc.wait(timeout=10) != 0
        assert f"tensor-parallel rank 1 (pid {pid}) was killed by SIGKILL: this node exits" in prefill2.log()
        response = complete(decode1, prompts[:1], 8)
        assert response.status_code == 503 and "remote prefill" in response.json()["error"]["message"]
        decode1.kill()

        prefill1 = start_node("producer", tmp_path, extra_args=args, wait=False)
        decode2 = start_node("consumer", tmp_path, prefill_nodes=[prefill1.grpc_address], kv_extra=kv_extra,
                             extra_args=args + tp2, wait=False)
        nodes += [prefill1, decode2]
        wait_all_ready(prefill1, decode2)
        assert token_ids(complete(decode2, prompts, 8)) == expected
        assert decode2.labelled("disagg_prefill_route_total", "route").get("remote") == len(prompts)
        # Each decode rank received only its own heads, on its own endpoint: rank 0 holds 1 of the 3 KV
        # heads and rank 1 the other 2, so rank 0 took a third of the bytes sent (and each its entries'
        # small headers), none of rank 1's.
        sent = prefill1.labelled("disagg_kv_transfer_bytes_total", "direction")["sent"]
        by_rank = decode2.labelled("disagg_kv_rank_received_bytes_total", "rank")
        assert by_rank["0"] + by_rank["1"] == sent, (sent, by_rank)
        assert 0.33 < by_rank["0"] / sent < 0.34 and 0.66 < by_rank["1"] / sent < 0.67, (sent, by_rank)
        assert decode2.labelled("disagg_kv_transfer_bytes_total", "direction")["received"] == sent

        # The prefill node killed: every decode rank's lookup ends (its producer lost), the request fails by policy.
        prefill1.kill()
        response = complete(decode2, prompts[:1], 8)
        assert response.status_code == 503 and "remote prefill" in response.json()["error"]["message"]
    finally:
        for node in nodes:
            node.kill()


def test_handoff_tp2_to_tp2_and_a_decode_rank_killed_mid_request(tmp_path: Path, hf_model, hf_tokenizer):
    # Both nodes at TP=2: each decode rank gets its heads from the prefill rank that holds them, on its
    # own endpoint. The decode node's cache holds 10 blocks, and the three prompts need 1 + 5 + 7: one
    # waits for blocks, so its KV comes with every head (gathered by the prefill node's rank 0) to rank 0,
    # which hands each worker its heads when the blocks are there. Then a decode worker rank killed while
    # a request is in flight: the decode node exits (non-zero) within seconds, the client's request ends
    # rather than hangs, and the prefill node serves on.
    kv_extra = {"prefill_policy": "fail", "remote_prefill": "always"}
    args = ["--max-model-len", "512", "--max-num-batched-tokens", "64", "--tensor-parallel-size", "2"]
    block_bytes = 30 * 2 * 16 * 2 * 64 * 4  # layers, K and V, tokens, rank 1's 2 KV heads, head dim, float32
    prefill = start_node("producer", tmp_path, extra_args=args, wait=False)
    decode = start_node("consumer", tmp_path, prefill_nodes=[prefill.grpc_address], kv_extra=kv_extra,
                        extra_args=args + ["--kv-cache-memory", str(10 * block_bytes)], wait=False)
    try:
        prompts = [hf_tokenizer(p).input_ids for p in (PROMPTS[1], PROMPTS[2], PROMPTS[6])]
        expected = [hf_greedy(hf_model, p, 8) for p in prompts]
        wait_all_ready(prefill, decode)
        assert token_ids(complete(decode, prompts, 8)) == expected
        by_rank = decode.labelled("disagg_kv_rank_received_bytes_total", "rank")
        assert by_rank["1"] < 1.9 * by_rank["0"], by_rank  # a prompt's every head came to rank 0
        # The prefill worker rank sent its 2 heads of the prompts that found their blocks straight to the
        # decode worker rank; rank 0 sent its head of those and every head of the one that waited.
        sent = prefill.labelled("disagg_kv_rank_sent_bytes_total", "rank")
        assert sent["1"] > 0 and all(0 <= by_rank[r] - sent[r] < 1024 for r in "01"), (sent, by_rank)  # + headers

        ended = threading.Event()

        def request() -> None:
            try:
                complete(decode, prompts * 4, 32)
            except httpx.HTTPError:
                pass  # the node went away under it
            ended.set()

        threading.Thread(target=request, daemon=True).start()
        wait_for(lambda: decode.log().count(" runs as ") > len(prompts), 10, "the request reached the decode node")
        pid = int(re.search(r"ranks 1 \(pid (\d+)\)", decode.log()).group(1))
        os.kill(pid, signal.SIGKILL)
        assert decode.proc.wait(timeout=10) != 0
        assert ended.wait(10), "the client's request hangs"
        assert prefill.proc.poll() is None
        assert httpx.get(f"{prefill.url}/health", timeout=5).status_code == 200

        # The prefill node's driver killed outright: its worker rank does not outlive it.
        worker = int(re.search(r"ranks 1 \(pid (\d+)\)", prefill.log()).group(1))
        prefill.kill()
        wait_for(lambda: not pid_alive(worker), 10, "the killed driver's worker rank exited")
    finally:
        prefill.kill()
        decode.kill()
