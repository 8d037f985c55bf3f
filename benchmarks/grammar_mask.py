"""Per-token cost of grammar-constrained decoding on CPU: xgrammar vs llguidance, batch 32.

Each of 32 requests follows the same JSON-schema answer, token by token, as a decode step
would: fill the batch's token bitmask (one row per request), apply it to [32, vocab] logits,
then advance each matcher by its request's token. Printed and written to
benchmarks/results/grammar_mask_cpu.json. The mask application is timed twice: the library's
own CPU kernel and disagg's (torch, one batched masked_fill, as disagg/engine/sampler.py does).

    python benchmarks/grammar_mask.py [--model DIR] [--batch 32] [--repeats 3]
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from disagg.engine.loader import resolve_model
from disagg.engine.structured_output import apply_token_bitmask
from disagg.engine.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer"},
    "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}
ANSWER = '{"name": "Ada Lovelace, mathematician", "age": 36, "city": "London", "tags": ["math", "engines"]}'


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_xgrammar(model_dir: Path, tokens: list[int], batch: int, vocab: int) -> dict:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir), vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    logits = torch.randn(batch, vocab)
    fill = apply_lib = apply_ours = accept = 0.0
    for token in tokens:
        fill += timed(lambda: [m.fill_next_token_bitmask(bitmask, i) for i, m in enumerate(matchers)])
        apply_lib += timed(lambda: xgr.apply_token_bitmask_inplace(logits.clone(), bitmask))
        apply_ours += timed(lambda: apply_token_bitmask(logits.clone(), bitmask))
        accept += timed(lambda: [m.accept_token(token) for m in matchers])
    assert all(m.is_terminated() or m.accept_token(info.stop_token_ids[0]) for m in matchers)
    return summary("xgrammar", compile_s, len(tokens), fill, apply_lib, apply_ours, accept)


def run_llguidance(model_dir: Path, tokens: list[int], batch: int, vocab: int) -> dict:
    import llguidance
    import llguidance.torch

    tokenizer = llguidance.LLTokenizer(str(model_dir / "tokenizer.json"), n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    compile_s = timed(lambda: llguidance.LLMatcher(tokenizer, grammar))
    matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(batch)]
    bitmask = llguidance.torch.allocate_token_bitmask(batch, vocab)
    logits = torch.randn(batch, vocab)
    fill = apply_lib = apply_ours = accept = 0.0
    for token in tokens:
        fill += timed(lambda: [llguidance.torch.fill_next_token_bitmask(m, bitmask, i)
                               for i, m in enumerate(matchers)])
        apply_lib += timed(lambda: llguidance.torch.apply_token_bitmask_inplace(logits.clone(), bitmask))
        apply_ours += timed(lambda: apply_token_bitmask(logits.clone(), bitmask))
        accept += timed(lambda: [m.consume_token(token) for m in matchers])
    assert not any(m.is_error() for m in matchers), matchers[0].get_error()
    assert all(m.is_accepting() for m in matchers)
    return summary("llguidance", compile_s, len(tokens), fill, apply_lib, apply_ours, accept)


def summary(library: str, compile_s: float, steps: int, fill: float, apply_lib: float, apply_ours: float,
            accept: float) -> dict:
    ms = 1000.0 / steps
    return {"library": library, "compile_ms": round(compile_s * 1000, 2), "steps": steps,
            "fill_ms_per_step": round(fill * ms, 3), "apply_lib_ms_per_step": round(apply_lib * ms, 3),
            "apply_disagg_ms_per_step": round(apply_ours * ms, 3), "accept_ms_per_step": round(accept * ms, 3),
            "total_ms_per_step": round((fill + apply_ours + accept) * ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="runs per library; the fastest is kept")
    parser.add_argument("--out", default="benchmarks/results/grammar_mask_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer(model_dir)
    tokens = tokenizer.encode(ANSWER, add_special_tokens=False)
    vocab = tokenizer.vocab_size
    results = []
    for run in (run_xgrammar, run_llguidance):
        runs = [run(model_dir, tokens, args.batch, vocab) for _ in range(args.repeats)]
        results.append(min(runs, key=lambda r: r["total_ms_per_step"]))
        print(json.dumps(results[-1]))
    out = {"device": "cpu", "cpu": platform.processor() or platform.machine(), "torch_threads": 1,
           "batch": args.batch, "vocab": vocab, "answer_tokens": len(tokens), "schema": SCHEMA, "results": results}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
