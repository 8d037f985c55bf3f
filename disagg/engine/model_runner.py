"""ModelRunner: a scheduled batch -> the backend's step inputs -> model -> logits to sample."""

import torch

from disagg.engine.attention import AttentionBackend, StepInputs
from disagg.engine.models.llama import LlamaForCausalLM
from disagg.engine.scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, attention: AttentionBackend, graphs, max_model_len: int):
        """Made by builder.build_runner. max_model_len: the longest sequence its KV cache holds."""
        self.model = model
        self.attention = attention
        self.kv_cache = attention.kv_cache
        self.graphs = graphs  # DecodeGraphs on CUDA unless enforce_eager
        self.max_model_len = max_model_len

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """Compute the batch's new tokens. Returns the batch in the order it ran, and float32
        logits [num_sampled, vocab] on the device for the sequences whose last token was
        computed, in that order."""
        batch = self.order(batch)
        inputs = self.attention.prepare(batch)
        decode_only = all(item.num_new_tokens == 1 for item in batch)
        if self.graphs is not None and decode_only and len(batch) <= self.graphs.max_batch:
            return batch, self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta.token_rows)
        hidden = self._forward(inputs)
        return batch, self.model.compute_logits(hidden[inputs.sample_rows]).float()

    @torch.inference_mode()
    def all_logits(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Float32 logits of every new token of the batch (a check of the prefill path)."""
        hidden = self._forward(self.attention.prepare(self.order(batch)))
        return self.model.compute_logits(hidden).float()

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, self.attention, inputs.meta)

    @staticmethod
    def order(batch: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Single-token segments first: the backends attend them together."""
        return [s for s in batch if s.num_new_tokens == 1] + [s for s in batch if s.num_new_tokens > 1]
