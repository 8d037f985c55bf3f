"""`disagg plan`: which layout of N GPUs serves a workload best under its SLOs, colocated or xPyD,
predicted by simulation (`simulate.py`) from a profile of the hardware (`profile.py`).

    disagg plan profile [MODEL] --device cuda --out profile.json
    disagg plan --profile profile.json --gpus 4 --input-len 4096 --output-len 256 \\
        --ttft-slo-ms 2000 --tpot-slo-ms 40

This module stays light (argparse only): `disagg.cli` imports it to build the parser; the simulator
(numpy) and the profiler (torch) are imported when they run."""

import argparse
import json
import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from disagg.config import PIPE_NAMES
from disagg.help_format import HelpFormatter

if TYPE_CHECKING:  # the parser is built without numpy
    from disagg.plan.profile import Profile
    from disagg.plan.simulate import Layout, Prediction, Settings


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    """`disagg plan ...` and `disagg plan profile ...`."""
    plan = sub.add_parser("plan", help="predict the goodput of colocated and every xPyD layout of N GPUs; "
                                       "recommend one (`plan profile` measures the hardware first)",
                          formatter_class=HelpFormatter)
    plan.set_defaults(log_level="WARNING")
    plan.add_argument("--profile", help="PROFILE.json written by `disagg plan profile`")
    plan.add_argument("--gpus", type=int, help="GPUs (nodes of one GPU each) to lay out")
    plan.add_argument("--input-len", type=int, help="prompt tokens of every request")
    plan.add_argument("--output-len", type=int, help="output tokens of every request")
    plan.add_argument("--workload", help="a `disagg bench serve --save-json` result (its requests' lengths) or "
                                         'JSON lines of {"input_len": N, "output_len": N}')
    plan.add_argument("--ttft-slo-ms", type=float, help="time to first token a request must meet")
    plan.add_argument("--tpot-slo-ms", type=float, help="time per output token a request must meet")
    plan.add_argument("--rate", type=float, nargs="+", help="request rates to report attainment at "
                                                            "(default: 0.5, 1 and 1.5 x the best goodput)")
    plan.add_argument("--max-num-seqs", type=int, default=64, help="the nodes' --max-num-seqs")
    plan.add_argument("--max-num-batched-tokens", type=int, default=2048,
                      help="colocated and decode nodes' --max-num-batched-tokens")
    plan.add_argument("--prefill-max-num-batched-tokens", type=int, default=None,
                      help="prefill nodes' --max-num-batched-tokens (default: serve's, 8192 on a GPU, 2048 on the CPU)")
    plan.add_argument("--num-requests", type=int, default=200, help="requests per simulated run")
    plan.add_argument("--seeds", type=int, default=3, help="simulated runs averaged per rate")
    plan.add_argument("--json", help="write the predictions here")
    plan_sub = plan.add_subparsers(dest="plan_command")
    prof = plan_sub.add_parser("profile", help="time prefill and decode steps and the KV link on this machine",
                               formatter_class=HelpFormatter)
    prof.add_argument("model", nargs="?", default=None,
                      help="model directory, .gguf file or Hub id (default: the embedded SmolLM2-135M-Instruct)")
    prof.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if present)")
    prof.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or auto (as serve's)")
    prof.add_argument("--kv-cache-memory", type=parse_memory, default=None,
                      help="KV cache size: bytes (e.g. 8GiB) or a fraction of free memory (as serve's)")
    prof.add_argument("--revision", default=None, help="a Hub MODEL's branch, tag or commit")
    prof.add_argument("--download-dir", default=None, help="the Hugging Face cache for a Hub MODEL")
    prof.add_argument("--out", required=True, help="PROFILE.json to write")
    prof.add_argument("--prefill-tokens", default=None,
                      help="prompt lengths to time a prefill step at (default: 32,128,512 on the CPU, "
                           "64,256,1024,4096,8192 on a GPU)")
    prof.add_argument("--decode-batch", default=None,
                      help="batch sizes to time a decode step at (default: 1,4,8 on the CPU; on a GPU each "
                           "CUDA graph bucket up to 64 and the batch after it)")
    prof.add_argument("--decode-context", default=None,
                      help="tokens each decoding sequence holds (default: 32,128 on the CPU, 1024,4096 on a GPU)")
    prof.add_argument("--kv-connector", default="tcp",
                      help="the pipe whose link is timed: tcp, torch_dist, ucx or nixl")
    prof.add_argument("--link-gbps", type=float, default=None,
                      help="the KV link's bandwidth in GB/s, instead of timing it (a cluster's network you know)")
    prof.add_argument("--link-latency-ms", type=float, default=1.0, help="with --link-gbps: a transfer's fixed cost")
    prof.add_argument("--async-scheduling", action="store_true",
                      help="time steps as nodes serving with --async-scheduling take them (the next decode step "
                           "launched before the last one is read back)")
    prof.add_argument("--serving", action=argparse.BooleanOptionalAction, default=True,
                      help="also time a served node (`disagg serve`, one request at a time) to learn what serving "
                           "adds to the engine's steps")


def parse_memory(text: str) -> int | float:
    from disagg.cli import parse_memory as parse

    return parse(text)


def load_workload(path: str) -> list[tuple[int, int]]:
    """(input_len, output_len) of each request: a `disagg bench serve` result's (the server's token
    counts where it reported them, every run's requests), or a JSON-lines trace's."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--workload: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None  # JSON lines
    try:
        if isinstance(data, dict) and "runs" in data:
            lengths = [(r.get("prompt_tokens") or r["input_len"], r.get("output_tokens") or r["output_len"])
                       for run in data["runs"] for r in run["requests"]]
        else:
            items = [data] if isinstance(data, dict) else [json.loads(line) for line in text.splitlines()
                                                           if line.strip()]
            lengths = [(int(item["input_len"]), int(item["output_len"])) for item in items]
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"--workload {path}: neither a `disagg bench serve` result nor JSON lines of "
                         f'{{"input_len": N, "output_len": N}} ({type(e).__name__}: {e})') from None
    if not lengths or min(min(pair) for pair in lengths) < 1:
        raise ValueError(f"--workload {path}: no requests, or a length below 1")
    return [(int(i), int(o)) for i, o in lengths]


def check_plan_args(args: argparse.Namespace) -> list[tuple[int, int]]:
    """Every flag `disagg plan` needs, or a ValueError naming it; returns the workload's lengths."""
    missing = [flag for flag in ("profile", "gpus", "ttft_slo_ms", "tpot_slo_ms") if getattr(args, flag) is None]
    if missing:
        raise ValueError("disagg plan needs " + ", ".join("--" + m.replace("_", "-") for m in missing))
    if args.gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {args.gpus}")
    if (args.workload is None) == (args.input_len is None or args.output_len is None):
        raise ValueError("give --workload FILE, or --input-len and --output-len (not both)")
    if args.workload:
        return load_workload(args.workload)
    if min(args.input_len, args.output_len) < 1:
        raise ValueError("--input-len and --output-len must be at least 1")
    return [(args.input_len, args.output_len)]


def run_plan(args: argparse.Namespace) -> None:
    if args.plan_command == "profile":
        from disagg.plan.profile import main

        main(args)
        return
    lengths = check_plan_args(args)
    from disagg.plan.profile import Profile
    from disagg.plan.simulate import Planner, Settings, layouts

    profile = Profile.load(args.profile)
    prefill_budget = args.prefill_max_num_batched_tokens or serve_prefill_budget(profile.on_gpu)
    settings = Settings(args.ttft_slo_ms / 1e3, args.tpot_slo_ms / 1e3, args.max_num_seqs,
                        args.max_num_batched_tokens, prefill_budget, args.num_requests, args.seeds)
    planner = Planner(profile, lengths, settings)
    goodputs = {layout: planner.goodput(layout) for layout in layouts(args.gpus)}
    best = max([g for g in goodputs.values() if math.isfinite(g)], default=0.0)
    rates = args.rate or [round(k * best, 3) for k in (0.5, 1.0, 1.5) if best > 0]
    predictions = sorted((planner.predict_at(layout, goodput, rates) for layout, goodput in goodputs.items()),
                         key=lambda p: -p.goodput)  # sorted is stable: colocated first among equals
    print(format_plan(profile, lengths, settings, predictions))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "profile": args.profile, "gpus": args.gpus, "slo_ms": {"ttft": args.ttft_slo_ms, "tpot": args.tpot_slo_ms},
            "recommended": predictions[0].layout.name,
            "up_command": up_command(profile, predictions[0].layout, settings),
            "layouts": [{"layout": p.layout.name, "prefill_nodes": p.layout.prefill, "decode_nodes": p.layout.decode,
                         "goodput": p.goodput, "goodput_per_gpu": p.per_gpu,
                         "attainment": {str(rate): a for rate, a in p.attainment.items()}} for p in predictions]},
            indent=1))


