"""The plan's simulator against one colocated node on one GPU, request by request, and where a served
request's time to first token goes under load.

    python benchmarks/plan_one_gpu.py --tokenizer-dir DIR --rates 1.875,2.25 --num-requests 200 --json out.json

`disagg plan profile` of gpu_e2e.py's random-weight 8B shape (bfloat16, --async-scheduling; one GPU has
no link to time, and a colocated node sends no KV: --link-gbps), then one colocated node with
xpyd_h200x4.py's flags serving the chat workload at each rate (each of colocated x4's nodes at a
quarter of x4's rate, without the router). Each run keeps its requests' TTFT and TPOT and the node's own
means over it (a request's queue time: arrival to its first blocks; prefill time: blocks to first token;
the API's TTFT; steps, and tokens a step), and is replayed in the simulator with the same arrivals and
lengths (plan_replay.py's): simulated and measured TTFT and TPOT side by side, and the attainment of both
at the SLO of the node's own unloaded TTFT and TPOT (TTFT <= 4x, TPOT <= 1.25x, as the 4-GPU runs')."""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_disagg_vs_colocated import REPO, NodeSpec, System, start_node, stop, wait_ready, warm_up
from gpu_e2e import SHAPES, write_model
from handoff_h200x2 import TPOT_SLO, TTFT_SLO, WORKLOADS, engine_means, engine_sums, node_kwargs, serve_once
from plan_replay import arrivals, percentiles
from xpyd_h200x4 import DRY_WORKLOADS

from disagg.plan import serve_prefill_budget
from disagg.plan.profile import Profile
from disagg.plan.simulate import Layout, Settings, Simulation, StepTimes


