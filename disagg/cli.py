"""`disagg` command line: generate (offline), later serve / router / bench."""

import argparse
import logging
import time

from disagg.engine.llm import LLM
from disagg.engine.sampling_params import SamplingParams

SAMPLE_PROMPTS = [
    "What is disaggregated prefill in LLM serving?",
    "Write a haiku about the sea.",
    "Give three tips for writing clear code.",
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="local Hugging Face model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if present)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or auto")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output in tokens")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences per batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (longer prompts are chunked)")
    parser.add_argument("--kv-cache-memory", type=parse_memory, default=None,
                        help="KV cache size: bytes (e.g. 2GiB) or a fraction of free memory (e.g. 0.8)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    parser.add_argument("--seed", type=int, default=0, help="seed for requests that set none")


def parse_memory(text: str) -> int | float:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    for suffix, scale in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * scale)
    value = float(lowered)
    return value if value <= 1.0 else int(value)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
                enable_prefix_caching=not args.no_prefix_caching, seed=args.seed)


def generate(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    print(f"loaded {llm.engine.model_dir.name} on {llm.engine.device} in {time.perf_counter() - start:.1f}s")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    conversations = [[{"role": "user", "content": p}] for p in (args.prompt or SAMPLE_PROMPTS)]
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    elapsed = time.perf_counter() - start
    for conversation, out in zip(conversations, outputs):
        print(f"\n> {conversation[0]['content']}\n{out.text.strip()}")
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"\n{len(outputs)} completions, {tokens} tokens in {elapsed:.2f}s ({tokens / elapsed:.1f} tokens/s)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="disagg", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation with the engine, printed with timings")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a user message (repeatable; default: three samples)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args.func = {"generate": generate}[args.command]
        args.func(args)
    except ValueError as e:
        parser.exit(2, f"disagg: error: {e}\n")


if __name__ == "__main__":
    main()
