"""`vllm serve` flags that `disagg serve` takes beyond its own, so that a vLLM user's command line starts.

Each one either does here what it does in vLLM (mapped onto a disagg setting), is accepted and
ignored where it changes nothing here (logged), or stops the start with one line that names the
flag and what to use instead: never argparse's "unrecognized arguments". The flags that disagg has
under vLLM's own names (--dtype, --max-model-len, ...) are defined with the engine's and server's
flags in cli.py; VLLM_FLAGS lists them all, and README's table of them is printed from the parser
(`python -m disagg.vllm_flags`; a test fails when the two differ). This module imports only argparse.
"""

import argparse
import logging
import re

logger = logging.getLogger(__name__)

# Every vLLM flag `disagg serve` takes, in README's order.
VLLM_FLAGS = (
    # the model
    "MODEL", "--model", "--served-model-name", "--revision", "--download-dir", "--tokenizer", "--tokenizer-mode",
    "--trust-remote-code", "--load-format", "--dtype", "--quantization", "--kv-cache-dtype", "--max-model-len",
    "--generation-config", "--override-generation-config", "--chat-template", "--seed",
    # memory and scheduling
    "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--swap-space", "--cpu-offload-gb", "--block-size",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill",
    "--no-enable-chunked-prefill", "--max-num-seqs", "--max-num-batched-tokens", "--scheduling-policy",
    "--enforce-eager", "--async-scheduling", "--max-seq-len-to-capture", "--kv-offloading-size",
    "--kv-offloading-backend",
    # parallelism
    "--tensor-parallel-size", "--disable-custom-all-reduce", "--pipeline-parallel-size", "--data-parallel-size",
    "--distributed-executor-backend",
    # disaggregation
    "--kv-transfer-config", "--kv-connector", "--kv-connector-extra-config",
    # the server
    "--host", "--port", "--api-key", "--ssl-keyfile", "--ssl-certfile", "--uvicorn-log-level",
    "--disable-uvicorn-access-log", "--disable-fastapi-docs", "--enable-log-requests", "--disable-log-requests",
    "--disable-log-stats", "--max-logprobs", "--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser",
    "--enable-lora", "--lora-modules", "--speculative-config", "--config",
)

# dest -> (flag, values accepted, why any other value stops the start)
REFUSED: dict[str, tuple[str, tuple, str]] = {}
# dest -> (flag, why it changes nothing here)
IGNORED: dict[str, tuple[str, str]] = {}


def refused(parser: argparse.ArgumentParser, *flags: str, reason: str, accepted: tuple = (None,),
            **kwargs) -> None:
    """A vLLM flag for a feature disagg does not have: parsed, so that the start stops with one line
    naming it; the `accepted` values ask for what disagg does anyway."""
    shown = [str(v) for v in accepted if v not in (None, False)]
    prefix = f"{' or '.join(shown)}: accepted; otherwise " if shown else ""
    action = parser.add_argument(*flags, default=None, help=f"{prefix}refused: {reason}", **kwargs)
    REFUSED[action.dest] = (flags[-1], accepted, reason)


