"""`disagg` command line: serve (prefill, decode or colocated node) and generate (offline).

Building the parser imports no torch (nor the servers): `disagg --help`, `disagg router` and
`disagg bench` never load it; `serve` and `generate` import the engine when they run."""

import argparse
import asyncio
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import NoReturn

from disagg.api.reasoning import REASONING_PARSERS
from disagg.api.tool_calls import TOOL_CALL_PARSERS
from disagg.config import ROLES, KVTransferConfig
from disagg.help_format import HelpFormatter
from disagg.hosts import is_loopback
from disagg.http_limits import HTTPLimits, add_http_limit_args
from disagg.router import DEFAULT_MAX_REQUEST_BODY_BYTES
from disagg.vllm_flags import add_vllm_flags, check_vllm_flags, normalize_argv

logger = logging.getLogger(__name__)

MAX_NUM_SEQS = 64  # --max-num-seqs' default
BATCHED_TOKENS = 2048  # --max-num-batched-tokens' default: prompt chunks short enough to keep decodes moving
PREFILL_NODE_BATCHED_TOKENS = 8192  # a prefill node's on a GPU, where no decode batch waits (see serve)
SAMPLE_PROMPTS = [
    "What is disaggregated prefill in LLM serving?",
    "Write a haiku about the sea.",
    "Give three tips for writing clear code.",
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="a local Hugging Face model directory, a .gguf file, or a Hugging Face Hub id (ORG/NAME: "
                             "found in the Hugging Face cache or downloaded, as vLLM does) (default: the embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if present)")
    parser.add_argument("--dtype", default=None,
                        help="float32 (float), bfloat16, float16 (half), or auto: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output in tokens")
    parser.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS, help="sequences per batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help=f"tokens per step (longer prompts are chunked); default {BATCHED_TOKENS}, and "
                             f"{PREFILL_NODE_BATCHED_TOKENS} on a prefill node on a GPU")
    parser.add_argument("--kv-cache-memory", type=parse_memory, default=None,
                        help="KV cache size: bytes (e.g. 2GiB) or a fraction of free memory (e.g. 0.8)")
    parser.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True,
                        help="reuse the KV of prompt prefixes computed before (on by default, as in vLLM)")
    parser.add_argument("--no-enable-prefix-caching", "--no-prefix-caching", dest="enable_prefix_caching",
                        action="store_false", help="turn the prefix cache off")
    parser.add_argument("--seed", type=int, default=0, help="seed for requests that set none")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="CUDA: no CUDA graphs (decode steps, and steps with prompt tokens of up to 1,024 "
                             "tokens, run eagerly)")
    parser.add_argument("--max-prefill-graph-tokens", type=int, default=1024, metavar="N",
                        help="CUDA: steps with prompt tokens of up to N tokens in all replay CUDA graphs of the "
                             "pieces between attentions (captured at start); longer ones, or all with 0, run "
                             "eagerly (default: 1024)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="launch each greedy decode step before reading back the one in flight, so the host's "
                             "work overlaps the GPU's (off by default)")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="shard the model over N ranks (Megatron-style): this process and N-1 worker processes "
                             "it spawns, on GPUs DEVICE..DEVICE+N-1 (NCCL), or all on the CPU (gloo); prefill "
                             "and decode nodes may differ in it")
    parser.add_argument("--disable-custom-all-reduce", action="store_true",
                        help="tensor parallelism on CUDA: every all-reduce through NCCL (by default they go over "
                             "symmetric memory: a decode step's summed with the norm after it in one kernel, a "
                             "prefill's two-shot)")
    parser.add_argument("--attention-backend", choices=["sdpa", "triton"], default=None,
                        help="default: triton on CUDA, sdpa on the CPU")
    parser.add_argument("--kv-offloading-size", type=float, default=0.0,
                        help="GiB of host memory (pinned on CUDA) for a KV tier under the device cache; 0: none")
    parser.add_argument("--kv-offloading-backend", default="native",
                        help="KV offloading backend: native (the only one)")
    parser.add_argument("--kv-offloading-mode", default="eager",
                        help="copy a KV block to the host tier when it is full (eager) or "
                             "when the device evicts it (lazy)")
    parser.add_argument("--kv-disk-path", default=None,
                        help="directory of a disk KV tier under the host tier (kept across restarts)")
    parser.add_argument("--kv-disk-size", type=float, default=None, help="GiB the disk KV tier may hold")
    parser.add_argument("--tokenizer", default=None,
                        help="directory with tokenizer.json (and tokenizer_config.json) to use instead of the model's")
    parser.add_argument("--chat-template", default=None,
                        help="chat template to use instead of the tokenizer's: a file, or the jinja template itself")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="accepted for vLLM's command lines and ignored: disagg runs "
                             "no code from the model directory")
    parser.add_argument("--revision", default=None,
                        help="the branch, tag or commit of a MODEL given as a Hugging Face Hub id (ORG/NAME)")
    parser.add_argument("--download-dir", default=None,
                        help="the Hugging Face cache that Hub models are found in and downloaded to "
                             "(default: $HF_HUB_CACHE)")


