"""Llama-family forward over a paged KV cache."""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from disagg.engine.layers.attention import AttentionBackend
from disagg.engine.parallel import TPGroup

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2-style q/k/v bias
    rope_scaling: dict | None = None  # only the "llama3" type is supported
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    architecture: str = "LlamaForCausalLM"

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        """Build from a Hugging Face config.json dict; refuses what we cannot run."""
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} in config.json; disagg runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        rope_scaling = hf.get("rope_scaling")
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in ("llama3", "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r}; only 'llama3' is supported")
            if kind == "default":
                rope_scaling = None
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=hf.get("rope_theta", 10000.0),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", arch == "Qwen2ForCausalLM"),
            rope_scaling=rope_scaling,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos,
            architecture=arch,
        )


@dataclass(frozen=True)
class LlamaShard:
    """What one tensor-parallel rank holds (Megatron-style), each a [start, end) range: its query heads
    and the KV heads they attend (q/k/v by rows, o_proj by columns), its columns of the MLP (gate/up by
    rows, down_proj by columns), its rows of the vocabulary (the embedding and lm_head). Ranges are as
    even as they go and need not be equal (the embedded model's 3 KV heads go 1 + 2 on two ranks);
    fewer KV heads than ranks are replicated, each rank holding the one its query heads attend."""

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_rows: int  # every rank's embedding and lm_head rows, the last rank's padded: gathers need equal parts

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def shard_plan(config: LlamaConfig, tp: TPGroup) -> LlamaShard:
    """Rank tp.rank's share of the model; ValueError for a tensor_parallel_size the heads cannot split by."""
    heads, kv, n = config.num_attention_heads, config.num_key_value_heads, tp.size
    if kv >= n:  # each rank a run of whole KV heads and the query heads of their groups
        group = heads // kv
        kv_heads = tp.split(kv)
        q_heads = (kv_heads[0] * group, kv_heads[1] * group)
    elif n % kv == 0 and heads % n == 0:  # each KV head replicated on n // kv ranks
        first = tp.rank * kv // n
        kv_heads, q_heads = (first, first + 1), tp.split(heads)
    else:
        raise ValueError(f"tensor_parallel_size {n} does not split this model's {heads} attention heads and {kv} "
                         f"KV heads: with fewer KV heads than ranks, the ranks must be a multiple of the KV heads "
                         f"and divide the attention heads; use at most {kv} ranks")
    rows = -(-config.vocab_size // n)
    vocab = (min(tp.rank * rows, config.vocab_size), min((tp.rank + 1) * rows, config.vocab_size))
    return LlamaShard(q_heads, kv_heads, tp.split(config.intermediate_size), vocab, rows)


def rank_shards(config: LlamaConfig, tp: TPGroup) -> list[LlamaShard]:
    """Every rank's share of the model (shard_plan of each rank of tp's size), as any rank computes it."""
    return [shard_plan(config, TPGroup(rank, tp.size, tp.device)) for rank in range(tp.size)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused_ops: ModuleType | None = None  # set by LlamaForCausalLM.fuse()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or (norm(x + residual), x + residual) when a residual is given."""
        if self.fused_ops is not None:
            out = self.fused_ops.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 like the reference implementation, so float16/bfloat16 match it.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    dim = config.head_dim
    # On the CPU even while the model is made on the meta device (builder): the tables are computed, not loaded.
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # Llama 3.1's frequency-dependent stretch of long wavelengths.
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: LlamaConfig, max_positions: int):
        super().__init__()
        freqs = torch.arange(max_positions, dtype=torch.float32, device="cpu")[:, None] * rope_inv_freq(config)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.fused_ops: ModuleType | None = None  # set by LlamaForCausalLM.fuse()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_ops is not None:
            self.fused_ops.rotary(q, k, self.cos, self.sin, positions)
            return q, k
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, shard: LlamaShard, tp: TPGroup):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = shard.num_heads  # this rank's
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = config.head_dim
        self.tp = tp
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        # Qwen2 has q/k/v bias but none on the output projection.
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.qkv_proj: nn.Linear | None = None  # q, k and v in one product, made by fuse()

    def fuse(self) -> None:
        self.qkv_proj = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, positions: torch.Tensor,
                attention: AttentionBackend, meta) -> torch.Tensor:
        T = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = attention.forward(self.layer_idx, q, k, v, meta)
        return self.tp.row_parallel(out.reshape(T, q_size), self.o_proj)  # this rank's part: the next norm sums


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig, shard: LlamaShard, tp: TPGroup):
        super().__init__()
        intermediate = shard.intermediate[1] - shard.intermediate[0]  # this rank's columns
        self.gate_proj = nn.Linear(config.hidden_size, intermediate, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, config.hidden_size, bias=False)
        self.tp = tp
        self.gate_up_proj: nn.Linear | None = None  # made by fuse()
        self.fused_ops: ModuleType | None = None

    def fuse(self, ops: ModuleType) -> None:
        self.gate_up_proj = fuse_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj
        self.fused_ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the MLP's output: the next norm sums the ranks' (TPGroup.sum_add_norm)."""
        if self.fused_ops is None:
            return self.tp.row_parallel(F.silu(self.gate_proj(x)) * self.up_proj(x), self.down_proj)
        return self.tp.row_parallel(self.fused_ops.silu_mul(self.gate_up_proj(x)), self.down_proj)


def fuse_linears(*linears: nn.Linear) -> nn.Linear:
    """One projection whose output is the given ones' outputs side by side: one matrix product
    instead of several reading the same input."""
    fused = nn.Linear(linears[0].in_features, sum(lin.out_features for lin in linears),
                      bias=linears[0].bias is not None, device="meta")
    fused.weight = nn.Parameter(torch.cat([lin.weight.data for lin in linears]), requires_grad=False)
    if linears[0].bias is not None:
        fused.bias = nn.Parameter(torch.cat([lin.bias.data for lin in linears]), requires_grad=False)
    return fused


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int, shard: LlamaShard, tp: TPGroup):
        super().__init__()
        self.self_attn = Attention(config, layer_idx, shard, tp)
        self.mlp = MLP(config, shard, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tp = tp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: RotaryEmbedding,
                positions: torch.Tensor, attention: AttentionBackend, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's part of the layer's MLP output, the residual stream before it): the next norm
        sums the ranks' parts and adds the residual, so each sum and add is fused with a norm on the GPU
        path. x: the embeddings (residual None), else the previous layer's MLP part."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.tp.sum_add_norm(x, residual, self.input_layernorm)
        h = self.self_attn(h, rotary, positions, attention, meta)
        h, residual = self.tp.sum_add_norm(h, residual, self.post_attention_layernorm)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, max_positions: int, shard: LlamaShard, tp: TPGroup):
        super().__init__()
        # This rank's rows of the vocabulary. An empty _weight skips the random init, which load_weights replaces
        # anyway: on the meta device (builder) normal_ costs a second the first time, per process.
        self.embed_tokens = nn.Embedding(shard.vocab_rows, config.hidden_size,
                                         _weight=torch.empty(shard.vocab_rows, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i, shard, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)


class LlamaForCausalLM(nn.Module):
    """Module names mirror Hugging Face's, so a safetensors state dict loads as is (each rank's shard of
    it under tensor parallelism: `weight_slices`)."""

    def __init__(self, config: LlamaConfig, max_positions: int, tp: TPGroup | None = None):
        super().__init__()
        self.config = config
        self.tp = tp or TPGroup.single(torch.device("cpu"))
        self.shard = shard_plan(config, self.tp)
        self.model = LlamaModel(config, max_positions, self.shard, self.tp)
        self.lm_head = nn.Linear(config.hidden_size, self.shard.vocab_rows, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend, meta,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Flat tokens of the whole batch [T] -> final hidden states [T, hidden]. after_layer(i) runs
        once layer i's work is queued (its KV is in the cache once that work is done)."""
        x, residual = self.embed(input_ids), None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, self.model.rotary, positions, attention, meta)
            if after_layer is not None:
                after_layer(i)
        return self.tp.sum_add_norm(x, residual, self.model.norm)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.model.embed_tokens(input_ids)
        # Vocabulary-parallel: each rank looks up the tokens in its rows, zeros for the others, and the
        # sum over ranks is every token's row (exact: one term is not zero).
        start, end = self.shard.vocab
        local = input_ids - start
        outside = (local < 0) | (local >= end - start)
        x = self.model.embed_tokens(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0.0)
        return self.tp.all_reduce(x)

    def fuse(self) -> None:
        """The GPU path, after loading: q/k/v and gate/up each one product, and the Triton
        kernels for norms, rotary and SiLU. Not on the CPU, where outputs must equal
        transformers' float32 bit for bit."""
        from disagg.engine.layers import fused_ops

        self.model.rotary.fused_ops = self.model.norm.fused_ops = fused_ops
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse(fused_ops)
            layer.input_layernorm.fused_ops = layer.post_attention_layernorm.fused_ops = fused_ops

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] on every rank: each rank's vocabulary rows, gathered."""
        logits = self.lm_head(hidden)
        if self.tp.size == 1:
            return logits
        return torch.cat(self.tp.all_gather(logits), dim=-1)[:, :self.config.vocab_size]

    def gather_kv_heads(self, kv: torch.Tensor) -> torch.Tensor:
        """This rank's KV heads [..., its heads, head_dim] -> every KV head of the model [..., kv heads,
        head_dim], on every rank: KV leaves a node with all its heads whatever its TP (a collective)."""
        if self.tp.size == 1:
            return kv
        shards = rank_shards(self.config, self.tp)
        width = max(sh.num_kv_heads for sh in shards)  # a gather's parts are of one shape
        padded = kv.new_zeros(*kv.shape[:-2], width, kv.shape[-1])
        padded[..., :kv.shape[-2], :] = kv
        out = kv.new_empty(*kv.shape[:-2], self.config.num_key_value_heads, kv.shape[-1])
        for sh, part in zip(shards, self.tp.all_gather(padded)):
            out[..., sh.kv_heads[0]:sh.kv_heads[1], :] = part[..., :sh.num_kv_heads, :]
        return out

    def weight_slices(self) -> dict[str, tuple[int, int, int]]:
        """Checkpoint name -> (dimension, start, end) of this rank's share, for the weights it holds a part
        of (the others it holds whole); nothing at TP=1."""
        if self.tp.size == 1:
            return {}
        d, sh = self.config.head_dim, self.shard
        q = (sh.q_heads[0] * d, sh.q_heads[1] * d)
        kv = (sh.kv_heads[0] * d, sh.kv_heads[1] * d)
        slices = {"model.embed_tokens.weight": (0, *sh.vocab), "lm_head.weight": (0, *sh.vocab)}
        for i in range(self.config.num_hidden_layers):
            p = f"model.layers.{i}."
            for name, (dim, cut) in {"self_attn.q_proj": (0, q), "self_attn.k_proj": (0, kv),
                                     "self_attn.v_proj": (0, kv), "self_attn.o_proj": (1, q),
                                     "mlp.gate_proj": (0, sh.intermediate), "mlp.up_proj": (0, sh.intermediate),
                                     "mlp.down_proj": (1, sh.intermediate)}.items():
                slices[p + name + ".weight"] = (dim, *cut)
                if dim == 0 and self.config.attention_bias and name.startswith("self_attn"):
                    slices[p + name + ".bias"] = (0, *cut)
        return slices

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        expected = set(self.state_dict().keys())
        if self.config.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
            expected.discard("lm_head.weight")
        # Rotary tables are buffers we compute, not weights; HF checkpoints may carry inv_freq.
        weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
        missing = expected - weights.keys()
        unexpected = weights.keys() - expected
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the {self.config.architecture} layout: "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
        # Each parameter becomes the checkpoint's tensor itself, not a copy of it: on the CPU at the checkpoint's
        # dtype, a map of its safetensors file (loader.load_weights), whose pages every process serving that
        # file shares. The builder makes the model on the meta device, so no memory was spent on them before.
        params = dict(self.named_parameters())
        for name, tensor in weights.items():
            shape = params[name].shape
            if tensor.shape[1:] != shape[1:] or tensor.shape[0] > shape[0]:
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the model's config "
                                 f"gives {tuple(shape)}")
            if tensor.shape[0] < shape[0]:  # a last rank's vocabulary shard is shorter: padding, never gathered out
                tensor = torch.cat([tensor, tensor.new_zeros(shape[0] - tensor.shape[0], *shape[1:])])
            module, _, attr = name.rpartition(".")
            setattr(self.get_submodule(module), attr, nn.Parameter(tensor, requires_grad=False))
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
