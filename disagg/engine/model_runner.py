"""ModelRunner: a scheduled batch -> flat tensors -> model -> logits of the positions to sample."""

import torch

from disagg.engine.attention import AttentionMetadata, PrefillSegment
from disagg.engine.kv_cache import KVCache
from disagg.engine.models.llama import LlamaForCausalLM
from disagg.engine.scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Compute the batch's new tokens; return float32 logits [num_sampled, vocab] for
        the sequences whose last token was computed, in batch order (decodes first)."""
        input_ids, positions, meta, sample_rows = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        return self.model.compute_logits(hidden[sample_rows]).float()

    @staticmethod
    def order(batch: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Single-token segments first: they are attended together in one padded call."""
        return [s for s in batch if s.num_new_tokens == 1] + [s for s in batch if s.num_new_tokens > 1]

    def prepare(self, batch: list[ScheduledSeq]):
        """`batch` must be in `order()`: rows 0..num_decodes-1 are the single-token segments."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[torch.Tensor] = []
        sample_rows: list[int] = []
        decode_context: list[torch.Tensor] = []
        prefills: list[PrefillSegment] = []
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            row = len(ids)
            context = self.kv_cache.slots(seq.block_table, end)
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            slots.append(context[start:])
            if n == 1:
                assert not prefills, "single-token segments must come first"
                decode_context.append(context)
            else:
                prefills.append(PrefillSegment(row, n, end, None if start == 0 else context))
            if end == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
        decode_slots = decode_mask = None
        if decode_context:
            # Padding points at row 0 and is masked out; the cache is zeroed, so it holds no NaN.
            decode_slots = torch.nn.utils.rnn.pad_sequence(decode_context, batch_first=True)
            lengths = torch.tensor([len(c) for c in decode_context], device=self.device)
            width = decode_slots.shape[1]
            decode_mask = (torch.arange(width, device=self.device)[None, :] < lengths[:, None])[:, None, None, :]
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            num_decodes=len(decode_context),
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=prefills,
        )
        return (torch.tensor(ids, dtype=torch.int64, device=self.device),
                torch.tensor(pos, dtype=torch.int64, device=self.device), meta, sample_rows)
