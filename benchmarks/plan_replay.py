"""The plan's simulator against measured runs, request by request: where `plan_error` comes from.

`disagg plan` predicts goodput from Poisson arrivals of its own; a measured run had one arrival
sequence, and 150 requests hold a burst or two. This replays each measured run's exact arrivals
(drawn again as `disagg bench serve` drew them: the run's seed, `--exact-rate`) and lengths in the
simulator, with the run's SLO, and sets each request's simulated TTFT and TPOT beside its measured
ones: percentiles, their correlation, the attainment of both, and a least-squares line measured =
a + b x simulated TPOT per layout (b > 1: the measured steps grow with load faster than the profile's).

    python benchmarks/plan_replay.py --profile benchmarks/results/xpyd_h200x4.json:plan_profile \\
        benchmarks/results/xpyd_h200x4.json:runs.76a584e benchmarks/results/xpyd_h200x4.json:runs.c7a0d5f

Each RUN is a goodput JSON of xpyd_h200x4.py (`--phase goodput`), the profile one of `disagg plan
profile`; FILE:KEY.KEY takes the part of a merged result under those keys."""

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_disagg_vs_colocated import bench_args
from handoff_h200x2 import WORKLOADS, load
from xpyd_h200x4 import LAYOUTS

from disagg.bench.serve import arrival_offsets, build_conversations
from disagg.plan import serve_prefill_budget
from disagg.plan.profile import Profile
from disagg.plan.simulate import Layout, Request, Settings, Simulation, StepTimes

PERCENTILES = (50, 90, 99)


def arrivals(run_args: dict, workload: str, rate: str, seed: int, vocab: int) -> list[Request]:
    """The run's requests as `disagg bench serve` made them: the same seed, lengths and exact-rate arrivals."""
    args = bench_args("http://127.0.0.1:1", qps=rate, num_requests=run_args["num_requests"], prompt_kind="token-ids",
                      vocab_size=vocab, seed=seed, exact_rate=True, **WORKLOADS[workload])
    rng = random.Random(seed)
    conversations = build_conversations(args, rng)
    offsets = arrival_offsets(len(conversations), float(rate), args.burstiness, rng, True)
    return [Request(t, turns[0].input_len, turns[0].output_len) for t, turns in zip(offsets, conversations)]


def percentiles(values: list[float]) -> list[float]:
    return [round(float(np.percentile(values, q)), 2) for q in PERCENTILES]


def replay(profile: Profile, runs: list[dict]) -> dict:
    cost = StepTimes.fit(profile)
    out: dict = {}
    for run in runs:
        run_args = run["goodput_args"]
        for workload, w in run["goodput"].items():
            settings = Settings(w["slo"]["ttft_ms"] / 1e3, w["slo"]["tpot_ms"] / 1e3,
                                batched_tokens=run_args.get("max_num_batched_tokens") or 2048,
                                prefill_batched_tokens=run_args.get("prefill_max_num_batched_tokens")
                                or serve_prefill_budget(profile.on_gpu))
            rates = getattr(argparse.Namespace(**run_args), f"rates_{workload}").split(",")
            for name, measured_runs in w["runs"].items():
                prefill, decode, tp = LAYOUTS[name]
                if tp != 1:
                    continue  # the simulator has no TP layouts
                for i, rate in enumerate(rates):
                    measured = measured_runs[rate]["per_request"]
                    requests = arrivals(run_args, workload, rate, run_args["seed"] + i, run_args["vocab"])
                    done = Simulation(Layout(prefill, decode), cost, profile, settings).run(requests)
                    sim_tpot = [1e3 * (r.finish - r.first_token) / (r.output_len - 1) for r in done]
                    sim_ttft = [1e3 * (r.first_token - r.arrival) for r in done]
                    ok = [(s, m) for s, m in zip(zip(sim_ttft, sim_tpot), measured) if None not in m]
                    (st, sp), (mt, mp) = zip(*[s for s, _ in ok]), zip(*[m for _, m in ok])
                    out.setdefault(workload, {}).setdefault(name, {})[rate] = {
                        "tpot_ms": {"simulated": percentiles(sp), "measured": percentiles(mp),
                                    "correlation": round(float(np.corrcoef(sp, mp)[0, 1]), 3)},
                        "ttft_ms": {"simulated": percentiles(st), "measured": percentiles(mt),
                                    "correlation": round(float(np.corrcoef(st, mt)[0, 1]), 3)},
                        "attainment": {"simulated": round(float(np.mean([r.meets(settings) for r in done])), 3),
                                       "measured": round(sum(t <= 1e3 * settings.ttft_s and p <= 1e3 * settings.tpot_s
                                                             for t, p in zip(mt, mp)) / len(measured), 3)},
                        "pairs": [[round(s, 3), round(m, 3)] for s, m in zip(sp, mp)]}
    for layouts in out.values():
        for by_rate in layouts.values():
            pairs = np.array([p for r in by_rate.values() for p in r.pop("pairs")])
            b, a = np.polyfit(pairs[:, 0], pairs[:, 1], 1)
            fitted = a + b * pairs[:, 0]
            r2 = 1 - ((pairs[:, 1] - fitted) ** 2).sum() / ((pairs[:, 1] - pairs[:, 1].mean()) ** 2).sum()
            by_rate["tpot_line"] = {"a_ms": round(float(a), 3), "b": round(float(b), 3), "r2": round(float(r2), 3),
                                    "requests": len(pairs)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="goodput JSON files (FILE or FILE:KEY.KEY)")
    ap.add_argument("--profile", required=True, help="the `disagg plan profile` the plan used (FILE or FILE:KEY)")
    ap.add_argument("--json")
    args = ap.parse_args()
    # A profile kept in a results file carries when and how it was taken beside its fields.
    profile = {k: v for k, v in load(args.profile).items() if k not in ("when", "command")}
    result = replay(Profile.from_json(json.dumps(profile)), [load(spec) for spec in args.runs])
    for workload, layouts in result.items():
        for name, by_rate in layouts.items():
            line = by_rate.pop("tpot_line")
            for rate, r in sorted(by_rate.items(), key=lambda kv: float(kv[0])):
                print(f"{workload} {name:12s} {rate:>4s} req/s: TPOT p50/p90/p99 simulated {r['tpot_ms']['simulated']} "
                      f"measured {r['tpot_ms']['measured']} (r {r['tpot_ms']['correlation']}); attainment "
                      f"{r['attainment']['simulated']:.0%} simulated, {r['attainment']['measured']:.0%} measured")
            print(f"{workload} {name:12s} measured TPOT = {line['a_ms']} ms + {line['b']} x simulated "
                  f"(R² {line['r2']}, {line['requests']} requests)")
            by_rate["tpot_line"] = line
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": args.profile, "runs": args.runs, "replay": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
