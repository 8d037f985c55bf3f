"""Issue 26 on two GPUs: `disagg router --routing cache_aware` against `least_loaded`, 2P2D, shared prefixes.

    python benchmarks/cache_aware_h200x2.py --tokenizer-dir DIR --json benchmarks/results/cache_aware.json
    python benchmarks/cache_aware_h200x2.py --device cpu --shape tiny --prefix-len 256 --json /tmp/cache_aware.json

Layout: on each GPU one prefill node and one decode node (gpu_e2e.py's random-weight 8B shape,
bfloat16, each process seeing its GPU alone through CUDA_VISIBLE_DEVICES, as handoff_h200x2.py lays
them out), every decode node listing both prefill nodes. All four start at once from one written
model: a decode node handshakes again every second with a prefill node that is not up yet
(decode_node/prefill_client.py), so none waits for another's load. Two routers, one per policy,
front the same two decode nodes; all six processes stay up for the whole run.

Pipe: `tcp` with the KV buffer in host memory (`kv_buffer_device` cpu) for every pair. A decode
node pairs with the prefill node on its own GPU and with the one on the other, and the prefill
nodes pair with each other for prefix pulls; NCCL refuses two ranks on one GPU in a communicator,
and every node must name the same `kv_connector` (the Info handshake refuses a prefill node whose
pipe differs), so torch_dist over NCCL cannot serve the same-GPU pairs and cannot be used for the
others either. torch_dist with the buffer on the host (gloo) would do, at loopback TCP's speed
(BENCHMARKS.md, "KV pipes"); tcp is the one already run with several nodes on one H200
(BENCHMARKS.md, "One H200, tcp") and receives straight into the decode node's blocks.

What the policy changes: the router's pick of a decode node, nothing else. `least_loaded` takes the
one with fewer requests in flight; `cache_aware` the one whose prefix cache holds most of the prompt
(from its /kv_events), by load for a prompt no node holds 30% of. The decode node then routes the
prompt by its own `remote_prefill` (--remote-prefill; "auto" by default, decode_node/route.py): a
prompt whose prefix its cache holds has only the suffix left, which it computes itself, a miss it
computes itself or sends to a prefill node, whichever its measured costs say is sooner. The decode
node's PrefillPool picks the prefill node by expected time, its Watch view of each node's prefix
cache included (prefill_client.py): always cache-aware, with no switch per request, so both
policies' remote prefills go to the prefill node holding the prefix (or it pulls the prefix from
the other one, "Prefix pull"). What is compared is the router's policy alone.

Runs: each policy gets its own random prefixes in every run (seeds differ by policy, repeat and
rate), so no run hits another's prefixes, and which policy goes first alternates from one
(repeat, rate) step to the next. A run: --num-prefixes prefixes of --prefix-len tokens, each the
start of --uses-per-prefix requests (one turn each) in random order, plus --input-len new tokens,
--output-len tokens out, Poisson arrivals at the rate (`disagg bench serve --workload
shared-prefix`). A warm-up first: two long random prompts at once on each decode node (both pipes
connected, both prefill engines run, a remote prefill measured for "auto") and a small
shared-prefix run through each router.

Reported per policy and rate, over all its repeats' requests: `hit_rate`, the decode nodes'
vllm:prefix_cache_hits / queries (every request enters one decode node and its prompt tokens are
counted there once, whether computed there, cached there or received; this is the rate the
router's pick acts on); `hit_rate_prefill`, the prefill nodes' over the prompts sent to them
(pulled blocks count as hits); TTFT p50/p99 and mean, TPOT p50 (client side); where prompts were
computed (`disagg_prefill_route_total`) and prefix pulls by outcome. `ttft_p50_ratio` = cache_aware's
TTFT p50 / least_loaded's (issue 26's goal: <= 0.5). The top-level keys are at the first of
--rates; `by_rate` has every rate.

By counting: while each decode node's cache holds every prefix of a run (the defaults: 16 GiB is
31 prompts of 4,160 tokens of the 8B shape, a run has 8 prefixes), least_loaded misses about the
first request of a prefix on each of the two decode nodes (2 of 6), cache_aware the first one only
(1 of 6); both p50s are then hits, and the difference shows in the hit rate, the mean and the tail.
A smaller --decode-kv-cache-memory (or more prefixes) makes least_loaded miss more.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_disagg_vs_colocated import Node, System, bench_args, start_node, stop, wait_ready
from gpu_e2e import SHAPES, write_model
from handoff_h200x2 import start_router
from xpyd_h200x4 import node_spec

from disagg.bench.serve import percentile, prefix_cache_counters, prefix_cache_delta, run_benchmark
from disagg.launch import wait_healthy

POLICIES = ("cache_aware", "least_loaded")
GPUS = 2  # one prefill and one decode node on each
# The warm-up's shared-prefix run: enough to hit both caches and follow both routers' views.
WARM_PREFIXES, WARM_USES = 2, 3


class Clock:
    """Seconds since the script started, against its budget, printed at each stage."""

    def __init__(self, budget: float):
        self.start, self.budget = time.time(), budget

    def elapsed(self) -> float:
        return time.time() - self.start

    def stage(self, what: str) -> None:
        print(f"[{self.elapsed():4.0f} s of {self.budget:.0f}] {what}", flush=True)


def engine_flags(args: argparse.Namespace, kv_cache_memory: str) -> list[str]:
    # The longest prompt and answer of the run, so a node reserves nothing for longer ones.
    max_model_len = args.prefix_len + args.input_len + args.output_len
    return ["--kv-cache-memory", kv_cache_memory, "--max-model-len", str(max_model_len)]


@contextmanager
def cluster(args: argparse.Namespace, model: Path, log_dir: Path):
    """The four nodes, started at once, and a router per policy in front of the decode nodes; yields
    (prefill nodes, decode nodes, {policy: router URL}) and stops them all."""
    log_dir.mkdir(parents=True, exist_ok=True)
    kwargs = dict(model=str(model), dtype=args.dtype, connector="tcp", kv_buffer_device="cpu",
                  kv_buffer_size=4e9,  # a bound, not an allocation: several 4k prompts' KV (520 MiB each) at once
                  kv_extra={"remote_prefill": args.remote_prefill})
    started: list[Node] = []
    routers: list[subprocess.Popen] = []
    try:
        prefill = [start_node("producer", log_dir, node_spec(args, gpu), extra=engine_flags(args, args.kv_cache_memory),
                              **kwargs) for gpu in range(GPUS)]
        started += prefill
        addresses = ",".join(f"127.0.0.1:{p.grpc_port}" for p in prefill)
        decode = [start_node("consumer", log_dir, node_spec(args, gpu),
                             extra=[*engine_flags(args, args.decode_kv_cache_memory), "--prefill-nodes", addresses],
                             **kwargs) for gpu in range(GPUS)]
        started += decode
        for node in started:
            wait_ready(node)
        for node in decode:  # every pair handshaken and its cache view followed before the first request
            wait_healthy(node.url, node.proc, 60, until=lambda health: all(
                health["prefill_nodes"].values()) and all(s["watching"] for s in health["prefill_state"].values()))
        fronts = [System(f"decode-{gpu}", node, [node]) for gpu, node in enumerate(decode)]
        urls = {}
        for policy in POLICIES:
            proc, urls[policy] = start_router(log_dir, fronts, model, ["--routing", policy])
            routers.append(proc)
        yield prefill, decode, urls
    finally:
        for proc in routers:
            proc.terminate()
            proc.wait(timeout=20)
        stop(started)


def labeled_counts(nodes: list[Node], name: str, label: str) -> dict[str, float]:
    """A labeled counter summed over the nodes, by its label's value."""
    counts: dict[str, float] = {}
    for node in nodes:
        text = httpx.get(f"{node.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    key = sample.labels[label]
                    counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def node_counters(prefill: list[Node], decode: list[Node]) -> dict:
    return {"prefill_cache": prefix_cache_counters([f"{n.url}/metrics" for n in prefill], {}),
            "routes": labeled_counts(decode, "disagg_prefill_route_total", "route"),
            "pulls": labeled_counts(prefill, "disagg_prefix_pulls_total", "outcome")}


def shared_prefix_run(args: argparse.Namespace, url: str, prefill: list[Node], decode: list[Node], rate: str,
                      seed: int, num_prefixes: int, uses: int) -> dict:
    """One `bench serve --workload shared-prefix` run through a router; its summary, each request's
    [TTFT ms, TPOT ms] (None where it failed) and the nodes' counters over the run."""
    before = node_counters(prefill, decode)
    bench = bench_args(url, workload="shared-prefix", num_prefixes=num_prefixes, prefix_len=args.prefix_len,
                       turns=1, num_requests=num_prefixes * uses, input_len=args.input_len,
                       output_len=args.output_len, qps=rate, prompt_kind="token-ids", vocab_size=args.vocab,
                       seed=seed, metrics_url=[f"{n.url}/metrics" for n in decode])
    run = run_benchmark(bench)["runs"][0]
    requests = run.pop("requests")
    run["per_request"] = [[1e3 * r["ttft"] if r["ok"] else None, 1e3 * r["tpot"] if r["tpot"] else None]
                          for r in requests]
    after = node_counters(prefill, decode)
    run["prefill_cache"] = prefix_cache_delta(before["prefill_cache"], after["prefill_cache"])
    for key in ("routes", "pulls"):
        run[key] = {k: v - before[key].get(k, 0.0) for k, v in after[key].items()}
    return run


def warm_up(args: argparse.Namespace, prefill: list[Node], decode: list[Node], urls: dict[str, str]) -> None:
    """First-call costs (kernel choices, the pipes' connects, each route's first measurement) out of the runs."""
    for i, node in enumerate(decode):
        # Two at once: the pool sends the second to the other prefill node (the first prompt counts in the
        # first node's queue), so both pipes of this decode node connect.
        run_benchmark(bench_args(node.url, qps="inf", num_requests=2, input_len=args.prefix_len + args.input_len,
                                 output_len=4, prompt_kind="token-ids", vocab_size=args.vocab, seed=90 + i))
    for i, url in enumerate(urls.values()):
        shared_prefix_run(args, url, prefill, decode, args.rates.split(",")[0], 80 + i, WARM_PREFIXES, WARM_USES)


def pooled(runs: list[dict]) -> dict:
    """One policy's runs at one rate, their requests and counters pooled."""
    ttft = [t for r in runs for t, _ in r["per_request"] if t is not None]
    tpot = [p for r in runs for _, p in r["per_request"] if p is not None]
    out = {}
    for name, key in (("hit_rate", "prefix_cache"), ("hit_rate_prefill", "prefill_cache")):
        queries = sum(r[key]["queries"] for r in runs)
        out[name] = sum(r[key]["hits"] for r in runs) / queries if queries else None
    for key in ("routes", "pulls"):
        out[key] = {k: sum(r[key].get(k, 0.0) for r in runs) for k in sorted({k for r in runs for k in r[key]})}
    return out | {"ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99),
                              "mean": sum(ttft) / len(ttft) if ttft else None},
                  "tpot_ms": {"p50": percentile(tpot, 50)}, "repeats": len(runs),
                  "requests": sum(r["num_requests"] for r in runs), "failed": sum(r["failed"] for r in runs)}


