"""PrefillGraphs: steps with prompt tokens run as CUDA graphs of the pieces between attentions.

An eager forward launches about 11 kernels a layer from Python, and a prompt of a few hundred tokens
takes the GPU less time than the host takes to launch them: on an H200 an eager step of the 8B shape
took 16 ms for anything up to 512 prompt tokens, where 256 tokens' kernels take 7.6 (BENCHMARKS.md,
"Steps with prompt tokens").
Attention depends on the step's segments (how many query tiles, which contexts), which a graph cannot
fix; everything between two attentions depends only on the step's token count. So, as vLLM's
piecewise graphs do, each bucket of token counts is captured as num_layers + 1 graphs: the first embeds
and runs layer 0 up to its attention (its K and V stored, its queries copied to a buffer), each next one
a layer's output projection and MLP and the next layer up to its attention, the last one the final
norm; attention runs eagerly between them with the step's own metadata, reading that buffer and
writing the one the next piece reads. A step of n tokens runs in the smallest bucket of at least n,
its padding tokens at position -1 (stored nowhere, attended by nothing; their rows are never read).
All buckets share one memory pool and the two buffers: a step replays its pieces in the order they
were captured, and one step runs at a time.
"""

import contextlib
import gc
import logging
import time
from collections.abc import Callable

import torch

from disagg.engine.layers.attention import StepInputs
from disagg.engine.layers.triton_attention import TritonAttention, TritonMetadata
from disagg.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def buckets(max_tokens: int) -> list[int]:
    """Token counts to capture: powers of two to 64, then every 64; and max_tokens. Padding a step to the
    next one costs at most 63 rows: where a step is bound by its products (an 8B model on an H200 from
    about 700 tokens, where graphs and eager steps take the same time) that is up to 8% more at 768;
    below, where the launches bound an eager step, the graphs' step is shorter whatever the padding."""
    sizes = {8, 16, 32, 64} | set(range(128, max_tokens, 64))
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


class _Cut:
    """The attention backend's stand-in while one bucket's forward runs to be captured: at each layer's
    attention it stores the K and V, copies the queries to the shared buffer, ends the piece being
    captured and begins the next; the attention's output is the shared buffer the next piece reads."""

    def __init__(self, graphs: "PrefillGraphs", n: int, capture: bool):
        self.graphs, self.n, self.capture = graphs, n, capture
        self.pieces: list[torch.cuda.CUDAGraph] = []
        if capture:
            self.begin()

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TritonMetadata) -> torch.Tensor:
        self.graphs.attention.store(layer, k, v, meta)
        self.graphs.queries[:self.n].copy_(q)
        if self.capture:
            self.end()
            self.begin()
        return self.graphs.out[:self.n]

    def begin(self) -> None:
        self.pieces.append(torch.cuda.CUDAGraph())
        self.pieces[-1].capture_begin(pool=self.graphs.pool)

    def end(self) -> None:
        self.pieces[-1].capture_end()
        if self.graphs.pool is None:
            self.graphs.pool = self.pieces[-1].pool()

    def abandon(self) -> None:
        """After a failure inside the forward: end the capture under way, so that the failure, not a
        stream left capturing, is what the caller sees."""
        if torch.cuda.is_current_stream_capturing():
            with contextlib.suppress(RuntimeError):
                self.pieces[-1].capture_end()


class PrefillGraphs:
    def __init__(self, model: LlamaForCausalLM, attention: TritonAttention, max_tokens: int):
        self.model = model
        self.attention = attention
        device = attention.kv_cache.kv.device
        dtype = attention.kv_cache.kv.dtype
        shard, head_dim = model.shard, model.config.head_dim
        self.num_layers = model.config.num_hidden_layers
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.positions = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.rows = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.queries = torch.zeros(max_tokens, shard.num_heads, head_dim, dtype=dtype, device=device)
        self.out = torch.zeros_like(self.queries)
        self.buckets = buckets(max_tokens)
        self.pool = None
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each bucket's final hidden states, written by its last piece
        start = time.monotonic()
        free_before = torch.cuda.mem_get_info(device)[0]
        stream = torch.cuda.Stream(device)  # a capture needs a stream other than the default one
        with torch.inference_mode():
            for n in reversed(self.buckets):  # the largest first: the smaller ones reuse its memory
                # Warmed up on the engine's stream (the kernels compiled, the allocator settled), where
                # eager steps reuse what it freed; captured, as torch.cuda.graph does, after a sync and a
                # collection, so that no finalizer frees CUDA memory during the capture.
                self._forward(_Cut(self, n, capture=False), n)
                torch.cuda.synchronize(device)
                gc.collect()
                with torch.cuda.stream(stream):
                    cut = _Cut(self, n, capture=True)
                    try:
                        self.hidden[n] = self._forward(cut, n)
                        cut.end()
                    except BaseException:
                        cut.abandon()
                        raise
                self.pieces[n] = cut.pieces
        torch.cuda.synchronize(device)
        logger.info("captured prefill CUDA graphs for %d token counts (%s), %d pieces each, in %.1f s using %.0f MiB",
                    len(self.buckets), ",".join(map(str, self.buckets)), self.num_layers + 1,
                    time.monotonic() - start, (free_before - torch.cuda.mem_get_info(device)[0]) / 2**20)

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def _forward(self, cut: _Cut, n: int) -> torch.Tensor:
        meta = TritonMetadata(self.positions[:n], self.rows[:n], num_decodes=0, num_splits=1)
        return self.model(self.input_ids[:n], self.positions[:n], cut, meta)

    def run(self, inputs: StepInputs, after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """The final hidden states [n, hidden] of a step of n <= max_tokens tokens; after_layer(i) as in
        the model's forward (layer i's K and V are stored by the piece that ends at its attention)."""
        n = inputs.input_ids.shape[0]
        size = next(s for s in self.buckets if s >= n)
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.positions[n:size].fill_(-1)
        self.rows[:n].copy_(inputs.meta.token_rows)
        pieces = self.pieces[size]
        for layer in range(self.num_layers):
            pieces[layer].replay()
            self.attention.attend(layer, self.queries[:n], self.out[:n], inputs.meta)
            if after_layer is not None:
                after_layer(layer)
        pieces[-1].replay()
        return self.hidden[size][:n]