def parse_memory(text: str) -> int | float:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    for suffix, scale in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * scale)
    value = float(lowered)
    return value if value <= 1.0 else int(value)


def prefill_node_on_gpu(args: argparse.Namespace, kv_role: str) -> bool:
    if kv_role != "producer" or (args.device or "cuda").split(":")[0] != "cuda":
        return False
    import torch

    return torch.cuda.is_available()


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens or BATCHED_TOKENS,
                kv_cache_memory=args.kv_cache_memory,
                gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None),
                enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
                tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
                max_prefill_graph_tokens=args.max_prefill_graph_tokens,
                disable_custom_all_reduce=args.disable_custom_all_reduce, async_scheduling=args.async_scheduling,
                attention_backend=args.attention_backend,
                kv_offloading_size=args.kv_offloading_size, kv_offloading_backend=args.kv_offloading_backend,
                kv_offloading_mode=args.kv_offloading_mode, kv_disk_path=args.kv_disk_path,
                kv_disk_size=args.kv_disk_size, tokenizer=args.tokenizer, chat_template=args.chat_template)


def local_model(args: argparse.Namespace) -> str | None:
    """MODEL as the engine opens it: a Hugging Face Hub id is found in the cache or downloaded first
    (at --revision, into --download-dir)."""
    from disagg.engine.loader import is_hub_id, resolve_model

    if args.model is None or not is_hub_id(args.model):
        return args.model
    return str(resolve_model(args.model, args.revision, args.download_dir))


def generate(args: argparse.Namespace) -> None:
    from disagg.engine.llm import LLM
    from disagg.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(**engine_kwargs(args) | {"model": local_model(args)})
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


# Secrets may come from the environment instead of the command line, where `ps` shows them.
API_KEY_ENV = "DISAGG_API_KEY"  # for --api-key
KV_AUTH_TOKEN_ENV = "DISAGG_KV_AUTH_TOKEN"  # for kv_connector_extra_config.auth_token
SWITCH_INTERVAL_S = 0.0005  # a served node's GIL switch interval (see serve)
# A decode node given no --prefill-nodes asks the prefill node on this host at its default --grpc-port,
# so that vLLM's 1P1D command lines (two nodes on one host, a role each in kv_role) start unchanged.
LOCAL_PREFILL_NODE = "127.0.0.1:50051"


def transfer_config(args: argparse.Namespace) -> KVTransferConfig:
    """--kv-transfer-config JSON (with --kv-connector and --kv-connector-extra-config folded in; vLLM's
    connector names mapped onto pipes and tiers); --kv-role sets kv_role, and must agree with one the
    JSON gives. The auth token comes from $DISAGG_KV_AUTH_TOKEN when the JSON has none."""
    from disagg.vllm_connectors import merge_fields

    text = merge_fields(args.kv_transfer_config, getattr(args, "kv_connector", None),
                        getattr(args, "kv_connector_extra_config", None))
    kv = KVTransferConfig.from_json(text) if text else KVTransferConfig()
    if kv.extra("auth_token") is None and os.environ.get(KV_AUTH_TOKEN_ENV):
        kv.kv_connector_extra_config["auth_token"] = os.environ[KV_AUTH_TOKEN_ENV]
    if args.kv_role:
        role = ROLES[args.kv_role]
        if text and "kv_role" in json.loads(text) and kv.kv_role != role:
            raise ValueError(f"--kv-role {args.kv_role} disagrees with kv_role {kv.kv_role!r} in --kv-transfer-config")
        kv.kv_role = role
    apply_kv_tiers(args, kv)
    return kv


