"""Sampler: logits -> next token per sequence (penalties and logit bias, then the grammar masks
of structured output, then greedy or temperature, top-k/top-p/min-p)."""

import torch

from disagg.engine.sampling_params import SamplingParams
from disagg.engine.sequence import Sequence, TokenLogprob
from disagg.engine.structured_output import Masks, StructuredOutput


class Sampler:
    def __init__(self, seed: int, eos_token_ids: set[int], structured: StructuredOutput):
        self.generator = torch.Generator().manual_seed(seed)  # for requests without their own seed
        self.request_generators: dict[str, torch.Generator] = {}
        self.eos_token_ids = sorted(eos_token_ids)
        self.structured = structured  # grammar matchers of the requests that have one

    def generator_for(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.generator
        if seq.request_id not in self.request_generators:
            self.request_generators[seq.request_id] = torch.Generator().manual_seed(seq.params.seed)
        return self.request_generators[seq.request_id]

    def release(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)
        self.structured.release(request_id)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 masks: Masks | None) -> list[tuple[int, TokenLogprob | None] | Exception]:
        """logits [B, vocab] float32, one row per sequence; one (token, logprob) per sequence, in order.
        `masks`: the grammar masks of these sequences, started before the forward (StructuredOutput.start).
        Logprobs are those of the model's own logits, before penalties and bias (vLLM's default)."""
        raw = logits
        if any(seq.params.processes_logits for seq in seqs):  # the neutral case pays nothing
            logits = self.processed(logits, seqs)
        logits = self.structured.mask(logits, seqs, masks)
        if all(seq.params.greedy and seq.params.logprobs is None for seq in seqs):
            # On the device: one small copy of the chosen tokens instead of the whole logits.
            return [(token, None) for token in self.greedy_on_device(logits).tolist()]
        logits = logits.cpu()
        logprobs = None
        if any(seq.params.logprobs is not None for seq in seqs):
            logprobs = torch.log_softmax(raw.cpu(), dim=-1)
        results = []
        for row, seq in enumerate(seqs):
            params = seq.params
            try:  # a row whose sampling raises gets the exception: the engine fails that request alone
                if params.greedy:
                    token = int(torch.argmax(logits[row]))
                else:
                    probs = filtered_probs(logits[row], params)
                    token = int(torch.multinomial(probs, 1, generator=self.generator_for(seq)))
                info = None
                if params.logprobs is not None:
                    info = logprob_entries(logprobs[row:row + 1], torch.tensor([token]), params.logprobs)[0]
                results.append((token, info))
            except Exception as e:  # noqa: BLE001  handed to the engine, which fails this request
                results.append(e)
        return results

    @staticmethod
    def greedy_on_device(logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of rows that need nothing else (no grammar, penalties or logprobs), left where
        the logits are: async scheduling reads them back a step later."""
        return torch.argmax(logits, dim=-1)

    def processed(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The batch's logits after min_tokens, logit_bias and the penalties, in vLLM's order,
        each applied to the whole batch at once (rows that do not use one get its neutral value)."""
        logits = logits.clone()
        device, vocab = logits.device, logits.shape[-1]
        rows, tokens, values = [], [], []
        for row, seq in enumerate(seqs):
            rows += [row] * len(seq.params.logit_bias)
            tokens += seq.params.logit_bias.keys()
            values += seq.params.logit_bias.values()
        if rows:
            logits.index_put_((torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                              torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)
        rows, tokens = [], []
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                stops = [t for t in seq.params.stop_token_ids if t < vocab]  # others never come anyway
                stops += [] if seq.params.ignore_eos else self.eos_token_ids
                rows += [row] * len(stops)
                tokens += stops
        if rows:
            logits[torch.tensor(rows, device=device), torch.tensor(tokens, device=device)] = float("-inf")
        params = [seq.params for seq in seqs]
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = token_counts([seq.token_ids for seq in seqs], vocab, device) > 0  # prompt and output
            penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalized, logits)
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            counts = token_counts([seq.output_token_ids for seq in seqs], vocab, device)
            frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
            presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
            logits = logits - frequency * counts - presence * (counts > 0)
        return logits


def token_counts(token_ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, vocab] float32: how often each token occurs in each row's list."""
    width = max(1, max(len(ids) for ids in token_ids))
    padded = torch.full((len(token_ids), width), vocab, dtype=torch.int64)  # padding counts in an extra column
    for row, ids in enumerate(token_ids):
        padded[row, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
    counts = torch.zeros(len(token_ids), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def logprob_entries(logprobs: torch.Tensor, targets: torch.Tensor, num_top: int) -> list[TokenLogprob]:
    """One entry per row of log-softmax `logprobs` [rows, vocab], for the token `targets` names."""
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    tops: list[list] = [[] for _ in chosen]
    if num_top > 0:
        values, ids = torch.topk(logprobs, num_top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(targets.tolist(), chosen, tops)]


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks, as vLLM applies them."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        # Said outright: a top_p below float32's smallest number (1e-300) is 0 there, and 0 >= 0
        # would drop every token, leaving nothing to sample (issue 24: a 500).
        drop[0] = False
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()
