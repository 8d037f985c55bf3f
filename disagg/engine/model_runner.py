"""ModelRunner: a scheduled batch -> the backend's step inputs -> model -> logits to sample."""

import logging
from collections.abc import Callable

import torch

from disagg.engine.layers.attention import AttentionBackend, StepInputs
from disagg.engine.models.llama import LlamaForCausalLM
from disagg.engine.sampler import Sampler, logprob_entries
from disagg.engine.scheduler import ScheduledSeq
from disagg.engine.sequence import Sequence, TokenLogprob
from disagg.engine.tp_workers import TPWorkers

logger = logging.getLogger(__name__)

# Prompt logprobs are computed this many positions at a time: [rows, vocab] float32 logits
# for a whole 2048-token chunk would take 400 MB with a 49k vocabulary.
PROMPT_LOGITS_ROWS = 256

# request id -> (index of the first prompt token scored, one entry per token from there)
PromptLogprobs = dict[str, tuple[int, list[TokenLogprob]]]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, attention: AttentionBackend, graphs, prefill_graphs,
                 max_model_len: int):
        """Made by builder.build_runner. max_model_len: the longest sequence its KV cache holds."""
        self.model = model
        self.attention = attention
        self.kv_cache = attention.kv_cache
        self.graphs = graphs  # DecodeGraphs on CUDA unless enforce_eager
        self.prefill_graphs = prefill_graphs  # PrefillGraphs, likewise: the steps with prompt tokens
        self.max_model_len = max_model_len
        self.workers: TPWorkers | None = None  # the driver's, under tensor parallelism (builder.build_runner)

    def run(self, batch: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], torch.Tensor, PromptLogprobs]:
        """Compute the batch's new tokens. Returns the batch in the order it ran, float32 logits
        [num_sampled, vocab] on the device for the sequences whose last token was computed, in
        that order, and the prompt logprobs of this step's chunks of sequences that ask for them
        (only then is anything beyond the sampled rows computed). Under tensor parallelism every
        rank runs it on the same batch (the driver sends it to the others first)."""
        return self._on_all_ranks("run", self._run, batch)

    def run_ahead(self, batch: list[ScheduledSeq], placeholders: torch.Tensor | None
                  ) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """A greedy decode step of async scheduling: the batch in the order it ran and the tokens it
        chose, left on the device. An input token -(i + 1) stands for row i of `placeholders`, the
        tokens the step before chose. Under tensor parallelism each rank keeps its own (the logits
        are all-gathered, so every rank chooses the same) and takes them from there."""
        return self._on_all_ranks("run_ahead", lambda b: self._run_ahead(b, placeholders), batch,
                                  placeholders is not None)

    def _run_ahead(self, batch: list[ScheduledSeq], placeholders: torch.Tensor | None
                   ) -> tuple[list[ScheduledSeq], torch.Tensor]:
        batch, logits, _ = self._run(batch, placeholders)
        return batch, Sampler.greedy_on_device(logits)

    def _on_all_ranks(self, method: str, run: Callable, batch: list[ScheduledSeq], placeholders: bool = False):
        if self.workers is None:
            return run(batch)
        self.workers.send(method, batch, placeholders)
        try:
            return run(batch)
        except BaseException as e:  # the other ranks may wait in a collective this one left
            self.workers.fail(f"the driver's forward raised {type(e).__name__}: {e}")
            raise

    def load_kv(self, block_ids: list[int], kv: torch.Tensor, start: int) -> None:
        """Write KV received from elsewhere, of every KV head ([layers, 2, tokens, kv heads, head dim]), into a
        sequence's blocks from token `start` on: this rank's heads here, and under tensor parallelism each
        worker's heads sent to it."""
        if self.workers is not None:
            self.workers.load_kv(block_ids, kv, start)
        first, end = self.model.shard.kv_heads
        self.kv_cache.scatter(block_ids, kv[:, :, :, first:end], start)

    def close(self) -> None:
        # The decode graphs first: collectives captured in them hold the group's NCCL communicator,
        # whose abort (TPGroup.close, every rank's) would wait for them.
        self.graphs = self.prefill_graphs = None
        if self.workers is not None:
            self.workers.stop(release=True)

    @torch.inference_mode()
    def _run(self, batch: list[ScheduledSeq], placeholders: torch.Tensor | None = None
             ) -> tuple[list[ScheduledSeq], torch.Tensor, PromptLogprobs]:
        batch = self.order(batch)
        inputs = self.attention.prepare(batch)
        if placeholders is not None:  # on the device: the host never waits for those tokens
            ids = inputs.input_ids
            inputs.input_ids = torch.where(ids < 0, placeholders.to(ids.dtype)[(-1 - ids).clamp(min=0)], ids)
        scoring = any(scores_prompt(item.seq) for item in batch)
        exports = [item for item in batch if exports_now(item)]
        decode_only = all(item.num_new_tokens == 1 for item in batch)
        if (self.graphs is not None and decode_only and not scoring and not exports
                and len(batch) <= self.graphs.max_batch):
            return batch, self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta.token_rows), {}
        after_layer = self._exporter(exports) if exports else None
        if self.prefill_graphs is not None and inputs.input_ids.shape[0] <= self.prefill_graphs.max_tokens:
            hidden = self.prefill_graphs.run(inputs, after_layer)
        else:
            hidden = self._forward(inputs, after_layer)
        logits = self.model.compute_logits(hidden[inputs.sample_rows]).float()
        return batch, logits, self._prompt_logprobs(batch, hidden) if scoring else {}

    def _prompt_logprobs(self, batch: list[ScheduledSeq], hidden: torch.Tensor) -> PromptLogprobs:
        result = {}
        row = 0  # the batch's tokens are the hidden rows, in batch order
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            # Position p's logits score token p + 1; the last prompt position's pick the first output token.
            count = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1) - start
            if seq.scores_prompt and count > 0:
                targets = torch.tensor(seq.token_ids[start + 1:start + 1 + count], device=hidden.device)
                entries = []
                for i in range(0, count, PROMPT_LOGITS_ROWS):
                    logits = self.model.compute_logits(hidden[row + i:row + min(count, i + PROMPT_LOGITS_ROWS)])
                    entries += logprob_entries(torch.log_softmax(logits.float(), dim=-1),
                                               targets[i:i + PROMPT_LOGITS_ROWS], seq.params.prompt_logprobs)
                result[seq.request_id] = (start + 1, entries)
            row += item.num_new_tokens
        return result

    def all_logits(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Float32 logits of every new token of the batch (a check of the prefill path)."""
        return self._on_all_ranks("all_logits", self._all_logits, batch)

    @torch.inference_mode()
    def _all_logits(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        hidden = self._forward(self.attention.prepare(self.order(batch)))
        return self.model.compute_logits(hidden).float()

    def _forward(self, inputs: StepInputs, after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, self.attention, inputs.meta, after_layer)

    def _exporter(self, items: list[ScheduledSeq]) -> Callable[[int], None]:
        """after_layer for a step that computes prompt tokens of `items` whose KV is exported: each group
        of layers' KV of the tokens not handed out yet goes to its KVExport as soon as the group has
        run, so it can travel while later layers compute (docs/ARCHITECTURE.md, "Layer-wise send")."""
        seqs, slots = [item.seq for item in items], []
        for item in items:
            export, end = item.seq.kv_export, item.seq.num_computed_tokens + item.num_new_tokens
            # Made once, before the forward: a host-to-device copy between two layers would wait for the
            # GPU to finish the work queued so far, so the host could no longer run ahead of it.
            slots.append(self.kv_cache.slots(item.seq.block_table, end)[max(export.start, export.sent):])
            export.sent = end

        firsts = [{end: first for first, end in seq.kv_export.layers} for seq in seqs]  # a group's end -> its first

        def after_layer(layer: int) -> None:
            for seq, rows, first_of in zip(seqs, slots, firsts):
                end = layer + 1
                first = first_of.get(end)
                if first is None:
                    continue
                kv = self.kv_cache.kv[first:end, :, rows]  # this rank's KV heads
                if not seq.kv_export.own_heads:
                    # Every KV head to the driver's put: a collective, so run by every rank even for an
                    # export that failed in this step (the ranks decided on the same exports before it).
                    kv = self.model.gather_kv_heads(kv)
                if seq.kv_export.failed:
                    continue
                try:
                    seq.kv_export.put(first, end, kv)
                except Exception:  # its receiver misses the later layers; the step goes on
                    logger.exception("handing out the KV of %s failed at layers %d-%d", seq.request_id, first, end)
                    seq.kv_export.failed = True
        return after_layer

    @staticmethod
    def order(batch: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Single-token segments first: the backends attend them together."""
        return [s for s in batch if s.num_new_tokens == 1] + [s for s in batch if s.num_new_tokens > 1]


def exports_now(item: ScheduledSeq) -> bool:
    """This step computes prompt tokens whose KV is exported and not handed out yet."""
    seq, export = item.seq, item.seq.kv_export
    end = seq.num_computed_tokens + item.num_new_tokens
    if export is None or export.failed or end > seq.num_prompt_tokens:
        return False
    if export.at_end and end < seq.num_prompt_tokens:
        return False
    return end > max(export.start, export.sent)


def scores_prompt(seq: Sequence) -> bool:
    """It is still to score its prompt, and some of the prompt is still to be computed."""
    return seq.scores_prompt and seq.num_computed_tokens < seq.num_prompt_tokens - 1