def apply_kv_tiers(args: argparse.Namespace, kv: KVTransferConfig) -> None:
    """The KV tiers a vLLM connector asked for (OffloadingConnector, LMCache...) set the engine's tier
    flags; a flag given too must agree."""
    defaults = {"kv_offloading_size": 0.0, "kv_offloading_mode": "eager", "kv_disk_path": None, "kv_disk_size": None}
    for name, default in defaults.items():
        wanted = getattr(kv.tiers, name)
        if wanted is None:
            continue
        given = getattr(args, name)
        if given != default and given != wanted:
            raise ValueError(f"--{name.replace('_', '-')} {given} disagrees with the {wanted} that "
                             "--kv-transfer-config's connector asks for; give one")
        setattr(args, name, wanted)
    if kv.tiers.asks() and not args.kv_offloading_size:
        raise ValueError("--kv-transfer-config names an offloading connector but no host memory for it: give "
                         "kv_connector_extra_config.cpu_bytes_to_use or --kv-offloading-size GIB")


def check_engine_args(args: argparse.Namespace) -> str:
    """Every engine flag, without loading anything: a ValueError names the flag. Returns where the
    model comes from."""
    from disagg.engine.builder import (
        GPU_MEMORY_UTILIZATION_ON_CPU,
        check_memory_settings,
        resolve_device,
        resolve_dtype,
    )
    from disagg.engine.config import EngineConfig
    from disagg.engine.kv_tiers.offload import check_kv_tiers
    from disagg.engine.loader import DEFAULT_MODEL_NAME, check_hub_model, is_hub_id, resolve_model
    from disagg.engine.tokenizer import load_chat_template

    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise ValueError(f"--device: {e}") from None
    try:
        resolve_dtype(args.dtype, device)
    except ValueError as e:
        raise ValueError(f"--dtype: {e}") from None
    for flag in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}")
    if args.tensor_parallel_size > 1 and args.kv_offloading_size:
        raise ValueError("--kv-offloading-size with --tensor-parallel-size > 1: KV tiers under tensor parallelism "
                         "are not built yet")
    if args.grammar_cache_mb <= 0:
        raise ValueError(f"--grammar-cache-mb must be > 0, got {args.grammar_cache_mb}")
    gpu_memory_utilization = getattr(args, "gpu_memory_utilization", None)
    check_memory_settings(args.kv_cache_memory, gpu_memory_utilization)
    if gpu_memory_utilization is not None and device.type != "cuda" and args.check_config:
        logger.warning(GPU_MEMORY_UTILIZATION_ON_CPU)
    try:
        check_kv_tiers(EngineConfig(**engine_kwargs(args)))
    except ValueError as e:  # named as the flags are
        raise ValueError(re.sub(r"\bkv_[a-z_]+", lambda m: "--" + m.group().replace("_", "-"), str(e))) from None
    where = DEFAULT_MODEL_NAME if args.model is None else args.model
    if args.model is not None and is_hub_id(args.model):
        where = check_hub_model(args.model, args.revision, args.download_dir)  # downloads nothing
    elif args.model is not None and not Path(args.model).expanduser().is_file():
        try:
            resolve_model(args.model)  # a directory is checked for what the engine needs; a .gguf only exists
        except ValueError as e:
            raise ValueError(f"MODEL: {e}") from None
    elif args.model is not None and not args.model.endswith(".gguf"):
        raise ValueError(f"MODEL: {args.model!r} is a file but not a .gguf file; pass a .gguf file or a "
                         "Hugging Face model directory")
    if args.tokenizer is not None and not (Path(args.tokenizer).expanduser() / "tokenizer.json").is_file():
        raise ValueError(f"--tokenizer: {args.tokenizer!r} is not a directory with a tokenizer.json")
    if args.chat_template is not None:
        load_chat_template(args.chat_template)  # its ValueError names the flag
    if args.trust_remote_code:
        logger.info("--trust-remote-code is accepted and ignored: disagg runs no code from the model directory")
    return where


