"""CUDA correctness check of the engine against transformers, on one GPU.

    python benchmarks/gpu_check.py [--model DIR_OR_GGUF | --random-from DIR] [--json PATH]

(a) float32: logits of one ~200-token prompt (every position) within 1e-3 of transformers',
    and greedy outputs of 4 prompts (max_tokens 32) token-for-token equal;
(b) bfloat16: the engine runs; prints its greedy text and how far it agrees with float32.

--random-from DIR builds a Llama with DIR's config.json and random weights (seeded) when the
real weights cannot be had; outputs then are not text, but the comparison still holds.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from disagg import LLM, SamplingParams
from disagg.engine.loader import resolve_model

PARAGRAPH = (
    "Disaggregated serving splits the work of a language model into two phases that run on "
    "different machines. The prefill phase reads the whole prompt at once and is limited by "
    "compute; the decode phase produces one token at a time for many requests and is limited by "
    "memory bandwidth. Running them apart lets each pool of GPUs be sized for its own phase, and "
    "the key-value cache computed by prefill is shipped over a fast link to the decode node. ")
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Explain in one sentence why the sky is blue.",
]


def random_model(config_dir: Path, out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig.from_pretrained(config_dir)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (config_dir / name).exists():
            shutil.copy(config_dir / name, out / name)
    return out


def engine_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The engine's float32 logits for every prompt position, through its paged-KV prefill path."""
    engine = llm.engine
    engine.add_request("logits-check", ids, SamplingParams(temperature=0.0, max_tokens=1))
    logits = engine.runner.all_logits(engine.scheduler.schedule()).cpu()
    engine.abort_request("logits-check")
    return logits


def hf_greedy(model, ids: list[int], max_new: int, eos: list[int]) -> list[int]:
    x = torch.tensor([ids], device=model.device)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                         temperature=None, top_p=None, top_k=None, eos_token_id=eos, pad_token_id=eos[0])
    return out[0, len(ids):].tolist()


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--random-from", default=None)
    ap.add_argument("--random-out", default="/tmp/rand-llama")
    ap.add_argument("--device", default="cuda", help="cpu only for a smoke test of this script")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    if args.random_from:
        model_dir = random_model(Path(args.random_from), Path(args.random_out))
        weights = "random (seeded) weights, SmolLM2-135M shapes"
    else:
        model_dir = resolve_model(args.model)
        weights = f"real weights ({model_dir.name})"
    print(f"model: {model_dir} -- {weights}; {device_name(args.device)}; torch {torch.__version__}",
          flush=True)
    result = {"model_dir": str(model_dir), "weights": weights, "device": device_name(args.device)}

    # (a) float32 against transformers
    llm = LLM(model=str(model_dir), device=args.device, dtype="float32", kv_cache_memory=2 << 30)
    tok = llm.tokenizer
    long_ids = tok.encode(PARAGRAPH * 3)[:200]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([long_ids], device=args.device)).logits[0].float().cpu()
    ours = engine_logits(llm, long_ids)
    max_diff = float((ours - ref).abs().max())
    logits_ok = ours.shape == ref.shape and max_diff < 1e-3
    print(f"(a) fp32 logits, {len(long_ids)}-token prompt, all positions: max |diff| = {max_diff:.2e} "
          f"-> {'PASS' if logits_ok else 'FAIL'} (tolerance 1e-3)", flush=True)

    eos = sorted(llm.engine.tokenizer.eos_token_ids)
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=32))
    greedy = []
    with torch.inference_mode():
        for p, ids, out in zip(PROMPTS, prompt_ids, outs):
            theirs = hf_greedy(hf, ids, 32, eos)
            same = list(out.token_ids) == theirs
            first_diff = next((i for i, (a, b) in enumerate(zip(out.token_ids, theirs)) if a != b),
                              None if len(out.token_ids) == len(theirs) else min(len(out.token_ids), len(theirs)))
            greedy.append({"prompt": p, "equal": same, "first_diff": first_diff, "ours": list(out.token_ids),
                           "transformers": theirs, "text": out.text})
            print(f"(a) greedy {p!r}: {'EQUAL' if same else f'DIFFER at token {first_diff}'} "
                  f"({len(out.token_ids)} tokens) {out.text!r}", flush=True)
    fp32_tokens = [list(o.token_ids) for o in outs]
    del llm, hf
    if args.device == "cuda":
        torch.cuda.empty_cache()

    # (b) bfloat16 runs and is sane
    llm = LLM(model=str(model_dir), device=args.device, dtype="bfloat16", kv_cache_memory=2 << 30)
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=32))
    bf16 = []
    for p, out, ref_tokens in zip(PROMPTS, outs, fp32_tokens):
        agree = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref_tokens)) if a != b),
                     min(len(out.token_ids), len(ref_tokens)))
        bf16.append({"prompt": p, "text": out.text, "tokens_equal_to_fp32_prefix": agree})
        print(f"(b) bf16 {p!r} -> {out.text!r} (first {agree} tokens equal to fp32)", flush=True)
    bf16_ok = all(o.token_ids and all(0 <= t < llm.engine.model_config.vocab_size for t in o.token_ids) for o in outs)
    ours_bf16 = engine_logits(llm, long_ids)
    bf16_diff = float((ours_bf16 - ref).abs().max())
    bf16_finite = bool(torch.isfinite(ours_bf16).all())
    print(f"(b) bf16 logits vs fp32 transformers: max |diff| = {bf16_diff:.3f}, finite={bf16_finite}", flush=True)

    result.update(logits_max_diff=max_diff, logits_ok=logits_ok, greedy=greedy,
                  greedy_ok=all(g["equal"] for g in greedy), bf16=bf16, bf16_ok=bf16_ok and bf16_finite,
                  bf16_logits_max_diff=bf16_diff)
    print(f"\nSUMMARY  fp32 logits {'PASS' if logits_ok else 'FAIL'} ({max_diff:.1e})  "
          f"fp32 greedy {sum(g['equal'] for g in greedy)}/4 equal  "
          f"bf16 {'runs, finite' if result['bf16_ok'] else 'FAIL'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if logits_ok and result["greedy_ok"] and result["bf16_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
