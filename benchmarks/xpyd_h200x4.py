"""xPyD on one 4-GPU host: which prefill/decode split wins, measured, and how far `disagg plan`'s choice is off.

    python benchmarks/xpyd_h200x4.py --tokenizer-dir DIR --phase goodput --workloads 4k --json 4k.json
    python benchmarks/xpyd_h200x4.py --tokenizer-dir DIR --phase goodput --workloads chat --json chat.json
    python benchmarks/xpyd_h200x4.py --tokenizer-dir DIR --phase plan --measured 4k.json chat.json --json plan.json
    python benchmarks/xpyd_h200x4.py --merge 4k.json chat.json plan.json --json benchmarks/results/xpyd_h200x4.json
    python benchmarks/xpyd_h200x4.py --plot xpyd.png 4k.json chat.json   # or FILE:KEY.KEY, a merged file's part
    python benchmarks/xpyd_h200x4.py --tokenizer-dir DIR --dry-run --json /tmp/xpyd.json   # all of it on the CPU

The random-weight 8B shape of gpu_e2e.py, bfloat16, one node per GPU at TP = 1, except `tp2p2d`'s
prefill node, which runs at TP = 2 on GPUs 0 and 1 (the issue's "prefill TP = 2 + 2 decode nodes"; its
decode nodes take each layer's KV heads from both prefill ranks); KV over --connector (torch_dist by
default), every layout behind `disagg router`, each decode node listing every prefill node (it takes the
one with the fewest prompt tokens to compute). The workloads, the SLO and the request
helpers are handoff_h200x2.py's (imported, not copied).

- goodput (one call per workload): 4 colocated nodes first, whose one-at-a-time TTFT and TPOT set
  the tight SLO (TTFT <= 4x, TPOT <= 1.25x the unloaded colocated values) and, at LOOSE_SCALE times
  both, the loose one; then 1P3D, 2P2D, 3P1D and tp2p2d, each started alone on the 4 GPUs, at each of
  --rates-WORKLOAD. A layout's goodput is the highest rate at which >= 90% of the requests meet the
  SLO; `goodput_per_gpu` is that over 4, `best_vs_colocated` the best xPyD layout's over colocated
  x4's, at both SLOs. Every run keeps its attainment at SLO_SCALES multiples of the SLO, its ITL p99
  and each request's TTFT and TPOT.
- plan: `disagg plan profile` on this machine (the link between GPUs 0 and 1), then `disagg plan
  --gpus 4` for each measured workload at its tight SLO; `plan_error` = |predicted - measured| /
  measured goodput of the layout the plan recommends, beside whether it is the measured best.
- --dry-run: the same code on the CPU with the tiny shape, tcp, one rate, a few requests, short
  prompts (no numbers worth keeping: it checks that the layouts start, route and are measured)."""

import argparse
import json
import random
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_disagg_vs_colocated import REPO, NodeSpec, System, start_node, stop, wait_ready, warm_up
from gpu_e2e import SHAPES, write_model
from handoff_h200x2 import (
    ATTAINMENT,
    SLO_SCALES,
    TPOT_SLO,
    TTFT_SLO,
    WORKLOADS,
    attainment,
    engine_means,
    engine_sums,
    kept_rate,
    load,
    merge_json,
    node_kwargs,
    plot_goodput,
    serve_once,
    start_router,
)

from disagg.bench.serve import sample_len

GPUS = 4
# (prefill nodes, decode nodes, the prefill nodes' TP): each layout fills the 4 GPUs
LAYOUTS = {"colocated_x4": (0, 4, 1), "1p3d": (1, 3, 1), "2p2d": (2, 2, 1), "3p1d": (3, 1, 1), "tp2p2d": (1, 2, 2)}
PLAN_NAMES = {"colocated x4": "colocated_x4", "1P3D": "1p3d", "2P2D": "2p2d", "3P1D": "3p1d"}  # `disagg plan`'s
LOOSE_SCALE = 2.0  # the loose SLO: both limits of the tight one, doubled
PROFILE_KV = "48GiB"  # the profile's decode grid reaches 64 sequences of 4,096 tokens: 32 GiB at the 8B shape
# The dry run's workloads: the real ones' shapes, short (the tiny model on two shared cores).
DRY_WORKLOADS = {"4k": dict(input_len=256, output_len=16, len_dist="fixed", len_range=0.0),
                 "chat": dict(input_len=64, output_len=32, len_dist="lognormal", len_range=0.6)}