def ignored(parser: argparse.ArgumentParser, *flags: str, reason: str, **kwargs) -> None:
    """A vLLM flag that changes nothing here: accepted, with a log line saying why."""
    action = parser.add_argument(*flags, default=None, help=f"accepted and ignored: {reason}", **kwargs)
    IGNORED[action.dest] = (flags[-1], reason)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """The vLLM flags of `disagg serve` that cli.py's engine and server flags do not already define."""
    parser.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                        help="the model, as the positional MODEL (vLLM's older spelling)")
    refused(parser, "--tokenizer-mode", accepted=(None, "auto", "hf"),
            reason="disagg reads the fast tokenizer (tokenizer.json) only")
    refused(parser, "--load-format", accepted=(None, "auto", "safetensors", "gguf"),
            reason="disagg reads safetensors directories and .gguf files; convert the weights to safetensors")
    refused(parser, "-q", "--quantization", reason="quantized weights are not built: serve an unquantized "
                                                   "(float32, bfloat16 or float16) checkpoint")
    refused(parser, "--kv-cache-dtype", accepted=(None, "auto"),
            reason="the KV cache is kept in the model's dtype (--dtype)")
    parser.add_argument("--generation-config", default="auto",
                        help="auto: the model's generation_config.json gives the defaults (temperature, top_p, "
                             "top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) of requests that "
                             "leave them out, as in vLLM; vllm: ignore it; or a directory holding one")
    parser.add_argument("--override-generation-config", default=None, metavar="JSON",
                        help='JSON of sampling defaults over --generation-config\'s, e.g. {"temperature": 0.5}')
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="the fraction of the GPU's total memory this process may use in all; the KV cache "
                             "gets what the weights and a step's activations leave (vLLM's meaning). Not with "
                             "--kv-cache-memory; ignored on the CPU, where --kv-cache-memory sizes the KV cache")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="bytes of KV cache, as --kv-cache-memory BYTES")
    parser.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                        help="GiB of host memory for KV blocks: the host KV tier, as --kv-offloading-size "
                             "(vLLM's default of 4 is not taken: no host tier unless asked)")
    refused(parser, "--cpu-offload-gb", accepted=(None, 0.0), type=float,
            reason="weights are not offloaded to host memory: serve a model that fits the device")
    parser.add_argument("--enable-chunked-prefill", action="store_true", default=None,
                        help="accepted: disagg always prefills long prompts in chunks of --max-num-batched-tokens")
    refused(parser, "--no-enable-chunked-prefill", dest="no_chunked_prefill", action="store_const", const=True,
            accepted=(None,),
            reason="disagg always prefills in chunks; set --max-num-batched-tokens to --max-model-len to prefill "
                   "whole prompts")
    refused(parser, "--scheduling-policy", accepted=(None, "fcfs"),
            reason="requests are scheduled first come, first served (fcfs) only")
    ignored(parser, "--max-seq-len-to-capture", type=int,
            reason="decode CUDA graphs are captured per batch size (up to --max-num-seqs), for every length")
    refused(parser, "-pp", "--pipeline-parallel-size", type=int, accepted=(None, 1),
            reason="pipeline parallelism is not built yet: serve a model that fits one GPU")
    refused(parser, "-dp", "--data-parallel-size", type=int, accepted=(None, 1),
            reason="run one node per GPU and put `disagg router --decode-nodes ...` in front of them")
    refused(parser, "--distributed-executor-backend", accepted=(None, "mp", "uni"),
            reason="a node's tensor-parallel ranks are its own process and worker processes it spawns (mp); "
                   "there is no Ray executor")
    parser.add_argument("--kv-connector", default=None,
                        help="kv_connector of --kv-transfer-config, given alone")
    parser.add_argument("--kv-connector-extra-config", default=None, metavar="JSON",
                        help="kv_connector_extra_config of --kv-transfer-config, given alone (merged into it)")
    refused(parser, "--ssl-keyfile", reason="TLS is not built: put a TLS proxy in front of the node")
    refused(parser, "--ssl-certfile", reason="TLS is not built: put a TLS proxy in front of the node")
    parser.add_argument("--uvicorn-log-level", default=None,
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="the HTTP server's log level (default: --log-level's)")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="accepted: the HTTP server keeps no access log anyway (--enable-log-requests logs "
                             "each request)")
    parser.add_argument("--disable-fastapi-docs", action="store_true",
                        help="accepted: /docs and /openapi.json are served only with --enable-docs")
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="no periodic stats line in the log (the KV tiers' summary every 5 s while busy)")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="the most logprobs (logprobs, top_logprobs, prompt_logprobs) a request may ask for; "
                             "at most 20, disagg's bound")
    parser.add_argument("--reasoning-parser", default=None,
                        help="the format of the model's reasoning: deepseek_r1 or qwen3 (<think>...</think>); chat "
                             "answers carry it as reasoning_content (and reasoning), responses as a reasoning item")
    refused(parser, "--enable-lora", action="store_const", const=True,
            reason="LoRA adapters are not built: merge the adapter into the weights and serve those")
    refused(parser, "--lora-modules", nargs="+",
            reason="LoRA adapters are not built: merge the adapter into the weights and serve those")
    refused(parser, "--speculative-config", reason="speculative decoding is not built: leave it out")


def check_vllm_flags(args: argparse.Namespace) -> None:
    """One ValueError line for a refused flag; a log line for each ignored one; the mapped ones set
    disagg's settings (args.model, args.kv_cache_memory, args.kv_offloading_size)."""
    for dest, (flag, accepted, reason) in REFUSED.items():
        value = getattr(args, dest, None)
        if value not in accepted:
            shown = "" if value is True else f" {' '.join(map(str, value)) if isinstance(value, list) else value}"
            raise ValueError(f"{flag}{shown}: {reason}")
    for dest, (flag, reason) in IGNORED.items():
        if getattr(args, dest, None) is not None:
            logger.info("%s is accepted and ignored: %s", flag, reason)
    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            raise ValueError(f"MODEL {args.model!r} and --model {args.model_flag!r} differ; give one")
        args.model = args.model_flag
    if args.kv_cache_memory_bytes is not None:
        if args.kv_cache_memory is not None:
            raise ValueError("give --kv-cache-memory or --kv-cache-memory-bytes, not both")
        if args.kv_cache_memory_bytes < 1:
            raise ValueError(f"--kv-cache-memory-bytes must be positive, got {args.kv_cache_memory_bytes}")
        args.kv_cache_memory = args.kv_cache_memory_bytes
    if args.swap_space is not None:
        if args.kv_offloading_size and args.kv_offloading_size != args.swap_space:
            raise ValueError(f"--swap-space {args.swap_space} and --kv-offloading-size {args.kv_offloading_size} "
                             "both size the host KV tier; give one")
        args.kv_offloading_size = args.swap_space
    if not 0 <= args.max_logprobs <= 20:  # SamplingParams' bound (MAX_LOGPROBS); vLLM's -1 (the vocabulary) too
        raise ValueError(f"--max-logprobs {args.max_logprobs}: requests may ask for 0 to 20 logprobs here")


def normalize_argv(argv: list[str]) -> list[str]:
    """vLLM's spelling freedom: --flag_name is --flag-name (its parser takes both)."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            key, eq, value = arg.partition("=")
            arg = "--" + key[2:].replace("_", "-") + eq + value
        out.append(arg)
    return out


def flag_table(parser: argparse.ArgumentParser) -> str:
    """README's table of vLLM's flags: each, and what disagg does with it (its help, with its default)."""
    formatter = parser._get_formatter()
    actions = {s: a for a in parser._actions for s in a.option_strings}
    actions["MODEL"] = next(a for a in parser._actions if a.dest == "model" and not a.option_strings)
    rows = ["| vLLM flag | what `disagg serve` does |", "|---|---|"]
    for flag in VLLM_FLAGS:
        action = actions[flag]
        text = formatter._expand_help(action) if action.help else ""
        text = re.sub(r"\s+", " ", text).replace("|", "\\|").replace("<", "&lt;")
        rows.append(f"| `{flag}` | {text} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    from disagg.cli import build_parser

    print(flag_table(build_parser()[1]), end="")
