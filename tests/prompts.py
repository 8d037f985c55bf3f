"""Prompts of mixed lengths for the correctness tests, and the transformers reference."""

import torch

PASSAGE = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels; later, stored programs let the same hardware run many tasks. Compilers "
    "turned symbolic code into machine instructions, operating systems shared one computer among "
    "many users, and networks joined computers into systems larger than any one of them. "
)
CODE = (
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    mid = len(items) // 2\n"
    "    left = merge_sort(items[:mid])\n    right = merge_sort(items[mid:])\n    out = []\n"
    "    while left and right:\n        out.append(left.pop(0) if left[0] <= right[0] else right.pop(0))\n"
    "    return out + left + right\n"
)

PROMPTS = [
    "Hello",
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4, 5,",
    "Explain what a KV cache is in one sentence:",
    CODE + "\n# Explain the function above:\n",
    PASSAGE * 3 + "\nSummarize the text above in one sentence:",
    "Q: What is 12 times 12?\nA:",
    PASSAGE * 10 + "\nWhat was the first topic mentioned?",
    (PASSAGE + CODE) * 9 + "\nWhat does merge_sort return?",
    "Translate to French: I would like a cup of coffee, please.",
]


_greedy_cache: dict[tuple[int, ...], tuple[int, list[int]]] = {}


def hf_greedy(hf_model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """transformers generate(), float32, greedy, one prompt at a time (no padding).

    Memoized across the session: a greedy answer of M tokens starts with the answer of m < M
    tokens, so a longer cached run answers a shorter request."""
    key = (id(hf_model), *prompt_ids)
    cached = _greedy_cache.get(key)
    if cached is not None and (cached[0] >= max_tokens or len(cached[1]) < cached[0]):
        return cached[1][:max_tokens]
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                                do_sample=False, pad_token_id=0)
    tokens = out[0, len(prompt_ids):].tolist()
    _greedy_cache[key] = (max_tokens, tokens)
    return tokens


def penalized_reference(hf_model, prompt_ids: list[int], max_tokens: int, repetition: float, presence: float,
                        frequency: float, bias: dict[int, float]) -> list[int]:
    """Greedy decoding from transformers' logits with vLLM's definitions written out: logit bias, then
    repetition over prompt and output, then frequency and presence over the output."""
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
        for token, value in bias.items():
            logits[token] += value
        output = ids[len(prompt_ids):]
        for token in set(ids):
            logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
        for token in set(output):
            logits[token] -= frequency * output.count(token) + presence
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids):]
