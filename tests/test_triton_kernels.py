"""The CUDA backend's Triton kernels against SDPA over gathered K/V (the CPU backend's math).

Without a GPU they run under TRITON_INTERPRET=1 on CPU tensors (slowly, exactly), so the
shapes stay small; on a CUDA machine the same tests run the compiled kernels.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined, so before the import
triton_kernels = pytest.importorskip("disagg.engine.layers.triton_kernels")
from disagg.engine.cuda_graphs import buckets  # noqa: E402
from disagg.engine.layers import fused_ops  # noqa: E402
from disagg.engine.layers.triton_attention import split_count  # noqa: E402
from disagg.engine.models.llama import MLP, LlamaConfig, RMSNorm, RotaryEmbedding, shard_plan  # noqa: E402
from disagg.engine.parallel import TPGroup  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 16


class PagedCase:
    """Random paged cache with shuffled blocks, and sequences of (context, new tokens)."""

    def __init__(self, lengths: list[tuple[int, int]], num_kv_heads: int, group: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.lengths = lengths
        self.num_heads = num_kv_heads * group
        blocks_per_seq = [-(-ctx // BLOCK_SIZE) for ctx, _ in lengths]
        num_blocks = sum(blocks_per_seq) + 3
        order = torch.randperm(num_blocks, generator=g).tolist()
        width = max(blocks_per_seq) + 2
        # Rows of the block table in another order than the batch, as running sequences keep theirs.
        self.rows = torch.randperm(len(lengths) + 2, generator=g)[:len(lengths)].to(torch.int32)
        self.table = torch.full((len(lengths) + 2, width), -1, dtype=torch.int32)
        self.block_ids = []
        for i, n in enumerate(blocks_per_seq):
            ids, order = order[:n], order[n:]
            self.block_ids.append(ids)
            self.table[self.rows[i], :n] = torch.tensor(ids, dtype=torch.int32)
        shape = (num_blocks * BLOCK_SIZE, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=g).to(dtype)
        self.v_cache = torch.randn(shape, generator=g).to(dtype)
        total_new = sum(new for _, new in lengths)
        self.q = torch.randn(total_new, self.num_heads, head_dim, generator=g).to(dtype)

    def slots(self, i: int) -> torch.Tensor:
        ids = torch.tensor(self.block_ids[i])
        return (ids[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)[None, :]).flatten()[:self.lengths[i][0]]

    def reference(self) -> torch.Tensor:
        out, row = [], 0
        for i, (ctx, new) in enumerate(self.lengths):
            slots = self.slots(i)
            k = self.k_cache[slots].float().transpose(0, 1)
            v = self.v_cache[slots].float().transpose(0, 1)
            q = self.q[row:row + new].float().transpose(0, 1)
            mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - new, ctx)[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            out.append(o.transpose(0, 1))
            row += new
        return torch.cat(out)

    def to(self, device: str) -> "PagedCase":
        for name in ("rows", "table", "k_cache", "v_cache", "q"):
            setattr(self, name, getattr(self, name).to(device))
        return self


def prefill(case: PagedCase, block_m: int) -> torch.Tensor:
    group = case.num_heads // case.k_cache.shape[1]
    per_tile = block_m // group
    query_start, tile_seq, tile_start = [0], [], []
    for i, (_, new) in enumerate(case.lengths):
        query_start.append(query_start[-1] + new)
        for first in range(0, new, per_tile):
            tile_seq.append(i)
            tile_start.append(first)
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEVICE)  # noqa: E731
    out = torch.full_like(case.q, float("nan"))
    triton_kernels.prefill_attention(case.q, out, case.k_cache, case.v_cache, case.table, case.rows,
                                     ints(query_start), ints([ctx for ctx, _ in case.lengths]), ints(tile_seq),
                                     ints(tile_start), BLOCK_SIZE, block_m)
    return out


@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(2, 1, 64), (2, 4, 64), (1, 8, 128), (3, 3, 64)])
def test_prefill_matches_sdpa(num_kv_heads, group, head_dim):
    # Fresh prompts, prompts behind a prefix-cache hit or earlier chunks, block boundaries.
    lengths = [(1, 1), (16, 16), (17, 17), (40, 9), (33, 1), (64, 31)]
    case = PagedCase(lengths, num_kv_heads, group, head_dim).to(DEVICE)
    out = prefill(case, block_m=max(16, 2 * group)).cpu()
    assert not out.isnan().any()
    torch.testing.assert_close(out, case.to("cpu").reference(), atol=2e-5, rtol=1e-4)


def test_split_counts_and_graph_buckets():
    """The split counts measured best on an H200 (132 SMs, 8 KV heads, benchmarks/decode_splits.py); every
    batch of a CUDA graph bucket has the split count of the bucket's own size, which its graph runs with."""
    count = lambda n: split_count(n, 8, 132)  # noqa: E731
    assert [count(n) for n in (1, 4, 8, 9, 16, 17, 24, 32, 33, 64)] == [32, 16, 8, 8, 4, 4, 2, 2, 2, 1]
    sizes = buckets(256, count)
    assert sizes == [1, 2, 4, 8, 9, 16, 18, 32, 37, 64, 96, 128, 160, 192, 224, 256]
    for n in range(1, 257):
        assert count(n) == count(next(b for b in sizes if b >= n))


