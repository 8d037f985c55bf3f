"""A node's engine steps in its torch.profiler trace (`/start_profile` ... `/stop_profile`), by batch.

The engine names each step's launch `disagg_step seqs=B prompt_tokens=P context=C` (engine.step_range).
Per step: its launch, the GPU work it launched (the kernels and copies whose correlation ids are those of
the runtime calls made inside its range: first start, last end, busy time), the interval to the next
step's launch and its period on the GPU (its first GPU work to the next step's: what a token waits); then,
for the decode-only steps grouped by batch size, the medians of those, the share of steps that had an NCCL
kernel (a KV transfer, or a receive waiting for one) on the GPU beside them and their busy time and period
apart from the others', and, given the `disagg plan profile` the plan used, its decode step for that
batch and context beside the measured interval.

    python benchmarks/step_timeline.py TRACE.json.gz [--profile PROFILE.json] [--json out.json]
"""

import argparse
import bisect
import gzip
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

STEP = re.compile(r"disagg_step seqs=(\d+) prompt_tokens=(\d+) context=(\d+)")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def steps_of(events: list[dict]) -> list[dict]:
    """Every named step in launch order, with the GPU work its launch queued (None on a CPU trace)."""
    gpu_by_corr = defaultdict(list)
    for e in events:
        if e.get("cat") in GPU_CATS and "correlation" in e.get("args", {}):
            gpu_by_corr[e["args"]["correlation"]].append(e)
    runtime = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")), key=lambda e: e["ts"])
    runtime_ts = [e["ts"] for e in runtime]
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and "nccl" in e["name"].lower()]
    steps = []
    # The range on the launching thread (CUDA traces repeat it on the GPU's timeline as a gpu_user_annotation).
    ranges = (e for e in events if e.get("cat") != "gpu_user_annotation" and STEP.fullmatch(e["name"]))
    for e in sorted(ranges, key=lambda e: e["ts"]):
        seqs, prompt, context = map(int, STEP.fullmatch(e["name"]).groups())
        inside = runtime[bisect.bisect_left(runtime_ts, e["ts"]):bisect.bisect_right(runtime_ts, e["ts"] + e["dur"])]
        calls = [r for r in inside if r["tid"] == e["tid"]]
        work = [g for r in calls for g in gpu_by_corr.get(r.get("args", {}).get("correlation"), [])]
        spans = [(g["ts"], g["ts"] + g["dur"]) for g in work]
        step = {"launch_us": e["ts"], "seqs": seqs, "prompt_tokens": prompt, "context": context,
                "gpu_start_us": min(s for s, _ in spans) if spans else None,
                "gpu_end_us": max(t for _, t in spans) if spans else None,
                "gpu_busy_us": busy_us(spans) if spans else None}
        if spans:
            step["beside_nccl"] = any(s < step["gpu_end_us"] and t > step["gpu_start_us"] for s, t in nccl)
        steps.append(step)
    for step, after in zip(steps, steps[1:]):
        step["interval_us"] = after["launch_us"] - step["launch_us"]
        if step["gpu_start_us"] is not None and after["gpu_start_us"] is not None:
            step["period_us"] = after["gpu_start_us"] - step["gpu_start_us"]
    return steps


def medians_ms(steps: list[dict]) -> dict:
    """Busy time and period on the GPU of these steps, medians in ms."""
    return {"steps": len(steps),
            "gpu_busy_ms": round(statistics.median(s["gpu_busy_us"] for s in steps) / 1e3, 3),
            "period_ms": round(statistics.median(s["period_us"] for s in steps) / 1e3, 3)}


def by_batch(steps: list[dict], profile_path: str | None) -> dict:
    """The decode-only steps (each but the last) grouped by batch size: medians in ms."""
    cost = None
    if profile_path:
        from disagg.plan.profile import Profile
        from disagg.plan.simulate import StepTimes

        cost = StepTimes.fit(Profile.load(profile_path))
    groups = defaultdict(list)
    for s in steps:
        if s["prompt_tokens"] == 0 and "interval_us" in s:
            groups[s["seqs"]].append(s)
    out = {}
    for seqs, group in sorted(groups.items()):
        row = {"steps": len(group), "interval_ms": round(statistics.median(s["interval_us"] for s in group) / 1e3, 3),
               "context_per_seq": round(statistics.median(s["context"] for s in group) / seqs)}
        timed = [s for s in group if s["gpu_busy_us"] is not None]
        if timed:
            row["gpu_span_ms"] = round(statistics.median(s["gpu_end_us"] - s["gpu_start_us"] for s in timed) / 1e3, 3)
            row["gpu_busy_ms"] = round(statistics.median(s["gpu_busy_us"] for s in timed) / 1e3, 3)
            row["beside_nccl"] = round(sum(s["beside_nccl"] for s in timed) / len(timed), 3)
            for key, beside in (("alone", False), ("with_nccl", True)):
                split = [s for s in timed if s["beside_nccl"] is beside and "period_us" in s]
                if split:
                    row[key] = medians_ms(split)
        if cost is not None:
            context = statistics.median(s["context"] for s in group)
            row["profile_step_ms"] = round(1e3 * cost.seconds(0, seqs, int(context)), 3)
        out[seqs] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--profile", help="a `disagg plan profile` JSON: its decode step beside each batch's")
    ap.add_argument("--json")
    args = ap.parse_args()
    steps = steps_of(load_events(Path(args.trace)))
    if not steps:
        print("no disagg_step ranges in this trace (a node's /start_profile trace of this engine has them)")
        return 1
    table = by_batch(steps, args.profile)
    prompts = [s for s in steps if s["prompt_tokens"]]
    print(f"{len(steps)} steps, {len(prompts)} with prompt tokens; decode-only steps by batch (medians):")
    for seqs, row in table.items():
        extra = "".join(f", {k} {v}" for k, v in row.items() if k not in ("steps", "interval_ms", "alone", "with_nccl"))
        extra += "".join(f"; {k}: busy {row[k]['gpu_busy_ms']} ms, period {row[k]['period_ms']} ms ({row[k]['steps']})"
                         for k in ("alone", "with_nccl") if k in row)
        print(f"  {seqs:4d} seqs: {row['steps']:5d} steps, launch to launch {row['interval_ms']} ms{extra}")
    if args.json:
        Path(args.json).write_text(json.dumps({"trace": args.trace, "by_batch": table, "steps": steps}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