def format_plan(profile: "Profile", lengths: list[tuple[int, int]], settings: "Settings",
                predictions: "list[Prediction]") -> str:
    mean_in = sum(i for i, _ in lengths) / len(lengths)
    mean_out = sum(o for _, o in lengths) / len(lengths)
    rates = list(predictions[0].attainment)
    lines = [f"profile: {profile.model} on {profile.device} ({profile.dtype}), link {profile.link.connector} "
             f"{profile.link.bytes_per_s / 1e9:.2f} GB/s",
             f"workload: {len(lengths)} length pair(s), mean input {mean_in:.0f}, output {mean_out:.0f} tokens; "
             f"SLO TTFT <= {1e3 * settings.ttft_s:g} ms, TPOT <= {1e3 * settings.tpot_s:g} ms, "
             f"goodput at >= 90% within both",
             *context_note(profile, mean_in + mean_out / 2),
             "",
             f"{'layout':<14} {'goodput req/s':>14} {'per GPU':>9}   attainment at "
             + ", ".join(f"{r:g}" for r in rates) + " req/s"]
    for p in predictions:
        attained = "  ".join(f"{100 * a:5.1f}%" for a in p.attainment.values())
        lines.append(f"{p.layout.name:<14} {p.goodput:>14.3f} {p.per_gpu:>9.3f}   {attained}")
    if any(math.isinf(p.goodput) for p in predictions):
        lines.append(f"(inf: all {settings.num_requests} requests arriving at once meet the SLO; raise --num-requests)")
    best = predictions[0]
    colocated = next(p for p in predictions if p.layout.prefill == 0)
    if best.layout.prefill == 0:
        lines.append(f"recommended: {best.layout.name} -- do not disaggregate "
                     f"(predicted goodput {best.goodput:.3f} req/s)")
    else:
        gain = f"{best.goodput / colocated.goodput:.2f}x" if colocated.goodput else "colocated meets the SLO at no rate"
        lines.append(f"recommended: {best.layout.name} ({best.layout.prefill} prefill, {best.layout.decode} decode "
                     f"nodes; predicted goodput {best.goodput:.3f} req/s, {gain} {colocated.layout.name})")
    lines.append("run it: " + shlex.join(up_command(profile, best.layout, settings)))
    return "\n".join(lines)


