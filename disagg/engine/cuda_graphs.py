"""DecodeGraphs: the decode forward captured as CUDA graphs, one per batch-size bucket.

A decode step of a large model launches hundreds of small kernels; replaying a graph launches
them as one. Buckets are 1, 2, 4, 8, 16, 32, then every 32 up to max_num_seqs, and the last batch
size of each decode attention split count (of every tensor-parallel rank); a batch is padded to the
next bucket with tokens at position -1, which the kernels skip. A graph fixes its attention's split
count, so without those edges a batch just past a power of two would run with the count made for its
bucket's size (on an H200, the 8B shape's attention over 4k contexts: 9 sequences 0.3 ms a step
slower, 17 0.6 ms, 33 1.5 ms; benchmarks/decode_splits.py). Captured from the largest bucket down
into one memory pool. Steps with prompt tokens run as PrefillGraphs (prefill_graphs.py) or eagerly.
"""

import logging
import time
from collections.abc import Callable
from functools import partial

import torch

from disagg.engine.layers.triton_attention import TritonAttention, TritonMetadata, split_count
from disagg.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def buckets(max_batch: int, *split_counts: Callable[[int], int]) -> list[int]:
    """The batch sizes to capture, with an edge wherever any of `split_counts` changes."""
    sizes = {b for b in (1, 2, 4, 8, 16) if b < max_batch} | set(range(32, max_batch, 32)) | {max_batch}
    for count in split_counts:
        sizes |= {b for b in range(1, max_batch) if count(b) != count(b + 1)}
    return sorted(sizes)


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, attention: TritonAttention, max_batch: int,
                 num_kv_heads_per_rank: list[int]):
        """`num_kv_heads_per_rank`: every tensor-parallel rank's number of KV heads. Ranks may hold different
        numbers (3 KV heads go 2 + 1), so their split counts change at different batches, yet all must
        capture the same buckets: each graph's all-reduces pair with the other ranks' graph of that size."""
        self.model = model
        self.attention = attention
        device = attention.kv_cache.kv.device
        self.input_ids = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.positions = torch.full((max_batch,), -1, dtype=torch.int32, device=device)
        self.rows = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.buckets = buckets(max_batch, *(partial(split_count, num_kv_heads=h, num_sms=attention.num_sms)
                                            for h in sorted(set(num_kv_heads_per_rank))))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        start = time.monotonic()
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = None
        with torch.inference_mode():
            for b in reversed(self.buckets):
                self._forward(b)  # compiles the kernels and settles the allocator outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[b] = self._forward(b)
                pool = graph.pool()
                self.graphs[b] = graph
        torch.cuda.synchronize(device)
        logger.info("captured %d decode CUDA graphs (batch %s) in %.1f s using %.0f MiB", len(self.buckets),
                    ",".join(map(str, self.buckets)), time.monotonic() - start,
                    (free_before - torch.cuda.mem_get_info(device)[0]) / 2**20)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _forward(self, b: int) -> torch.Tensor:
        meta = TritonMetadata(self.positions[:b], self.rows[:b], num_decodes=b,
                              num_splits=self.attention.num_splits(b))
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.attention, meta)
        return self.model.compute_logits(hidden).float()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] for n decodes (n <= max_batch); inputs on the device."""
        n = input_ids.shape[0]
        b = next(size for size in self.buckets if size >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.positions[n:b].fill_(-1)
        self.rows[:n].copy_(rows)
        self.graphs[b].replay()
        return self.logits[b][:n]
