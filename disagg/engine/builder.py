"""Building an engine's model runner: the model loaded onto its device, the KV cache sized from
its memory budget (which also bounds max_model_len), the attention backend and the decode graphs."""

import logging
import os
from pathlib import Path

import torch

from disagg.engine.config import EngineConfig
from disagg.engine.kv_cache import KVCache
from disagg.engine.layers.attention import AttentionBackend, SdpaAttention
from disagg.engine.loader import load_weights
from disagg.engine.model_runner import ModelRunner
from disagg.engine.models.llama import LlamaConfig, LlamaForCausalLM, rank_shards, shard_plan
from disagg.engine.parallel import TPGroup
from disagg.engine.tp_workers import TPWorkers

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
DEFAULT_CPU_KV_CACHE_BYTES = 512 * 2**20
DEFAULT_GPU_KV_CACHE_FRACTION = 0.8


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was asked for but no CUDA GPU is available; use device='cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {str(device)!r}")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


GPU_MEMORY_UTILIZATION_ON_CPU = ("--gpu-memory-utilization is for GPUs and is ignored on the CPU: there the KV "
                                  "cache takes --kv-cache-memory (default 512 MiB)")


def check_memory_settings(kv_cache_memory: int | float | None, gpu_memory_utilization: float | None) -> None:
    if gpu_memory_utilization is None:
        return
    if kv_cache_memory is not None:
        raise ValueError("give --kv-cache-memory or --gpu-memory-utilization, not both: both size the KV cache")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization is a fraction of the GPU's memory in (0, 1], got "
                         f"{gpu_memory_utilization}")


def gpu_free_at_start(config: EngineConfig, device: torch.device) -> int | None:
    """Before the model loads, with --gpu-memory-utilization: the device's free memory, checked to hold what
    the flag asks for (vLLM refuses to start otherwise)."""
    check_memory_settings(config.kv_cache_memory, config.gpu_memory_utilization)
    if config.gpu_memory_utilization is None or device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    wanted = total * config.gpu_memory_utilization
    if free < wanted:
        raise ValueError(f"free memory on {device} ({free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB) is less than "
                         f"--gpu-memory-utilization {config.gpu_memory_utilization} asks for "
                         f"({wanted / 2**30:.1f} GiB); lower it, or stop what else uses the GPU")
    return free


def prefill_graph_tokens(config: EngineConfig) -> int:
    """The largest step PrefillGraphs capture on CUDA (0: none), no larger than a step may be; ValueError
    for a setting that is not a count."""
    tokens = config.max_prefill_graph_tokens
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise ValueError(f"max_prefill_graph_tokens must be a number of tokens, 0 for none; got {tokens!r}")
    if config.enforce_eager or config.attention_backend == "sdpa":
        return 0
    return min(tokens, config.max_num_batched_tokens)


def step_activation_bytes(config: EngineConfig, mc: LlamaConfig, dtype: torch.dtype) -> int:
    """An estimate of a step's peak activations beside the weights: a layer's hidden states, q/k/v and MLP
    for max_num_batched_tokens tokens; what the prefill graphs keep, twice that for their largest step
    (their pool, whose blocks are rounded up, and the shared buffers: 324 MiB measured for an 8B model at
    1,024 tokens) and every bucket's final hidden states (their sizes add up to about 9 times the
    largest's); and float32 logits for max_num_seqs rows (vLLM measures a dummy step instead)."""
    per_token = (6 * mc.hidden_size + 3 * mc.intermediate_size) * dtype.itemsize
    graphs = prefill_graph_tokens(config) * (2 * per_token + 9 * mc.hidden_size * dtype.itemsize)
    return config.max_num_batched_tokens * per_token + graphs + 2 * config.max_num_seqs * mc.vocab_size * 4


def gpu_kv_cache_budget(config: EngineConfig, mc: LlamaConfig, device: torch.device, dtype: torch.dtype,
                        free_at_start: int) -> int:
    """vLLM's --gpu-memory-utilization: this process may use that fraction of the GPU's total memory; the KV
    cache gets what the loaded model (measured) and a step's activations (estimated) leave of it."""
    free, total = torch.cuda.mem_get_info(device)
    model_bytes = free_at_start - free
    activations = step_activation_bytes(config, mc, dtype)
    budget = int(total * config.gpu_memory_utilization) - model_bytes - activations
    if budget <= 0:
        raise ValueError(f"--gpu-memory-utilization {config.gpu_memory_utilization} gives this process "
                         f"{total * config.gpu_memory_utilization / 2**30:.1f} GiB, and the model takes "
                         f"{model_bytes / 2**30:.1f} GiB and a step about {activations / 2**30:.1f} GiB: nothing is "
                         "left for the KV cache; raise it")
    logger.info("KV cache budget %.1f GiB: %.2f of %.1f GiB, less %.1f GiB for the model and %.1f GiB for a step",
                budget / 2**30, config.gpu_memory_utilization, total / 2**30, model_bytes / 2**30, activations / 2**30)
    return budget


def kv_cache_budget(memory: int | float | None, device: torch.device) -> int:
    """Bytes for the KV cache: given as bytes, or as a fraction of free memory."""
    if memory is None:
        memory = DEFAULT_GPU_KV_CACHE_FRACTION if device.type == "cuda" else DEFAULT_CPU_KV_CACHE_BYTES
    if isinstance(memory, float):
        if not 0.0 < memory <= 1.0:
            raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {memory}")
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int(free * memory)
    if memory <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {memory}")
    return int(memory)