def check_serve_args(args: argparse.Namespace, kv: KVTransferConfig) -> list[str]:
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be at least 0 seconds, got {args.shutdown_timeout}")
    if args.tool_call_parser not in (None, *TOOL_CALL_PARSERS):  # a --config file's value is not checked by argparse
        raise ValueError(f"--tool-call-parser {args.tool_call_parser}: the parsers built are "
                         f"{', '.join(TOOL_CALL_PARSERS)}")
    if args.reasoning_parser not in (None, *REASONING_PARSERS):
        raise ValueError(f"--reasoning-parser {args.reasoning_parser}: the parsers built are "
                         f"{', '.join(REASONING_PARSERS)}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be at least 1, got {args.max_request_body_bytes}")
    HTTPLimits.from_args(args)  # its ValueError names the flag
    if len(served_model_names(args)) > 1:
        raise ValueError(f"--served-model-name {' '.join(served_model_names(args))}: one name is served (aliases "
                         "are not built yet); give one")
    if args.override_generation_config is not None:
        generation_overrides(args)  # its ValueError names the flag
    profiler_dir(args)  # its ValueError names the flag
    if args.generation_config not in ("auto", "vllm") and not Path(args.generation_config).expanduser().is_dir():
        raise ValueError(f"--generation-config {args.generation_config!r} is none of auto, vllm or a directory")
    prefill_nodes = [a.strip() for a in (args.prefill_nodes or "").split(",") if a.strip()]
    if kv.kv_role == "consumer" and not prefill_nodes:
        logger.info("no --prefill-nodes: this decode node asks the prefill node on this host (%s)", LOCAL_PREFILL_NODE)
        prefill_nodes = [LOCAL_PREFILL_NODE]
    if kv.kv_role != "consumer" and prefill_nodes:
        raise ValueError(f"--prefill-nodes is for consumer nodes; this node's kv_role is {kv.kv_role!r}")
    for address in prefill_nodes:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--prefill-nodes entry {address!r} is not HOST:PORT")
    exposed = node_ports_off_loopback(args, kv)
    if exposed and kv.extra("auth_token") is None and not args.insecure:
        raise ValueError(f"this node serves other nodes on {exposed} with no kv_connector_extra_config.auth_token: "
                         f"anyone who reaches it could run prefills or send KV; give every node the same token "
                         f"(or ${KV_AUTH_TOKEN_ENV}), or pass --insecure on a network you trust")
    return prefill_nodes


def node_ports_off_loopback(args: argparse.Namespace, kv: KVTransferConfig) -> str | None:
    """Where a prefill node's gRPC or a decode node's pipe listens beyond this machine, if it does."""
    if kv.kv_role == "producer" and not is_loopback(args.host):
        return f"gRPC {args.host}:{args.grpc_port}"
    if kv.kv_role == "consumer" and (kv.kv_connector == "ucx" or not is_loopback(kv.kv_ip)):
        return f"the {kv.kv_connector} pipe {'every interface (ucx)' if kv.kv_connector == 'ucx' else kv.kv_ip}"
    return None


def served_model_names(args: argparse.Namespace) -> list[str]:
    names = args.served_model_name  # a list from the command line, a string from $DISAGG_SERVED_MODEL_NAME
    return [names] if isinstance(names, str) else list(names or [])


def served_model_name(args: argparse.Namespace) -> str:
    """--served-model-name, else a Hub id as given (as vLLM names it), a local path's last part, or the
    embedded model's name."""
    from disagg.engine.loader import DEFAULT_MODEL_NAME, is_hub_id

    if served_model_names(args):
        return served_model_names(args)[0]
    if args.model is None:
        return DEFAULT_MODEL_NAME
    return args.model if is_hub_id(args.model) else Path(args.model).name


def profiler_dir(args: argparse.Namespace) -> str | None:
    """Where /stop_profile writes its traces: --profiler-config's torch_profiler_dir, else
    $VLLM_TORCH_PROFILER_DIR (vLLM's older way), else None (no profiler endpoints)."""
    if args.profiler_config is None:
        return os.environ.get("VLLM_TORCH_PROFILER_DIR") or None
    try:
        config = json.loads(args.profiler_config)
    except json.JSONDecodeError as e:
        raise ValueError(f"--profiler-config is not valid JSON: {e}") from None
    if not isinstance(config, dict) or not config.get("torch_profiler_dir"):
        raise ValueError('--profiler-config must be a JSON object with "torch_profiler_dir"')
    if config.get("profiler", "torch") != "torch":
        raise ValueError(f"--profiler-config: profiler {config['profiler']!r} is not built here; use \"torch\"")
    unknown = sorted(set(config) - {"profiler", "torch_profiler_dir"})
    if unknown:
        raise ValueError(f"--profiler-config: {', '.join(unknown)} not built here; give profiler and "
                         "torch_profiler_dir")
    return config["torch_profiler_dir"]


def generation_overrides(args: argparse.Namespace) -> dict:
    try:
        overrides = json.loads(args.override_generation_config)
    except json.JSONDecodeError as e:
        raise ValueError(f"--override-generation-config is not valid JSON: {e}") from None
    if not isinstance(overrides, dict):
        raise ValueError("--override-generation-config must be a JSON object")
    return overrides


