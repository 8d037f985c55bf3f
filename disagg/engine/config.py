"""EngineConfig: what an engine is built from (the engine imports nothing of the network)."""

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class EngineConfig:
    model: str | None = None  # local HF-format directory or .gguf file; None: the embedded SmolLM2
    device: str | None = None  # "cpu", "cuda", "cuda:N"; None: CUDA when present
    dtype: str | torch.dtype | None = None  # "float32", "bfloat16", "float16", "auto"
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's context length, capped by the KV cache
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per step; longer prompts are prefilled in chunks
    kv_cache_memory: int | float | None = None  # bytes, or a fraction of free memory
    # vLLM's: the fraction of the GPU's total memory this process may use in all (weights, activations,
    # KV cache); the KV cache gets what the rest leaves. Ignored on the CPU. Not with kv_cache_memory.
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    # Ranks the model is sharded over (Megatron-style): this process and N - 1 worker processes, one
    # device each on CUDA (cuda:i .. cuda:i+N-1 from device cuda:i); on the CPU all share it.
    tensor_parallel_size: int = 1
    # vLLM's: CUDA all-reduces through NCCL only, none over symmetric memory (parallel.py).
    disable_custom_all_reduce: bool = False
    enforce_eager: bool = False  # CUDA: no CUDA graphs
    # CUDA: steps with prompt tokens of up to this many tokens in all run as CUDA graphs of the pieces
    # between attentions (prefill_graphs.py); 0: eagerly, as longer ones do.
    max_prefill_graph_tokens: int = 1024
    # Greedy decode steps launched before the step in flight is read back (LLMEngine._step_ahead).
    async_scheduling: bool = False
    attention_backend: str | None = None  # "sdpa" or "triton"; None: triton on CUDA, sdpa on the CPU
    # KV tiers under the device pool (vLLM's names): GiB of host memory, 0 for none.
    kv_offloading_size: float = 0.0
    kv_offloading_backend: str | None = "native"  # the only one
    kv_offloading_mode: str = "eager"  # copy a block to the host when cached ("eager") or when evicted ("lazy")
    kv_disk_path: str | None = None  # a directory for the disk tier under the host tier
    kv_disk_size: float | None = None  # GiB the disk tier may hold
    tokenizer: str | None = None  # a directory with tokenizer.json; None: the model's
    chat_template: str | None = None  # a jinja template or a file holding one; None: the tokenizer's
    grammar_cache_bytes: int = 256 * 2**20  # compiled grammars kept (structured_output.GrammarCompiler)
    # What the node above runs in each tensor-parallel worker's process beside its steps (a decode node's
    # KV receiver for that rank's heads, a prefill node's sender of them): called there once the rank's KV
    # cache is built, as rank_service(rank, kv_cache, channel), `channel` a duplex multiprocessing connection
    # whose other end the driver holds (LLMEngine.rank_channels). It may return an ExportPut (tp_workers.py):
    # what gets that rank's own KV heads of an export (KVExport.own_heads). A picklable callable; None: nothing runs.
    rank_service: Callable | None = None
