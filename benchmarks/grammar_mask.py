"""Per-token cost of grammar-constrained decoding: xgrammar vs llguidance, batch 32, on CPU or GPU.

Each of 32 requests follows the same JSON-schema answer, token by token, as a decode step
would: fill the batch's token bitmask (one row per request), apply it to [32, vocab] logits,
then advance each matcher by its request's token. Printed and written to
benchmarks/results/grammar_mask_{cpu,cuda}.json. The mask application is timed twice: the
library's own kernel and disagg's (torch, one batched masked_fill, as disagg/engine/sampler.py does).

With --device cuda the logits are on the GPU, as the sampler has them there: the bitmask is still
filled on the CPU (both libraries fill only CPU tensors), and each apply includes its copy to the
GPU; xgrammar's apply is then its Triton kernel, llguidance's its torch.compile'd function (Triton
too). Every timing waits for the GPU (torch.cuda.synchronize).

    python benchmarks/grammar_mask.py [--device cpu|cuda] [--model DIR | --tokenizer DIR] [--batch 32] [--repeats 3]
"""

import argparse
import importlib.metadata
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


def timed(fn, device: str = "cpu") -> float:
    """Seconds fn takes; on a GPU, until the work it queued there has finished."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def new_bitmask(batch: int, vocab: int) -> torch.Tensor:
    # As disagg's sampler allocates it (StructuredOutput.mask): plain CPU memory, every token allowed.
    return torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)


def run_xgrammar(model_dir: Path, tokens: list[int], batch: int, vocab: int, device: str) -> dict:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir), vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = new_bitmask(batch, vocab)
    logits = torch.randn(batch, vocab, device=device)

    def apply_lib() -> None:
        xgr.apply_token_bitmask_inplace(logits.clone(), bitmask.to(device))

    fill = apply_lib_s = apply_ours = accept = 0.0
    warm_up(apply_lib, logits, bitmask, device)
    for token in tokens:
        fill += timed(lambda: [m.fill_next_token_bitmask(bitmask, i) for i, m in enumerate(matchers)])
        apply_lib_s += timed(apply_lib, device)
        apply_ours += timed(lambda: apply_token_bitmask(logits.clone(), bitmask.to(device)), device)
        accept += timed(lambda: [m.accept_token(token) for m in matchers])  # noqa: B023  called in this iteration
    assert all(m.is_terminated() or m.accept_token(info.stop_token_ids[0]) for m in matchers)
    return summary("xgrammar", compile_s, len(tokens), fill, apply_lib_s, apply_ours, accept)


def run_llguidance(model_dir: Path, tokens: list[int], batch: int, vocab: int, device: str) -> dict:
    import llguidance
    import llguidance.torch

    tokenizer = llguidance.LLTokenizer(str(model_dir / "tokenizer.json"), n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    compile_s = timed(lambda: llguidance.LLMatcher(tokenizer, grammar))
    matchers = [llguidance.LLMatcher(tokenizer, grammar) for _ in range(batch)]
    bitmask = new_bitmask(batch, vocab)
    logits = torch.randn(batch, vocab, device=device)

    def apply_lib() -> None:
        llguidance.torch.apply_token_bitmask_inplace(logits.clone(), bitmask.to(device))

    fill = apply_lib_s = apply_ours = accept = 0.0
    warm_up(apply_lib, logits, bitmask, device)
    for token in tokens:
        fill += timed(lambda: [llguidance.torch.fill_next_token_bitmask(m, bitmask, i)
                               for i, m in enumerate(matchers)])
        apply_lib_s += timed(apply_lib, device)
        apply_ours += timed(lambda: apply_token_bitmask(logits.clone(), bitmask.to(device)), device)
        accept += timed(lambda: [m.consume_token(token) for m in matchers])  # noqa: B023  called in this iteration
    assert not any(m.is_error() for m in matchers), matchers[0].get_error()
    assert all(m.is_accepting() for m in matchers)
    return summary("llguidance", compile_s, len(tokens), fill, apply_lib_s, apply_ours, accept)


def warm_up(apply_lib, logits: torch.Tensor, bitmask: torch.Tensor, device: str) -> None:
    """Each apply once before timing: the first call compiles its kernel (Triton, torch.compile)."""
    apply_lib()
    apply_token_bitmask(logits.clone(), bitmask.to(device))
    synchronize(device)


def summary(library: str, compile_s: float, steps: int, fill: float, apply_lib: float, apply_ours: float,
            accept: float) -> dict:
    ms = 1000.0 / steps
    return {"library": library, "version": importlib.metadata.version(library),
            "compile_ms": round(compile_s * 1000, 2), "steps": steps,
            "fill_ms_per_step": round(fill * ms, 3), "apply_lib_ms_per_step": round(apply_lib * ms, 3),
            "apply_disagg_ms_per_step": round(apply_ours * ms, 3), "accept_ms_per_step": round(accept * ms, 3),
            "total_ms_per_step": round((fill + apply_ours + accept) * ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--tokenizer", default=None,
                        help="a directory with only tokenizer.json and tokenizer_config.json, instead of --model "
                             "(the benchmark needs no weights: carry this to a GPU machine)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the logits are")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="runs per library; the fastest is kept")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/grammar_mask_{device}.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = Path(args.tokenizer) if args.tokenizer else resolve_model(args.model)
    tokenizer = Tokenizer(model_dir)
    tokens = tokenizer.encode(ANSWER, add_special_tokens=False)
    vocab = tokenizer.vocab_size
    results = []
    for run in (run_xgrammar, run_llguidance):
        runs = [run(model_dir, tokens, args.batch, vocab, args.device) for _ in range(args.repeats)]
        results.append(min(runs, key=lambda r: r["total_ms_per_step"]))
        print(json.dumps(results[-1]))
    out = {"device": args.device, "cpu": platform.processor() or platform.machine(), "torch_threads": 1,
           "torch": torch.__version__, "batch": args.batch, "vocab": vocab, "answer_tokens": len(tokens),
           "schema": SCHEMA, "results": results}
    if args.device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    Path(args.out or f"benchmarks/results/grammar_mask_{args.device}.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