def sampling_options(args: argparse.Namespace, model_dir: Path):
    """--generation-config (the model's generation_config.json, vllm: none, or a directory's),
    --override-generation-config over it, and --max-logprobs: what the API applies to each request."""
    from disagg.api.protocol import ServerSamplingOptions
    from disagg.engine.loader import generation_defaults

    defaults = {}
    if args.generation_config != "vllm":
        directory = model_dir if args.generation_config == "auto" else Path(args.generation_config).expanduser()
        defaults = generation_defaults(directory)
    if args.override_generation_config is not None:
        defaults |= generation_defaults(None, generation_overrides(args))
    if defaults:
        logger.info("sampling defaults from the generation config (for requests that leave them out): %s", defaults)
    return ServerSamplingOptions(defaults=defaults, max_logprobs=args.max_logprobs)


def serve(args: argparse.Namespace) -> None:
    check_vllm_flags(args)
    kv = transfer_config(args)
    if args.max_num_batched_tokens is None and prefill_node_on_gpu(args, kv.kv_role):
        # No decode batch waits behind a prefill node's chunks, and a prompt computed in one chunk sends
        # its KV in one chunk's parts: a 4k prompt in two chunks waited 100-160 ms longer for its KV on
        # the H200 pair under load (BENCHMARKS.md, "KV handoff on GPUs").
        args.max_num_batched_tokens = PREFILL_NODE_BATCHED_TOKENS
    prefill_nodes = check_serve_args(args, kv)
    where = check_engine_args(args)
    if args.check_config:
        tiers = ""
        if args.kv_offloading_size:
            tiers += f", host KV tier {args.kv_offloading_size:g} GiB {args.kv_offloading_mode}"
        if args.kv_disk_path:
            tiers += f", disk KV tier {args.kv_disk_path} {args.kv_disk_size:g} GiB"
        print(f"config ok: role {kv.kv_role}, pipe {kv.kv_connector} {kv.kv_ip}:{kv.kv_port}{tiers}, model {where}")
        return
    from disagg import metrics
    from disagg.api.tool_calls import ToolOptions
    from disagg.engine.async_engine import AsyncEngine
    from disagg.engine.config import EngineConfig
    from disagg.engine.engine import LLMEngine
    from disagg.engine.profiler import TorchProfiler
    from disagg.serving import HTTPOptions

    if args.disable_log_stats:  # the engine thread's only INFO line is its periodic stats summary
        logging.getLogger("disagg.engine.async_engine").setLevel(logging.WARNING)
    http_log_level = args.uvicorn_log_level or args.log_level
    # The engine thread, the event loop and the KV sender/receivers share one GIL. At Python's default
    # 5 ms switch interval, a thread that wakes from a socket read or returns from a C call that let
    # go of the GIL waits up to 5 ms for it whenever another runs Python: a layer-wise KV entry took 12x longer to
    # receive beside a busy thread, 2.5x at 0.5 ms (BENCHMARKS.md, "The GIL and the KV handoff").
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    name = served_model_name(args)
    limits = HTTPLimits.from_args(args)
    trace_dir = profiler_dir(args)
    profiler = None if trace_dir is None else TorchProfiler(trace_dir, f"{kv.kv_role}-{args.port}")
    rank_service = None
    if kv.kv_role == "consumer" and args.tensor_parallel_size > 1:  # each rank receives its own KV heads
        from disagg.decode_node.rank_kv import rank_service_for

        rank_service = rank_service_for(kv)
    elif kv.kv_role == "producer" and args.tensor_parallel_size > 1:  # each rank sends its own KV heads
        from disagg.prefill_node import rank_send

        rank_service = rank_send.rank_service_for(kv)
    # The node's server is imported before the model loads: a Ctrl-C that lands while pydantic builds a
    # model class's schema surfaces as pydantic's SchemaError, not as a KeyboardInterrupt main() can
    # tell from a bug, so that import stays out of the long load, where Ctrl-C is most likely.
    if kv.kv_role == "producer":
        from disagg.prefill_node.server import run_prefill_node
    else:
        from disagg.decode_node.server import run_decode_node
    engine = AsyncEngine(LLMEngine(EngineConfig(**engine_kwargs(args) | {
        "model": local_model(args), "grammar_cache_bytes": int(args.grammar_cache_mb * 2**20),
        "rank_service": rank_service})), profiler)
    metrics.register_vllm_names(name)  # every role serves vLLM's metric names, labelled with the served name
    if kv.kv_role == "producer":
        asyncio.run(run_prefill_node(engine, name, kv, args.host, args.port, args.grpc_port, http_log_level, limits))
    else:
        http = HTTPOptions(args.api_key, args.max_request_body_bytes, args.enable_docs)
        tools = ToolOptions(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)
        sampling = sampling_options(args, engine.model_dir)
        asyncio.run(run_decode_node(engine, name, kv, prefill_nodes, args.host, args.port, http, tools,
                                    args.log_requests, args.shutdown_timeout, http_log_level, limits, sampling))


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-role", choices=["producer", "consumer", "both", "kv_producer", "kv_consumer", "kv_both"],
                        default=None,
                        help="producer = prefill node, consumer = decode node, both = colocated (default)")
    parser.add_argument("--kv-transfer-config", default=None,
                        help='JSON with vLLM\'s fields: {"kv_connector": "tcp|torch_dist|ucx|nixl" or vLLM\'s '
                             'connector names (PyNcclConnector, P2pNcclConnector, NixlConnector, OffloadingConnector, '
                             'SimpleCPUOffloadConnector, LMCacheConnectorV1, MultiConnector), "kv_role": ..., '
                             '"kv_rank": ..., "kv_ip": ..., "kv_port": ..., "kv_buffer_size": bytes, '
                             '"kv_buffer_device": "cpu|cuda", "kv_connector_extra_config": {"auth_token": ... '
                             '(default: '
                             f'${KV_AUTH_TOKEN_ENV}), '
                             '"prefill_policy": "recompute|fail", "remote_prefill": "auto|always|never", '
                             '"local_prefill_max_tokens": n, "lookup_timeout": s, "prefill_timeout": s, '
                             '"pipe_timeout": s, "buffer_ttl": s, "insert_timeout": s}}; kv_role sets the node\'s role')
    parser.add_argument("--host", default="127.0.0.1", help="address the HTTP (and gRPC) servers bind")
    parser.add_argument("--port", type=int, default=8000,
                        help="HTTP port: OpenAI API (decode/colocated), health, metrics")
    parser.add_argument("--grpc-port", type=int, default=50051, help="prefill node: control-plane gRPC port")
    parser.add_argument("--prefill-nodes", default=None,
                        help=f"decode node: HOST:GRPC_PORT[,HOST:GRPC_PORT...] of its prefill nodes (default: "
                             f"{LOCAL_PREFILL_NODE}, the prefill node on this host)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the model's name in the API (default: MODEL as given for a Hub id, else the "
                             "directory's name); one name")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on every path but /health, /metrics and /ping "
                             f"(default: ${API_KEY_ENV})")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="decode/colocated node: larger request bodies are refused with 413")
    # A server's only: `generate` takes no structured output.
    parser.add_argument("--grammar-cache-mb", type=float, default=256,
                        help="MiB of memory for compiled structured-output grammars (least recently used out first)")
    parser.add_argument("--enable-docs", action="store_true",
                        help="serve /docs and /openapi.json (off: they map the API for anyone who reaches the port)")
    add_http_limit_args(parser)
    parser.add_argument("--insecure", action="store_true",
                        help="allow node-to-node ports beyond loopback with no auth_token (a trusted network only)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='chat: answer tool_choice "auto" (the default with tools), reading tool calls out of '
                             "the model's text with --tool-call-parser (vLLM's flag)")
    parser.add_argument("--tool-call-parser", default=None,
                        help="the format of the model's tool calls: hermes (<tool_call>{...}</tool_call>, Hermes "
                             "and Qwen 2.5), llama3_json (Llama 3.1-3.3, 4), mistral ([TOOL_CALLS]), pythonic "
                             "([f(a=1)], Llama 3.2 and 4), qwen3_coder (<function=...>, Qwen3-Coder); vLLM's "
                             "other parsers are refused")
    parser.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=False,
                        help="log a line as each request starts and as it ends (off by default, as in vLLM)")
    parser.add_argument("--disable-log-requests", "--disable-log-request", dest="log_requests", action="store_false",
                        help="no line per request (the default; the spelling --disable-log-request is in vLLM's "
                             "own scripts)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM or Ctrl-C, seconds that requests in flight get to finish while new "
                             "connections are refused")
    parser.add_argument("--config", default=None,
                        help="YAML file of flags (keys are flag names without --, as in vLLM); flags given on "
                             "the command line win")
    parser.add_argument("--profiler-config", default=None,
                        help='JSON {"profiler": "torch", "torch_profiler_dir": DIR} (vLLM\'s; or '
                             "$VLLM_TORCH_PROFILER_DIR): serve POST /start_profile and /stop_profile, which "
                             "write a torch.profiler trace of the node's steps into DIR (for development: "
                             "tracing slows the node)")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    parser.add_argument("--check-config", action="store_true",
                        help="validate the flags and exit, loading no model (a Hub model is looked up, not downloaded)")