def profile(args: argparse.Namespace, model: Path) -> Profile:
    path = Path(args.work) / "profile.json"
    argv = [sys.executable, "-m", "disagg.cli", "plan", "profile", str(model), "--device", args.device, "--dtype",
            args.dtype, "--kv-cache-memory", "48GiB" if args.device == "cuda" else "256MiB", "--async-scheduling",
            "--link-gbps", "350", "--link-latency-ms", "0.3", "--out", str(path)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    print(done.stdout[-2000:], done.stderr[-2000:] if done.returncode else "", flush=True)
    if done.returncode:
        raise RuntimeError("disagg plan profile failed")
    return Profile.load(str(path))


def measure(args: argparse.Namespace, model: Path) -> dict:
    log_dir = Path(args.work) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    kwargs = node_kwargs(args, model, "whole")
    spec = NodeSpec(device="cuda", threads=4, env={"CUDA_VISIBLE_DEVICES": "0"}) if args.device == "cuda" \
        else NodeSpec(threads=1)
    node = start_node("both", log_dir, spec,
                      model=kwargs["model"], dtype=kwargs["dtype"], extra=kwargs["extra"])
    try:
        wait_ready(node)
        warm_up(System("colocated", node, [node]), args.vocab)
        serve_once(node.url, args, "chat", args.rates.split(",")[0], 8, 99, [])  # loaded batches of its shape
        unloaded = serve_once(node.url, args, "chat", "inf", 6, 100, [], max_concurrency=1)
        slo = {"ttft_ms": TTFT_SLO * unloaded["median_ttft_ms"], "tpot_ms": TPOT_SLO * unloaded["median_tpot_ms"],
               "unloaded_ttft_ms": unloaded["median_ttft_ms"], "unloaded_tpot_ms": unloaded["median_tpot_ms"]}
        print(f"SLO TTFT <= {slo['ttft_ms']:.1f} ms, TPOT <= {slo['tpot_ms']:.2f} ms", flush=True)
        runs = {}
        for i, rate in enumerate(args.rates.split(",")):
            before = engine_sums([node])
            run = serve_once(node.url, args, "chat", rate, args.num_requests, args.seed + i, [])
            run["node"] = engine_means(before, engine_sums([node]))
            runs[rate] = run
            print(f"{rate} req/s: TTFT p50 {run['median_ttft_ms']:.1f} ms, TPOT p50 {run['median_tpot_ms']:.2f} ms; "
                  f"client CPU {run['client_cpu']}; node {run['node']}", flush=True)
    finally:
        stop([node])
    return {"slo": slo, "unloaded": unloaded, "runs": runs}


def replay(args: argparse.Namespace, profile: Profile, measured: dict) -> dict:
    slo = measured["slo"]
    settings = Settings(slo["ttft_ms"] / 1e3, slo["tpot_ms"] / 1e3,
                        prefill_batched_tokens=serve_prefill_budget(args.device == "cuda"))
    cost, out = StepTimes.fit(profile), {}
    run_args = {"num_requests": args.num_requests, "seed": args.seed, "vocab": args.vocab}
    for i, (rate, run) in enumerate(measured["runs"].items()):
        requests = arrivals(run_args, "chat", rate, args.seed + i, args.vocab)
        done = Simulation(Layout(0, 1), cost, profile, settings).run(requests)
        sim = [(1e3 * (r.first_token - r.arrival), 1e3 * (r.finish - r.first_token) / (r.output_len - 1)) for r in done]
        pairs = [(s, m) for s, m in zip(sim, run["per_request"]) if None not in m]
        (st, sp), (mt, mp) = zip(*[s for s, _ in pairs]), zip(*[m for _, m in pairs])
        out[rate] = {"ttft_ms": {"simulated": percentiles(st), "measured": percentiles(mt),
                                 "mean": [round(float(np.mean(st)), 2), round(float(np.mean(mt)), 2)]},
                     "tpot_ms": {"simulated": percentiles(sp), "measured": percentiles(mp),
                                 "mean": [round(float(np.mean(sp)), 3), round(float(np.mean(mp)), 3)]},
                     "attainment": {"simulated": round(float(np.mean([r.meets(settings) for r in done])), 3),
                                    "measured": round(sum(t <= slo["ttft_ms"] and p <= slo["tpot_ms"]
                                                          for t, p in zip(mt, mp)) / len(run["per_request"]), 3)}}
        print(f"{rate} req/s replayed: TTFT p50/p90/p99 simulated {out[rate]['ttft_ms']['simulated']} measured "
              f"{out[rate]['ttft_ms']['measured']}; TPOT {out[rate]['tpot_ms']['simulated']} / "
              f"{out[rate]['tpot_ms']['measured']}; attainment {out[rate]['attainment']}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer-dir", required=True, help="a tokenizer.json's directory")
    ap.add_argument("--rates", default="1.875,2.25")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--work", default="/tmp/plan_one_gpu")
    ap.add_argument("--json", required=True)
    ap.add_argument("--dry-run", action="store_true", help="on the CPU: the tiny shape, short prompts, few requests")
    args = ap.parse_args()
    # What node_kwargs and serve_once read: xpyd_h200x4.py's node flags.
    args.async_scheduling, args.max_num_batched_tokens = True, None
    args.kv_cache_memory, args.max_model_len = "24GiB", 8192
    args.connector, args.kv_buffer_device, args.device, args.dtype, shape = "tcp", "cuda", "cuda", "bfloat16", "8b"
    if args.dry_run:
        WORKLOADS.update(DRY_WORKLOADS)
        args.device, args.dtype, shape = "cpu", "float32", "tiny"
        args.kv_cache_memory, args.max_model_len = "256MiB", 1024
        args.rates, args.num_requests = "2", 6
    args.vocab = SHAPES[shape]["vocab_size"]
    start = time.time()
    model = write_model(shape, Path(args.work) / f"llama-{shape}", Path(args.tokenizer_dir), args.device)
    prof = profile(args, model)
    measured = measure(args, model)
    result = {"profile": json.loads(prof.to_json()), "measured": measured, "replay": replay(args, prof, measured)}
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"done in {time.time() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