def summarize(runs: list[dict], rates: list[str]) -> dict:
    """Per rate and policy, pooled over repeats; the top-level keys at the first rate."""
    by_rate = {}
    for rate in rates:
        row = {policy: pooled(mine) for policy in POLICIES
               if (mine := [r for r in runs if r["policy"] == policy and r["rate"] == rate])}
        if all(p in row for p in POLICIES) and row["least_loaded"]["ttft_ms"]["p50"]:
            row["ttft_p50_ratio"] = row["cache_aware"]["ttft_ms"]["p50"] / row["least_loaded"]["ttft_ms"]["p50"]
        by_rate[rate] = row
    head = by_rate[rates[0]]
    return {key: {p: head[p][key] for p in POLICIES if p in head}
            for key in ("hit_rate", "hit_rate_prefill", "ttft_ms", "tpot_ms")} | {
        "ttft_p50_ratio": head.get("ttft_p50_ratio"), "by_rate": by_rate}


def summary_lines(result: dict) -> list[str]:
    def num(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    lines = []
    for rate, row in result.get("by_rate", {}).items():
        for policy in POLICIES:
            if policy not in row:
                continue
            s = row[policy]
            ttft = s["ttft_ms"]
            lines.append(f"{policy:12s} @ {rate} req/s: hit rate {num(s['hit_rate'], '.3f')} (decode nodes; "
                         f"prefill nodes {num(s['hit_rate_prefill'], '.3f')}), TTFT p50/p99 {num(ttft['p50'], '.0f')}/"
                         f"{num(ttft['p99'], '.0f')} ms (mean {num(ttft['mean'], '.0f')}), TPOT p50 "
                         f"{num(s['tpot_ms']['p50'], '.1f')} ms; prompts computed {s['routes']}, pulls {s['pulls']}; "
                         f"{s['requests']} requests in {s['repeats']} runs, {s['failed']} failed")
        if "ttft_p50_ratio" in row:
            ratio = row["ttft_p50_ratio"]
            lines.append(f"ttft_p50 cache_aware / least_loaded @ {rate} req/s: {ratio:.3f} "
                         f"(goal <= 0.5: {'met' if ratio <= 0.5 else 'missed'})")
    return lines


def machine(args: argparse.Namespace) -> str:
    if args.device == "cpu":
        return f"CPU, {os.cpu_count()} cores"
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip().splitlines()
    return f"{len(gpus)} x {gpus[0]}" if gpus else "unknown GPUs"


def write_json(args: argparse.Namespace, result: dict) -> None:
    Path(args.json).write_text(json.dumps(result, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer-dir", help="a tokenizer.json's directory (default: the embedded model's)")
    ap.add_argument("--shape", default="8b", choices=list(SHAPES))
    ap.add_argument("--device", default="cuda", help="cpu (with --shape tiny) tries the script without GPUs")
    # The model is handoff_h200x2.py's (same shape, seed and tokenizer): a machine that wrote it keeps it.
    ap.add_argument("--work", default="/tmp/handoff_h200x2")
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--uses-per-prefix", type=int, default=6, help="requests that start with each prefix")
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--input-len", type=int, default=64, help="each request's own tokens after its prefix")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rates", default="2", help="comma-separated request rates (Poisson), each run per policy")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each policy at each rate")
    ap.add_argument("--remote-prefill", default="auto", choices=["auto", "always"],
                    help="the decode nodes' route (kv_connector_extra_config.remote_prefill)")
    ap.add_argument("--kv-cache-memory", help="each node's KV cache (default: 16GiB on cuda, 256MiB on cpu)")
    ap.add_argument("--decode-kv-cache-memory", help="the decode nodes' alone (default: --kv-cache-memory)")
    ap.add_argument("--budget", type=float, default=500.0,
                    help="seconds: a run starts only if the longest so far fits in what is left")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    clock = Clock(args.budget)
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.vocab = SHAPES[args.shape]["vocab_size"]
    args.kv_cache_memory = args.kv_cache_memory or ("16GiB" if args.device == "cuda" else "256MiB")
    args.decode_kv_cache_memory = args.decode_kv_cache_memory or args.kv_cache_memory
    if args.tokenizer_dir is None:
        from disagg.engine.loader import resolve_model

        args.tokenizer_dir = str(resolve_model(None))
    rates = [r.strip() for r in args.rates.split(",")]
    result: dict = {"machine": machine(args), "args": vars(args),
                    "measured": {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                 "device": args.device}}  # the commit: by hand (the GPU machine's copy may not say)
    model = write_model(args.shape, Path(args.work) / f"llama-{args.shape}", Path(args.tokenizer_dir),
                        "cuda" if args.device == "cuda" else "cpu")
    clock.stage(f"model at {model}")
    if args.device == "cuda":
        import torch

        torch.cuda.empty_cache()  # GPU 0's memory is the nodes' now: give back what writing the model cached
    runs: list[dict] = []
    with cluster(args, model, Path(args.work) / "logs-cache") as (prefill, decode, urls):
        clock.stage(f"4 nodes and 2 routers up: {urls}")
        warm_up(args, prefill, decode, urls)
        clock.stage("warmed up")
        longest, step = 0.0, 0
        for repeat in range(args.repeats):
            for i, rate in enumerate(rates):
                order = POLICIES if step % 2 == 0 else POLICIES[::-1]
                step += 1
                for policy in order:
                    if clock.elapsed() + longest > args.budget:
                        clock.stage(f"skipping {policy} @ {rate} req/s, repeat {repeat}: the budget is spent")
                        continue
                    began = time.time()
                    # Seeds unique to (repeat, rate, policy): every run's prefixes are its own.
                    seed = 1000 + 100 * repeat + 10 * i + POLICIES.index(policy)
                    run = shared_prefix_run(args, urls[policy], prefill, decode, rate, seed, args.num_prefixes,
                                            args.uses_per_prefix)
                    runs.append({"policy": policy, "rate": rate, "repeat": repeat, "seed": seed, **run})
                    longest = max(longest, time.time() - began)
                    result |= {"runs": runs} | summarize(runs, rates)
                    write_json(args, result)  # what is known so far, if the time limit stops the run
                    clock.stage(f"{policy} @ {rate} req/s, repeat {repeat} done")
    clock.stage("nodes stopped")
    for line in summary_lines(result):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