def test_graph_buckets_of_tensor_parallel_ranks_with_unequal_kv_heads():
    """The embedded model's 3 KV heads go 2 + 1 on two ranks, whose split counts change at different
    batches: both ranks capture the same buckets (a graph's all-reduces pair with the peer's graph of
    that size, else capture hangs), and each bucket keeps each rank's split count."""
    counts = [lambda n, h=h: split_count(n, h, 132) for h in (1, 2)]
    assert buckets(64, counts[0]) != buckets(64, counts[1])  # each rank's own edges differ
    sizes = buckets(64, *counts)
    assert sizes == buckets(64, *reversed(counts))
    assert set(buckets(64, counts[0])) | set(buckets(64, counts[1])) == set(sizes)
    for count in counts:
        for n in range(1, 65):
            assert count(n) == count(next(b for b in sizes if b >= n))


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("num_kv_heads,group,head_dim,contexts", [
    (2, 1, 64, (1, 15, 16, 17, 150)), (2, 4, 128, (1, 15, 16, 17, 150)), (1, 8, 64, (1, 15, 16, 17, 150)),
    # One long context among short ones: it takes most of the programs (_slices), sliced 64 keys at a time.
    (2, 4, 64, (700, 3, 40, 1, 64))])
def test_decode_matches_sdpa(num_kv_heads, group, head_dim, num_splits, contexts):
    lengths = [(ctx, 1) for ctx in contexts]
    case = PagedCase(lengths, num_kv_heads, group, head_dim).to(DEVICE)
    # Two padding rows (negative positions), as a CUDA graph's batch bucket has.
    positions = torch.tensor([ctx - 1 for ctx, _ in lengths] + [-1, -1], dtype=torch.int32, device=DEVICE)
    rows = torch.cat([case.rows, case.rows[:2]])
    q = torch.cat([case.q, case.q[:2]])
    out = torch.full_like(q, float("nan"))
    triton_kernels.decode_attention(q, out, case.k_cache, case.v_cache, case.table, rows, positions,
                                    BLOCK_SIZE, num_splits)
    out = out.cpu()
    torch.testing.assert_close(out[:len(lengths)], case.to("cpu").reference(), atol=2e-5, rtol=1e-4)
    assert torch.all(out[len(lengths):] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_ops_match_the_torch_layers(dtype):
    """Residual add + RMSNorm, rotary and SiLU-mul against the modules' own torch path."""
    g = torch.Generator().manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=80, num_hidden_layers=1,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    x, residual = (torch.randn(5, 96, generator=g).to(dtype) for _ in range(2))
    norm = RMSNorm(96, 1e-5).to(dtype)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    ref_out, ref_sum = norm(x, residual.clone())
    fused_sum = residual.clone().to(DEVICE)
    norm.to(DEVICE).fused_ops = fused_ops
    out, fused_sum = norm(x.to(DEVICE), fused_sum)
    torch.testing.assert_close(fused_sum.cpu(), ref_sum, **tol)
    torch.testing.assert_close(out.cpu(), ref_out, **tol)
    torch.testing.assert_close(norm(x.to(DEVICE)).cpu(), RMSNorm._norm(norm.cpu(), x), **tol)

    rotary = RotaryEmbedding(config, max_positions=64)
    qkv = torch.randn(5, 10, 16, generator=g).to(dtype)  # q, k, v heads of one fused projection
    positions = torch.tensor([0, 3, 17, 63, 5])
    ref_q, ref_k = rotary(positions, qkv[:, :6], qkv[:, 6:8])
    qkv = qkv.to(DEVICE)
    rotary.to(DEVICE).fused_ops = fused_ops
    rotary(positions.to(DEVICE, torch.int32), qkv[:, :6], qkv[:, 6:8])
    torch.testing.assert_close(qkv[:, :6].cpu(), ref_q, **tol)
    torch.testing.assert_close(qkv[:, 6:8].cpu(), ref_k, **tol)

    one_rank = TPGroup.single(torch.device("cpu"))
    mlp = MLP(config, shard_plan(config, one_rank), one_rank).to(dtype)
    h = torch.randn(5, 96, generator=g).to(dtype)
    ref = mlp(h)
    mlp.to(DEVICE).fuse(fused_ops)
    torch.testing.assert_close(mlp(h.to(DEVICE)).cpu(), ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="TRITON_INTERPRET rounds float32 to bfloat16 towards zero, a GPU to nearest"))])
