"""Marks on a request's way through a node's threads, for the torch.profiler trace the node writes
between /start_profile and /stop_profile (engine/profiler.py), and the request's timeline read back
from a prefill node's and a decode node's traces.

Each mark is a CPU op of no length named `disagg.<where>` on the thread that got there; nothing is
recorded, and almost nothing spent, while no profiler runs. Trace times are on the host's clock, so the
traces of two nodes on one host line up into one timeline of a request, hop by hop, beside the prefill
node's steps and, on GPUs, where the prompt's last kernel and each node's last NCCL kernel ended:

    python -m disagg.timeline PREFILL_TRACE DECODE_TRACE

The request read is the last to reach the decode node's API in the traces: what came before is left
out. Under the profiler a thread's first recorded op costs it about a millisecond (the profiler's state
for that thread), so the traces should hold a request before it that went the same way
(benchmarks/handoff_h200x2.py --phase ttft --profile takes them so).
"""

import argparse
import gzip
import json
import sys
from pathlib import Path

import torch


def mark(name: str) -> None:
    # torch.profiler's own flag, set for the whole process while a profile runs (the C++ check answers
    # for this thread only); a record_function costs ~4 us even with no profiler.
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(name):
            pass


START = "disagg.api.request"


def events(path: str) -> list[dict]:
    """The trace's events, each `ts` (and its end) made absolute µs on the host's clock: a trace's times
    count from its own base, the same in every process of a host."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    base = trace.get("baseTimeNanoseconds", 0) / 1e3
    out = []
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and "ts" in e:
            out.append(e | {"ts": e["ts"] + base, "end": e["ts"] + base + e.get("dur", 0)})
    return out


def rows(node: str, trace: list[dict], threads: dict[int, str]) -> list[tuple[float, str, str, str]]:
    """(µs, node, thread, what) for the trace's marks, steps with prompt tokens, and GPU milestones."""
    out = []
    marks = [e for e in trace if e.get("cat") == "user_annotation" and e["name"].startswith("disagg.")]
    for e in marks:
        out.append((e["ts"], node, threads.setdefault(e["tid"], f"t{len(threads)}"), e["name"]))
    steps = [e for e in trace if e.get("cat") == "user_annotation" and e["name"].startswith("disagg_step")]
    for e in steps:
        if "prompt_tokens=0 " not in e["name"]:
            thread = threads.setdefault(e["tid"], f"t{len(threads)}")
            out += [(e["ts"], node, thread, f"step start ({e['name'].removeprefix('disagg_step ')})"),
                    (e["end"], node, thread, "step end")]
    kernels = [e for e in trace if e.get("cat") == "kernel"]
    nccl = [e for e in kernels if e["name"].startswith("nccl")]
    if nccl:
        out.append((max(e["end"] for e in nccl), node, "gpu", "last NCCL kernel end"))
    put = [e["ts"] for e in marks if e["name"] == "disagg.producer.first_token_put"]
    compute = [e for e in kernels if not e["name"].startswith("nccl") and put and e["end"] <= put[0]]
    if compute:
        out.append((max(e["end"] for e in compute), node, "gpu", "prompt's last kernel end"))
    return out


def timeline(prefill_trace: str, decode_trace: str) -> list[dict]:
    """The last request's rows in time order: ms from the decode node's API mark, node, thread, what."""
    threads: dict[int, str] = {}
    table = rows("prefill", events(prefill_trace), threads) + rows("decode", events(decode_trace), threads)
    starts = [t for t, node, _, what in table if node == "decode" and what == START]
    if not starts:
        raise ValueError(f"no {START} mark in {decode_trace}: not a decode node's trace of a request")
    start = max(starts)
    return [{"ms": round((t - start) / 1e3, 3), "node": node, "thread": thread, "what": what}
            for t, node, thread, what in sorted(table) if t >= start]


def show(table: list[dict]) -> str:
    lines, last = [], None
    for r in table:
        step = "" if last is None else f"+{r['ms'] - last:.3f}"
        lines.append(f"{r['ms']:10.3f} {step:>9s}  {r['node']:8s} {r['thread']:4s} {r['what']}")
        last = r["ms"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prefill_trace")
    ap.add_argument("decode_trace")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    table = timeline(args.prefill_trace, args.decode_trace)
    print(show(table))
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
