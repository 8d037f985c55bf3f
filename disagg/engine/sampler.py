"""Sampler: logits -> next token per sequence (greedy, temperature, top-k/top-p/min-p)."""

import torch

from disagg.engine.sampling_params import SamplingParams
from disagg.engine.sequence import TokenLogprob


class Sampler:
    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)  # for requests without their own seed
        self.request_generators: dict[str, torch.Generator] = {}

    def generator_for(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.generator
        if request_id not in self.request_generators:
            self.request_generators[request_id] = torch.Generator().manual_seed(params.seed)
        return self.request_generators[request_id]

    def release(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[tuple[str, SamplingParams]]) -> list[tuple[int, TokenLogprob | None] | Exception]:
        """logits [B, vocab] float32; one (token, logprob) per request, in order."""
        if all(p.greedy and p.logprobs is None for _, p in requests):
            # On the device: one small copy of the chosen tokens instead of the whole logits.
            return [(token, None) for token in torch.argmax(logits, dim=-1).tolist()]
        logits = logits.cpu()
        logprobs = None
        if any(p.logprobs is not None for _, p in requests):
            logprobs = torch.log_softmax(logits, dim=-1)
        results = []
        for row, (request_id, params) in enumerate(requests):
            try:  # a row whose sampling raises gets the exception: the engine fails that request alone
                if params.greedy:
                    token = int(torch.argmax(logits[row]))
                else:
                    probs = filtered_probs(logits[row], params)
                    token = int(torch.multinomial(probs, 1, generator=self.generator_for(request_id, params)))
                info = None
                if params.logprobs is not None:
                    top = []
                    if params.logprobs > 0:
                        values, ids = torch.topk(logprobs[row], params.logprobs)
                        top = list(zip(ids.tolist(), values.tolist()))
                    info = TokenLogprob(token, float(logprobs[row, token]), top)
                results.append((token, info))
            except Exception as e:  # noqa: BLE001  handed to the engine, which fails this request
                results.append(e)
        return results


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
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()