def test_the_sum_over_ranks_with_its_norm_is_the_all_reduce_then_the_norm(dtype):
    """fused_ops.sum_rms_norm, its arithmetic (the barrier between GPUs runs on the pair: test_gpu_engine):
    three ranks' parts read through their addresses, summed in rank order and rounded as an all-reduce's
    result, + residual (written back), then RMSNorm, as the norm after an all-reduce gives them."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(5, 96, generator=g).to(dtype).to(DEVICE) for _ in range(3)]
    residual = torch.randn(5, 96, generator=g).to(dtype)
    norm = RMSNorm(96, 1e-5).to(dtype)
    norm.weight.data = torch.randn(96, generator=g).to(dtype)
    summed = (parts[0].float() + parts[1].float() + parts[2].float()).to(dtype).cpu()
    ref_out, ref_residual = norm(summed, residual.clone())
    part_ptrs = torch.tensor([part.data_ptr() for part in parts], dtype=torch.int64, device=DEVICE)
    fused_residual = residual.to(DEVICE)
    out = fused_ops.sum_rms_norm(part_ptrs, None, 0, 1, fused_residual, norm.weight.to(DEVICE), norm.eps)
    # The new residual bit for bit (its sum in rank order, rounded where an all-reduce's result is), so that
    # every rank carries the same stream; the norm within its rsqrt's precision.
    assert torch.equal(fused_residual.cpu(), ref_residual)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.cpu(), ref_out, **tol)


def test_store_kv_writes_each_token_at_its_slot_and_skips_padding():
    case = PagedCase([(20, 20), (35, 3)], num_kv_heads=2, group=1, head_dim=64).to(DEVICE)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    positions = torch.tensor(list(range(20)) + [32, 33, 34, -1], dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([case.rows[0].item()] * 20 + [case.rows[1].item()] * 4, dtype=torch.int32, device=DEVICE)
    # Strided views, as the split of a fused QKV projection gives.
    kv = torch.randn(24, 2, 2, 64, device=DEVICE)
    k, v = kv[:, 0], kv[:, 1]
    triton_kernels.store_kv(k, v, k_cache, v_cache, case.table, rows, positions, BLOCK_SIZE)
    case = case.to("cpu")
    k_cache, v_cache, k, v = k_cache.cpu(), v_cache.cpu(), k.cpu(), v.cpu()
    slots = torch.cat([case.slots(0)[:20], case.slots(1)[32:35]])
    assert torch.equal(k_cache[slots], k[:23]) and torch.equal(v_cache[slots], v[:23])
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(k_cache[untouched], case.k_cache[untouched])
    assert torch.equal(v_cache[untouched], case.v_cache[untouched])


def test_every_metadata_vector_of_a_step_starts_16_byte_aligned():
    """Triton compiles a kernel once per 16-byte alignment of each pointer it is given: step metadata
    at any offset would compile new variants mid-serving (seen on a GPU: 2 s of compiles in a loaded
    run). Batches of every mix of decodes and chunks give vectors that all start aligned."""
    from disagg.engine.kv_cache import KVCache
    from disagg.engine.layers.triton_attention import TritonAttention
    from disagg.engine.sampling_params import SamplingParams
    from disagg.engine.scheduler import ScheduledSeq
    from disagg.engine.sequence import Sequence

    cache = KVCache(1, 64, BLOCK_SIZE, 2, 16, torch.float32, torch.device(DEVICE))
    attention = TritonAttention(cache, num_heads=4, max_num_seqs=16, max_model_len=256)
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        batch, mix = [], torch.randint(1, 6, (2,), generator=g).tolist()
        for i in range(sum(mix)):
            n = 1 if i < mix[0] else int(torch.randint(2, 40, (1,), generator=g))
            seq = Sequence(f"s{step}-{i}", torch.randint(3, 100, (n + i,), generator=g).tolist(), SamplingParams())
            seq.num_computed_tokens = i  # decodes: i tokens in the cache; chunks: a prefix of i tokens
            seq.block_table = list(range(4 * i, 4 * i + 4))
            batch.append(ScheduledSeq(seq, n))
        inputs = attention.prepare(batch)
        meta = inputs.meta
        vectors = [inputs.input_ids, inputs.positions, inputs.sample_rows, meta.token_rows, meta.query_start,
                   meta.seq_lens, meta.seq_rows, meta.tile_seq, meta.tile_start]
        assert all(v.data_ptr() % 16 == 0 for v in vectors), [v.data_ptr() % 16 for v in vectors]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA, test_gpu_engine.py runs the engine")
def test_engine_on_triton_backend_generates_what_sdpa_does(tiny_llama_dir):
    """The backend's metadata (device block table, query tiles, decode rows) through the whole
    engine: chunked prompts, prefix-cache hits and preemption, against the SDPA backend."""
    from disagg import LLM, SamplingParams

    model = tiny_llama_dir(num_heads=4, num_kv_heads=2, hidden_size=64, head_dim=16, seed=3)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 17, 40, 70)]
    prompts.append(prompts[3][:50] + prompts[1])  # shares 3 full blocks with the 70-token prompt
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)  # the fewest that still preempt
    outputs = {}
    for backend in ("sdpa", "triton"):
        # 24 tokens a step chunks the prompts; 10 blocks cannot hold all five, so some are preempted.
        llm = LLM(str(model), device="cpu", dtype="float32", attention_backend=backend,
                  max_num_batched_tokens=24, kv_cache_memory=10 * 8192)  # 8 KiB a block
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        outputs[backend] += [o.token_ids for o in llm.generate(prompts[3:], params)]  # prefix hits
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert outputs["triton"] == outputs["sdpa"]