def node_spec(args: argparse.Namespace, gpu: int, tp: int = 1) -> NodeSpec:
    """A node on GPUs gpu .. gpu + tp - 1 (its ranks take them in order)."""
    if args.device == "cpu":
        return NodeSpec(threads=1)
    return NodeSpec(device="cuda", threads=4, env={"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpu, gpu + tp)))})


@contextmanager
def layout(args: argparse.Namespace, model: Path, name: str, log_dir: Path):
    """One layout's nodes (prefill nodes on the first GPUs, decode or colocated nodes on the rest) and a
    router in front of the decode nodes; yields (router URL, the front nodes as Systems)."""
    num_prefill, num_decode, tp = LAYOUTS[name]
    assert num_prefill * tp + num_decode == GPUS, name
    kwargs = node_kwargs(args, model, "layerwise")
    log_dir.mkdir(parents=True, exist_ok=True)
    started, router = [], None
    try:
        prefill = []
        for i in range(num_prefill):
            extra = [*kwargs["extra"], *args.prefill_extra, *(["--tensor-parallel-size", str(tp)] if tp > 1 else [])]
            prefill.append(start_node("producer", log_dir, node_spec(args, i * tp, tp), **(kwargs | {"extra": extra})))
        started += prefill
        for node in prefill:
            wait_ready(node)  # decode nodes handshake with them at start
        fronts = []
        for gpu in range(num_prefill * tp, GPUS):
            extra = list(kwargs["extra"])
            if prefill:
                extra += ["--prefill-nodes", ",".join(f"127.0.0.1:{p.grpc_port}" for p in prefill)]
            node = start_node("consumer" if prefill else "both", log_dir, node_spec(args, gpu),
                              **(kwargs | {"extra": extra}))
            started.append(node)
            fronts.append(System(f"{name}-{gpu}", node, [node]))
        for system in fronts:
            wait_ready(system.front)
        router, url = start_router(log_dir, fronts, model)
        yield url, fronts
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=20)
        stop(started)


def goodput_phase(args: argparse.Namespace, model: Path) -> dict:
    result = {}
    for workload in args.workloads.split(","):
        rates = getattr(args, f"rates_{workload}").split(",")
        w = result[workload] = {"runs": {}}
        if args.slo_from:  # an earlier call's SLO: this call need not start with colocated_x4
            w["slo"] = json.loads(Path(args.slo_from).read_text())["goodput"][workload]["slo"]
        for name in args.layouts.split(","):
            with layout(args, model, name, Path(args.work) / f"logs-{workload}-{name}") as (url, fronts):
                for system in fronts:
                    warm_up(system, args.vocab)
                serve_once(url, args, workload, rates[len(rates) // 2], 8, 99, [])  # loaded batches of its shape
                if "slo" not in w:
                    if name != "colocated_x4":
                        raise ValueError("--layouts must start with colocated_x4 (its unloaded TTFT and TPOT set "
                                         "the SLO), or --slo-from name an earlier call's goodput JSON")
                    w["unloaded"] = serve_once(fronts[0].front.url, args, workload, "inf", 6, 100, [],
                                               max_concurrency=1)
                    ttft, tpot = w["unloaded"]["median_ttft_ms"], w["unloaded"]["median_tpot_ms"]
                    w["slo"] = {"ttft_ms": TTFT_SLO * ttft, "tpot_ms": TPOT_SLO * tpot, "unloaded_ttft_ms": ttft,
                                "unloaded_tpot_ms": tpot, "loose_scale": LOOSE_SCALE}
                    print(f"{workload}: SLO TTFT <= {w['slo']['ttft_ms']:.0f} ms, TPOT <= {w['slo']['tpot_ms']:.2f} "
                          f"ms (loose: x{LOOSE_SCALE})", flush=True)
                slo = w["slo"]
                goodput = [f"ttft:{slo['ttft_ms']:.0f}", f"tpot:{slo['tpot_ms']:.2f}"]
                runs = w["runs"][name] = {}
                for i, rate in enumerate(rates):
                    before = engine_sums([system.front for system in fronts])
                    r = runs[rate] = serve_once(url, args, workload, rate, args.num_requests, args.seed + i, goodput)
                    r["fronts"] = engine_means(before, engine_sums([system.front for system in fronts]))
                    r["attainment_by_slo_scale"] = {
                        str(k): attainment(r["per_request"], k * slo["ttft_ms"], k * slo["tpot_ms"])
                        for k in SLO_SCALES}
                    print(f"  {workload} {name:12s} rate {rate:>5s}: {100 * r['goodput_fraction']:.0f}% within SLO, "
                          f"TTFT p50/p99 {r['median_ttft_ms']:.0f}/{r['p99_ttft_ms']:.0f} ms, TPOT p50/p99 "
                          f"{r['median_tpot_ms']:.2f}/{r['p99_tpot_ms']:.2f} ms, ITL p99 {r['p99_itl_ms']:.1f} ms; "
                          f"the nodes' API TTFT mean {r['fronts']['ttft_ms']:.0f} ms; client CPU {r['client_cpu']:.2f}",
                          flush=True)
            write_json(args, summarize(result))  # what is known so far, if the time limit stops the run
    return summarize(result)


def goodput_rate(runs: dict, slo: dict, scale: float) -> float:
    """The highest rate (its arrivals', `arrival_rate`) whose requests meet `scale` x the SLO >= 90% of
    the time (0 if none does)."""
    return max([kept_rate(rate, r) for rate, r in runs.items()
                if attainment(r["per_request"], scale * slo["ttft_ms"], scale * slo["tpot_ms"]) >= ATTAINMENT],
               default=0.0)


def summarize(result: dict) -> dict:
    """Goodput per layout at both SLOs; `goodput_censored` names the layouts that still met the SLO at the
    highest rate tried, whose goodput is a lower bound (and so is any ratio with it above the line)."""
    out = {"goodput": result, "goodput_rate": {}, "goodput_censored": {}, "goodput_per_gpu": {},
           "best_vs_colocated": {}}
    for workload, w in result.items():
        for slo_name, scale in (("tight", 1.0), ("loose", LOOSE_SCALE)):
            rates = {name: goodput_rate(runs, w["slo"], scale) for name, runs in w["runs"].items()}
            out["goodput_rate"].setdefault(workload, {})[slo_name] = rates
            out["goodput_censored"].setdefault(workload, {})[slo_name] = sorted(
                name for name, rate in rates.items()
                if rate and rate == max(kept_rate(k, r) for k, r in w["runs"][name].items()))
            out["goodput_per_gpu"].setdefault(workload, {})[slo_name] = {n: r / GPUS for n, r in rates.items()}
            xpyd = [r for name, r in rates.items() if name != "colocated_x4"]
            colocated = rates.get("colocated_x4")
            out["best_vs_colocated"].setdefault(workload, {})[slo_name] = \
                max(xpyd) / colocated if xpyd and colocated else None
    return out


def plan_phase(args: argparse.Namespace, model: Path) -> dict:
    measured = {}
    for path in args.measured:
        measured |= json.loads(Path(path).read_text())["goodput"]
    profile = Path(args.profile or Path(args.work) / "profile.json")
    if not args.profile:
        gpu_pair = {"CUDA_VISIBLE_DEVICES": "0,1"} if args.device == "cuda" else {}
        grid = ["--prefill-tokens", "16,64,256", "--decode-batch", "1,4", "--decode-context", "32,96"] \
            if args.dry_run else []
        kv = args.kv_cache_memory if args.dry_run else PROFILE_KV
        run_disagg(["plan", "profile", str(model), "--device", args.device, "--dtype", args.dtype, "--kv-connector",
                    args.connector, "--kv-cache-memory", kv, "--out", str(profile), *grid,
                    *(["--async-scheduling"] if args.async_scheduling else [])], gpu_pair)
    out = {"plan": {}, "plan_error": {}}
    for workload, w in measured.items():
        rates = sorted(w["runs"]["colocated_x4"], key=float)
        plan_json = Path(args.work) / f"plan-{workload}.json"
        argv = ["plan", "--profile", str(profile), "--gpus", str(GPUS), "--workload", str(trace(args, workload)),
                "--ttft-slo-ms", f"{w['slo']['ttft_ms']:.1f}", "--tpot-slo-ms", f"{w['slo']['tpot_ms']:.2f}",
                "--rate", *rates, "--json", str(plan_json), *plan_engine_flags(args)]
        print(run_disagg(argv, {}), flush=True)
        plan = json.loads(plan_json.read_text())
        recommended = PLAN_NAMES[plan["recommended"]]
        predicted = next(row["goodput"] for row in plan["layouts"] if row["layout"] == plan["recommended"])
        rates_measured = {name: goodput_rate(runs, w["slo"], 1.0) for name, runs in w["runs"].items()}
        actual = rates_measured.get(recommended)
        out["plan"][workload] = plan | {"measured_goodput": rates_measured}
        best = max(rates_measured, key=rates_measured.get)
        out["plan_error"][workload] = {
            "recommended": recommended, "measured_best": best if rates_measured[best] else None,
            "predicted_goodput": predicted, "measured_goodput": actual,
            "error": abs(predicted - actual) / actual if actual else None}
        print(f"{workload}: plan recommends {recommended}, predicted {predicted:.2f} req/s, measured {actual} req/s; "
              f"measured best {out['plan_error'][workload]['measured_best']}", flush=True)
    return out


def plan_engine_flags(args: argparse.Namespace) -> list[str]:
    """The nodes' batching flags, as the plan must simulate them."""
    flags = []
    if args.max_num_batched_tokens:
        flags += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.prefill_max_num_batched_tokens:
        flags += ["--prefill-max-num-batched-tokens", str(args.prefill_max_num_batched_tokens)]
    return flags


def trace(args: argparse.Namespace, workload: str) -> Path:
    """The workload's lengths as JSON lines, drawn as `disagg bench serve` draws them."""
    spec, rng = WORKLOADS[workload], random.Random(0)
    path = Path(args.work) / f"trace-{workload}.jsonl"
    lines = [json.dumps({"input_len": sample_len(rng, spec["input_len"], spec["len_dist"], spec["len_range"]),
                         "output_len": sample_len(rng, spec["output_len"], spec["len_dist"], spec["len_range"])})
             for _ in range(500)]
    path.write_text("\n".join(lines) + "\n")
    return path


def plot(png: str, runs: list[str]) -> None:
    """The runs' layouts, by workload, in handoff_h200x2.py's two plots (a workload's SLO: its first run's)."""
    result: dict = {"goodput": {}}
    for spec in runs:
        for workload, w in load(spec)["goodput"].items():
            merged = result["goodput"].setdefault(workload, {"runs": {}, "slo": w["slo"]})
            merged["runs"].update(w["runs"])
    plot_goodput(result, png)


def run_disagg(argv: list[str], env: dict) -> str:
    import os

    done = subprocess.run([sys.executable, "-m", "disagg.cli", *argv], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **env, "OMP_NUM_THREADS": "4" if env else "1"})
    if done.returncode != 0:
        raise RuntimeError(f"disagg {' '.join(argv[:2])} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def write_json(args: argparse.Namespace, result: dict) -> None:
    Path(args.json).write_text(json.dumps({f"{args.phase}_args": {k: v for k, v in vars(args).items()
                                                                   if k not in ("merge", "measured")}} | result,
                                          indent=1, default=str))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer-dir", help="a tokenizer.json's directory (default: the embedded model's)")
    ap.add_argument("--phase", choices=["goodput", "plan"])
    ap.add_argument("--measured", nargs="+", help="plan: the goodput phases' JSON files")
    ap.add_argument("--profile", help="plan: a `disagg plan profile` of these GPUs to use instead of profiling here")
    ap.add_argument("--merge", nargs="+", help="phase JSON files to join into one result")
    ap.add_argument("--plot", nargs="+", metavar="PNG RUN",
                    help="write PNG: attainment against rate and against SLO scale of each RUN, a goodput phase's "
                         "JSON (FILE, or FILE:KEY.KEY for a part of a merged one)")
    ap.add_argument("--dry-run", action="store_true",
                    help="both phases on the CPU: tiny shape, tcp, short prompts, one rate, few requests")
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--connector", default="torch_dist")
    ap.add_argument("--work", default="/tmp/xpyd_h200x4")
    ap.add_argument("--workloads", default="4k,chat", help=f"of {', '.join(WORKLOADS)}")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="colocated_x4 first (it sets the SLO)")
    ap.add_argument("--slo-from", help="goodput: the SLO of an earlier call's goodput JSON, for calls that add "
                                       "layouts or rates without colocated_x4 (merge them with --merge)")
    # Around where four colocated nodes may hold the tight SLO: on the pair, two held it at 1.5 req/s of
    # 4k prompts and none at 4 req/s of chat (BENCHMARKS, "goodput under Poisson load").
    ap.add_argument("--rates-4k", default="2,3,4.5,6")
    ap.add_argument("--rates-chat", default="1,2,3,4.5")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=7, help="the arrivals of the sweep's i-th rate are drawn with "
                    "seed + i (the same for every system); another seed, other arrival sequences to pool")
    ap.add_argument("--kv-cache-memory", default="24GiB")
    ap.add_argument("--async-scheduling", action="store_true", help="every node steps ahead (--async-scheduling)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-batched-tokens", type=int, help="the nodes' chunk size (default: theirs, 2048)")
    ap.add_argument("--prefill-max-num-batched-tokens", type=int,
                    help="the prefill nodes' chunk size alone (default: theirs, 8192 on a GPU)")
    ap.add_argument("--json", help="the result to write (every use but --plot)")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot[0], args.plot[1:])
        return 0
    if not args.json:
        ap.error("give --json")
    if args.merge:
        merge_json(args.merge, args.json)
        return 0
    if args.dry_run:
        WORKLOADS.update(DRY_WORKLOADS)  # serve_once reads handoff_h200x2's table
        args.device, args.shape, args.connector, args.kv_cache_memory = "cpu", "tiny", "tcp", "256MiB"
        args.max_model_len, args.num_requests, args.rates_4k, args.rates_chat = 1024, 4, "2", "2"
    elif args.phase is None:
        ap.error("give --phase goodput or plan (or --dry-run, or --merge)")
    if args.profile and (args.dry_run or args.phase != "plan"):
        ap.error("--profile is the plan phase's: give it with --phase plan")
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.vocab = SHAPES[args.shape]["vocab_size"]
    args.kv_buffer_device = "cuda"
    args.prefill_extra = ["--max-num-batched-tokens", str(args.prefill_max_num_batched_tokens)] \
        if args.prefill_max_num_batched_tokens else []
    if args.tokenizer_dir is None:
        from disagg.engine.loader import resolve_model

        args.tokenizer_dir = str(resolve_model(None))
    start = time.time()
    model = None if args.profile else write_model(args.shape, Path(args.work) / f"llama-{args.shape}",
                                                  Path(args.tokenizer_dir), "cuda" if args.device == "cuda" else "cpu")
    if args.dry_run:
        args.phase = "goodput"
        measured = goodput_phase(args, model)
        args.phase, args.measured = "plan", [args.json]
        write_json(args, measured)
        write_json(args, measured | plan_phase(args, model))
    else:
        write_json(args, goodput_phase(args, model) if args.phase == "goodput" else plan_phase(args, model))
    print(f"{args.phase} done in {time.time() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