def context_note(profile: "Profile", held: float) -> list[str]:
    """A line when the profile timed decode steps at one context, far from what the workload's sequences hold
    (`held`, on average): then how a step grows with the tokens held is not measured (the fit cannot tell it
    from the batch's own cost), and TPOT there is a guess."""
    contexts = {sample.context for sample in profile.decode}
    if len(contexts) > 1 or 0.75 <= held / next(iter(contexts)) <= 1.25:
        return []
    profiled, wanted = next(iter(contexts)), max(256, round(held / 256) * 256)
    return [f"note: the profile timed decode steps at {profiled} tokens held only, this workload's sequences hold "
            f"about {held:.0f}: its TPOT is extrapolated; profile with --decode-context "
            f"{min(profiled, wanted)},{max(profiled, wanted)} for one that follows the context"]


def up_command(profile: "Profile", layout: "Layout", settings: "Settings") -> list[str]:
    """`disagg up` for `layout` on one host, as argv words: the profiled model (MODEL where the profile
    does not say which), on the CPU if it was profiled there, over the pipe whose link it timed, with
    async scheduling if it was profiled so, and the batching the plan simulated where it is not serve's."""
    from disagg.cli import BATCHED_TOKENS, MAX_NUM_SEQS

    command = ["disagg", "up"]
    if profile.model_source is None:
        command.append("MODEL")
    elif profile.model_source:  # "": the embedded model, `disagg up`'s default
        command.append(profile.model_source)
    if layout.prefill:
        command += ["--num-prefill", str(layout.prefill), "--num-decode", str(layout.decode)]
        if profile.link.connector in PIPE_NAMES and profile.link.connector != "tcp":
            command += ["--kv-connector", profile.link.connector]
    else:
        command += ["--colocated", str(layout.decode)]
    if not profile.on_gpu:
        command += ["--device", "cpu"]
    if profile.async_scheduling:
        command.append("--async-scheduling")
    serves = {"--max-num-seqs": (settings.max_num_seqs, MAX_NUM_SEQS),
              "--max-num-batched-tokens": (settings.batched_tokens, BATCHED_TOKENS)}
    if layout.prefill:
        serves["--prefill-max-num-batched-tokens"] = (settings.prefill_batched_tokens,
                                                      serve_prefill_budget(profile.on_gpu))
    command += [word for flag, (value, default) in serves.items() if value != default for word in (flag, str(value))]
    return command


def serve_prefill_budget(on_gpu: bool) -> int:
    """A prefill node's --max-num-batched-tokens when it is given none, as `disagg serve` sets it."""
    from disagg.cli import BATCHED_TOKENS, PREFILL_NODE_BATCHED_TOKENS  # the parser imports this module

    return PREFILL_NODE_BATCHED_TOKENS if on_gpu else BATCHED_TOKENS