ENV_PREFIX = "DISAGG_"
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def environment_defaults(parser: argparse.ArgumentParser) -> dict:
    """$DISAGG_<FLAG> for every flag of disagg serve (DISAGG_MAX_NUM_SEQS=32, DISAGG_MODEL=/models/x,
    DISAGG_ENABLE_AUTO_TOOL_CHOICE=1), as the parser's defaults: a --config file and the command line win."""
    defaults = {}
    for action in parser._actions:
        value = os.environ.get(ENV_PREFIX + action.dest.upper())
        if action.dest in ("help", "config") or value is None:
            continue
        if action.nargs == 0:  # a switch
            if value.lower() not in TRUE_WORDS + FALSE_WORDS:
                raise ValueError(f"${ENV_PREFIX}{action.dest.upper()} must be one of {TRUE_WORDS + FALSE_WORDS}, "
                                 f"got {value!r}")
            value = value.lower() in TRUE_WORDS  # the dest's value: DISAGG_LOG_REQUESTS=0 turns logging off
        defaults[action.dest] = value
    return defaults


def config_file_defaults(parser: argparse.ArgumentParser, path: str) -> dict:
    """vLLM's --config: a YAML mapping of flag names (without --; dashes or underscores) to values,
    turned into the parser's defaults. A mapping for --kv-transfer-config is taken as its JSON."""
    import yaml

    values = yaml.safe_load(Path(path).expanduser().read_text())
    if not isinstance(values, dict):
        raise ValueError(f"{path} must be a YAML mapping of flag names to values")
    dests = {action.dest for action in parser._actions} - {"help", "config"}
    defaults = {}
    for key, value in values.items():
        dest = str(key).removeprefix("--").replace("-", "_")
        if dest == "enable_log_requests" or dest == "disable_log_requests":
            dest, value = "log_requests", bool(value) == (dest == "enable_log_requests")
        if dest not in dests:
            raise ValueError(f"{path}: {key!r} is not a flag of disagg serve")
        defaults[dest] = json.dumps(value) if dest == "kv_transfer_config" and isinstance(value, dict) else value
    return defaults


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The `disagg` parser and its `serve` subparser. No flag may be abbreviated (`--kv-rol` is refused)."""
    parser = argparse.ArgumentParser(prog="disagg", description="Disaggregated prefill/decode LLM serving",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    srv = sub.add_parser("serve", help="run a prefill, decode or colocated node (takes vLLM's `vllm serve` flags)",
                         formatter_class=HelpFormatter)
    add_engine_args(srv)
    add_serve_args(srv)
    add_vllm_flags(srv)
    upp = sub.add_parser("up", help="start prefill and decode nodes (1 + 1 by default) on localhost and send a "
                                    "sample request", formatter_class=HelpFormatter)
    upp.add_argument("model", nargs="?", default=None,
                     help="model directory, .gguf file or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    upp.add_argument("--num-prefill", type=int, default=None, metavar="X", help="prefill nodes (default: 1)")
    upp.add_argument("--num-decode", type=int, default=None, metavar="Y",
                     help="decode nodes (default: 1); with more than one, `disagg router` in front of them")
    upp.add_argument("--colocated", type=int, default=None, metavar="N",
                     help="N colocated nodes (--kv-role both) instead of prefill and decode nodes; with more than "
                          "one, `disagg router` in front of them")
    upp.add_argument("--port", type=int, default=8000,
                     help="the front door's HTTP port: the router's, or the one decode (colocated) node's; the "
                          "decode or colocated nodes take the ports after it, then the prefill nodes")
    upp.add_argument("--grpc-port", type=int, default=50051, help="prefill nodes' gRPC ports, from this one up")
    upp.add_argument("--kv-port", type=int, default=14579,
                     help="pipe ports, from this one up: the prefill nodes' first, then the decode nodes'")
    upp.add_argument("--kv-connector", default="tcp", help="pipe: tcp, torch_dist, ucx or nixl")
    upp.add_argument("--device", default=None,
                     help="cpu (all nodes share it) or cuda[:K] (each node its own GPUs, from the K-th on); "
                          "default: cuda if present")
    upp.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, metavar="N",
                     help="ranks of each node; on CUDA each node takes N GPUs (CUDA_VISIBLE_DEVICES), the prefill "
                          "nodes first")
    upp.add_argument("--async-scheduling", action="store_true", help="every node steps ahead (as serve's)")
    upp.add_argument("--max-num-seqs", type=int, default=None, help="every node's (default: serve's)")
    upp.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="the decode and colocated nodes' (default: serve's)")
    upp.add_argument("--prefill-max-num-batched-tokens", type=int, default=None,
                     help="the prefill nodes' --max-num-batched-tokens (default: serve's for a prefill node)")
    upp.add_argument("--once", action="store_true", help="stop every node after the sample request")
    upp.add_argument("--log-level", default="WARNING", help="the nodes' log level: DEBUG, INFO, WARNING or ERROR")
    gen = sub.add_parser("generate", help="offline generation with the engine, printed with timings",
                         formatter_class=HelpFormatter)
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a user message (repeatable; default: three samples)")
    gen.add_argument("--max-tokens", type=int, default=64, help="the most tokens generated per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    gen.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    from disagg.bench import add_bench_parser  # argparse only: the load generator loads when it runs

    add_bench_parser(sub)
    from disagg.router import add_router_parser  # argparse only: the router's server loads when it runs

    add_router_parser(sub)
    from disagg.plan import add_plan_parser  # argparse only: the simulator and the profiler load when they run

    add_plan_parser(sub)
    for subparser in all_parsers(parser):
        subparser.allow_abbrev = False
    return parser, srv


def all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found += all_parsers(child)
    return found


def main(argv: list[str] | None = None) -> None:
    parser, srv = build_parser()
    argv = normalize_argv(sys.argv[1:] if argv is None else argv)
    try:
        srv.set_defaults(**environment_defaults(srv))
    except ValueError as e:
        parser.exit(2, f"disagg: error: {e}\n")
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        try:
            srv.set_defaults(**config_file_defaults(srv, args.config))
        except (OSError, ValueError) as e:
            parser.exit(2, f"disagg: error: --config: {e}\n")
        args = parser.parse_args(argv)  # the command line wins over the file, the file over the environment
    if getattr(args, "api_key", "") is None:  # serve and router: the key may come from the environment
        args.api_key = os.environ.get(API_KEY_ENV) or None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "up":
            from disagg.launch import up

            up(args)
        elif args.command == "router":
            from disagg.router.server import main as run_router

            run_router(args)
        elif args.command == "bench":
            from disagg.bench import run_bench

            run_bench(args)
        elif args.command == "plan":
            from disagg.plan import run_plan

            run_plan(args)
        else:
            {"generate": generate, "serve": serve}[args.command](args)
    except (ValueError, RuntimeError) as e:
        # Python 3.11 wraps a Ctrl-C that lands in a class's __set_name__ (a pydantic model's, as a
        # module is imported) in a RuntimeError
        if not isinstance(e.__cause__, KeyboardInterrupt):
            parser.exit(2, f"disagg: error: {e}\n")
        interrupted(parser, args.command)
    except KeyboardInterrupt:  # Ctrl-C before a server took over SIGINT (loading the model, say)
        interrupted(parser, args.command)


def interrupted(parser: argparse.ArgumentParser, command: str) -> NoReturn:
    forget_interrupt()
    parser.exit(130, f"disagg {command}: interrupted\n")  # 128 + SIGINT, as a shell reports it


def forget_interrupt() -> None:
    """Tell Python that the KeyboardInterrupt being handled was handled. Python 3.11 and 3.12 mark one
    that leaves code run by exec() of a string as unhandled even when a caller catches it, and
    `python -m disagg.cli` then ends itself by SIGINT after a clean exit, whatever the exit status:
    the test nodes' Ctrl-C while importing the servers ended by SIGINT (-2), not 130, 8 times in 8
    (dataclasses build their methods with exec(), so any import of a module with dataclasses can be
    where it lands). Each exec() of a string clears the mark as it starts, so an empty one clears it.
    3.13 no longer sets it there; the `disagg` script never read it (it exits at once on SystemExit)."""
    exec("pass")


if __name__ == "__main__":
    main()