def check_tensor_parallel(config: EngineConfig, mc: LlamaConfig, device: torch.device) -> None:
    size = config.tensor_parallel_size
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    if size == 1:
        return
    shard_plan(mc, TPGroup(size - 1, size, device))  # ValueError if the heads do not split
    if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {size} from {device} needs GPUs {device.index or 0} to "
                         f"{(device.index or 0) + size - 1}; this machine has {torch.cuda.device_count()}")


def build_runner(config: EngineConfig, model_dir: Path, mc: LlamaConfig, device: torch.device,
                 dtype: torch.dtype) -> ModelRunner:
    """The driver's runner: with tensor_parallel_size > 1, the worker ranks are spawned first (they load
    their shards while this process loads its own) and drive along with it."""
    check_tensor_parallel(config, mc, device)
    prefill_graph_tokens(config)  # refused before any worker starts
    if config.tensor_parallel_size == 1:
        return build_rank_runner(config, model_dir, mc, device, dtype, TPGroup.single(device))
    workers, tp = TPWorkers.start(config, model_dir, mc.hidden_size, dtype, device)
    try:
        runner = build_rank_runner(config, model_dir, mc, device, dtype, tp)
    except BaseException:
        workers.stop()
        raise
    workers.kv_heads = [shard.kv_heads for shard in rank_shards(mc, tp)]
    runner.workers = workers
    return runner


def build_rank_runner(config: EngineConfig, model_dir: Path, mc: LlamaConfig, device: torch.device,
                      dtype: torch.dtype, tp: TPGroup) -> ModelRunner:
    """One rank's runner: its shard of the model (only that part of the weights read) and its KV heads'
    share of every block; every rank has the same number of blocks."""
    if config.block_size < 1 or config.block_size & (config.block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {config.block_size}")
    max_model_len = config.max_model_len or mc.max_position_embeddings
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be at least 2, got {max_model_len}")
    free_at_start = gpu_free_at_start(config, device)
    if config.gpu_memory_utilization is not None and device.type != "cuda" and tp.rank == 0:
        logger.warning(GPU_MEMORY_UTILIZATION_ON_CPU)
    with torch.device("meta"):  # no memory, and no random values, for the weights that load_weights puts in place
        model = LlamaForCausalLM(mc, max(max_model_len, mc.max_position_embeddings), tp)
    model.load_weights(load_weights(model_dir, dtype, "cpu", model.weight_slices()))
    model.to(device=device, dtype=dtype).eval()
    # Rotary tables stay float32 for accuracy; they are cast per call.
    model.model.rotary.float()

    kv_heads = model.shard.num_kv_heads
    block_bytes = KVCache.bytes_per_block(mc.num_hidden_layers, config.block_size, kv_heads, mc.head_dim, dtype)
    budget = (gpu_kv_cache_budget(config, mc, device, dtype, free_at_start) if free_at_start is not None
              else kv_cache_budget(config.kv_cache_memory, device))
    # Every rank holds every block (its heads' share): as many as the fullest rank has room for.
    num_blocks = tp.min(budget // block_bytes)
    if num_blocks < 2:
        raise ValueError(f"kv_cache_memory holds {num_blocks} blocks of {block_bytes} bytes; give it more memory")
    capacity = (num_blocks - 1) * config.block_size  # one block of headroom for the next token
    if max_model_len > capacity:
        logger.warning("max_model_len %d does not fit the KV cache (%d tokens); using %d",
                       max_model_len, capacity, capacity)
        max_model_len = capacity
    kv_cache = KVCache(mc.num_hidden_layers, num_blocks, config.block_size, kv_heads, mc.head_dim, dtype, device)
    rank = f"rank {tp.rank}: " if tp.size > 1 else ""
    logger.info("%sKV cache: %d blocks of %d tokens (%.1f MiB, %d of %d KV heads) on %s, %s", rank, num_blocks,
                config.block_size, num_blocks * block_bytes / 2**20, kv_heads, mc.num_key_value_heads, device,
                str(dtype).removeprefix("torch."))
    attention = make_attention(config, model, kv_cache, max_model_len)
    graphs = prefill_graphs = None
    if device.type == "cuda" and not config.enforce_eager and not isinstance(attention, SdpaAttention):
        from disagg.engine.cuda_graphs import DecodeGraphs  # Triton is needed on CUDA only
        from disagg.engine.prefill_graphs import PrefillGraphs

        if tp.size > 1:
            logger.info("%sthe decode CUDA graphs capture the all-reduces and the logits' all-gather "
                        "(--enforce-eager runs them eagerly)", rank)
        graphs = DecodeGraphs(model, attention, config.max_num_seqs,
                              [shard.num_kv_heads for shard in rank_shards(mc, tp)])
        if prefill_graph_tokens(config):
            prefill_graphs = PrefillGraphs(model, attention, prefill_graph_tokens(config))
    return ModelRunner(model, attention, graphs, prefill_graphs, max_model_len)


def make_attention(config: EngineConfig, model: LlamaForCausalLM, kv_cache: KVCache,
                   max_model_len: int) -> AttentionBackend:
    device = kv_cache.kv.device
    backend = config.attention_backend or ("triton" if device.type == "cuda" else "sdpa")
    if backend == "sdpa":
        return SdpaAttention(kv_cache)
    # Triton on the CPU only under its interpreter, which is how CI checks the kernels.
    if backend != "triton" or (device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        raise ValueError(f"attention_backend must be 'sdpa', or 'triton' on CUDA; got {backend!r} on {device}")
    from disagg.engine.layers.triton_attention import TritonAttention

    model.fuse()
    return TritonAttention(kv_cache, model.shard.num_heads, config.max_num_seqs, max_model_len)
