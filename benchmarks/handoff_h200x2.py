"""The KV handoff on two GPUs: what disaggregation costs one request, and what it buys under load.

    python benchmarks/handoff_h200x2.py --tokenizer-dir DIR --phase ttft --json ttft.json
    python benchmarks/handoff_h200x2.py --tokenizer-dir DIR --phase goodput --json goodput.json
    python benchmarks/handoff_h200x2.py --merge ttft.json goodput.json --json benchmarks/results/handoff_h200x2.json
    python benchmarks/handoff_h200x2.py --json benchmarks/results/handoff_h200x2.json --plot goodput.png

The random-weight 8B shape of gpu_e2e.py's write_model, bfloat16, KV over torch_dist (NCCL) with
the KV buffer on the GPU. Each phase fits one 10-minute call of the GPU machine.

- ttft: a colocated node on GPU 0 and a 1P1D pair (prefill node on GPU 0, decode node on GPU 1;
  with --gpus 1 on GPU 0 too, over a pipe other than NCCL), one request at a time, prompts of
  --lens tokens, alternating which system goes first, medians of --repeats. `ttft_ratio` =
  TTFT 1P1D / TTFT colocated per length; the exposed handoff at 8k = TTFT 1P1D - TTFT colocated
  (the prefill node's compute equals the colocated node's, same GPU kind, same engine, same
  prompt), for each --kv-modes value (`whole`: the prompt's KV sent after its last layer;
  `layerwise`: each layer's as soon as it is computed; kv_connector_extra_config.layerwise).
- goodput: 1P1D against two colocated nodes (one a GPU) behind `disagg router`, all four nodes up
  at once, for each of --workloads (WORKLOADS: 4k/256, and chat-shaped lognormal lengths): first
  the unloaded colocated TTFT and TPOT (medians of 6 requests one at a time), which set the SLO
  (TTFT <= 4x, TPOT <= 1.25x); then Poisson arrivals at each --rates-WORKLOAD value on both
  systems. A system's goodput rate is the highest rate whose requests meet the SLO 90% of the
  time; `goodput_ratio[workload]` = 1P1D's over the colocated pair's. Every run also keeps each
  request's TTFT and TPOT and its attainment at SLO_SCALES multiples of the SLO.
"""

import argparse
import dataclasses
import json
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_disagg_vs_colocated import REPO, NodeSpec, System, bench_args, free_port, save_metrics, systems, warm_up
from gpu_e2e import SHAPES, write_model
from kv_handoff import measure, ttft_of

from disagg.bench.serve import run_benchmark
from disagg.launch import wait_healthy
from disagg.timeline import show, timeline

ATTAINMENT = 0.9
# The handoff's steps, timed by the nodes (histograms on /metrics): each 1P1D run reports their means.
HANDOFF_STEPS = {"decode": ["remote_prefill_call", "kv_lookup_wait", "kv_entry_receive", "kv_load",
                            "first_token_delay"],
                 "prefill": ["prefill_compute", "kv_buffer_insert", "kv_part_send", "first_token_send"]}


STEP_PREFIXES = ("colocated_", "decode_", "prefill_")  # measure()'s per-request splits


def node_kwargs(args: argparse.Namespace, model: Path, mode: str) -> dict:
    extra = ["--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len)]
    if args.async_scheduling:
        extra.append("--async-scheduling")
    if args.max_num_batched_tokens:  # prompts longer than this are computed (and sent) in chunks
        extra += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return dict(model=str(model), dtype=args.dtype, connector=args.connector, extra=extra,
                kv_buffer_device=args.kv_buffer_device if args.device == "cuda" else None,
                kv_buffer_size=4e9,  # a 16k prompt's KV is 2 GiB (the default 1e9 bytes refuses 8k ones)
                # "always": the handoff is what is measured, whatever the prompt's length.
                kv_extra={"layerwise": mode == "layerwise", "remote_prefill": "always"})


def specs(args: argparse.Namespace) -> tuple[NodeSpec, NodeSpec]:
    if args.device == "cpu":
        return NodeSpec(threads=1), NodeSpec(threads=1)
    gpus = [NodeSpec(device="cuda", threads=4, env={"CUDA_VISIBLE_DEVICES": str(i)}) for i in range(args.gpus)]
    return gpus[0], gpus[-1]  # one GPU: the decode node shares it (and then a GPU pipe cannot be NCCL)


def ttft_phase(args: argparse.Namespace, model: Path) -> dict:
    gpu0, gpu1 = specs(args)
    lens = [int(n) for n in args.lens.split(",")]
    prefill, prefill_extra = gpu0, []
    if args.prefill_tp > 1:  # the prefill node on both GPUs; each rank sends its own KV heads
        prefill = dataclasses.replace(gpu0, env={"CUDA_VISIBLE_DEVICES": "0,1"})
        prefill_extra = ["--tensor-parallel-size", str(args.prefill_tp)]
    out, traces, timelines = {}, {}, {}
    for mode in args.kv_modes.split(","):
        log_dir = Path(args.work) / f"logs-ttft-{mode}"
        kwargs = node_kwargs(args, model, mode)
        if args.profile:
            kwargs["extra"] = kwargs["extra"] + ["--profiler-config", json.dumps(
                {"profiler": "torch", "torch_profiler_dir": str(log_dir / "traces")})]
        with systems(log_dir, gpu0, prefill, gpu1, prefill_extra, **kwargs) as sys_by_name:
            measure(sys_by_name, [64, 512], 1, args.vocab, seed=999)  # warm-up: kernels for both paths
            rows = measure(sys_by_name, lens, args.repeats, args.vocab, raw_client=True)
            save_metrics(sys_by_name, log_dir)
            if args.profile:  # after the timed requests: the profiler's cost stays out of them
                traces[mode], timelines[mode] = profile_requests(sys_by_name["disagg"], lens, args.vocab)
        out[mode] = {n: {"ttft_colocated_ms": r["ttft_colocated"] * 1e3, "ttft_disagg_ms": r["ttft_disagg"] * 1e3,
                         "prefill_ms": r["prefill"] * 1e3, "exposed_ms": r["overhead"] * 1e3,
                         "ttft_ratio": r["ttft_disagg"] / r["ttft_colocated"], "kv_mib": r["kv_mib"],
                         # Medians of each request's split (kv_handoff.py's docstring says what each is).
                         "timeline_ms": {k: r[k] * 1e3 for k in r if k.startswith(STEP_PREFIXES)},
                         "samples_s": r["samples"]}
                     for n, r in rows.items()}
        print(f"[{mode}] " + "; ".join(f"{n}: ratio {r['ttft_ratio']:.3f}, exposed {r['exposed_ms']:+.1f} ms"
                                       for n, r in out[mode].items()), flush=True)
    first = next(iter(out.values()))
    traced = {"ttft_torch_traces": traces, "ttft_request_timeline": timelines} if traces else {}
    if args.prefill_tp > 1:
        return {f"ttft_prefill_tp{args.prefill_tp}": out} | traced
    return traced | {"ttft": out, "ttft_ratio": {str(n): r["ttft_ratio"] for n, r in first.items()},
            "exposed_handoff_ms_8k": {mode: rows[8192]["exposed_ms"] for mode, rows in out.items() if 8192 in rows},
            "ttft_fixed_ms_512": first[512]["timeline_ms"]["colocated_fixed"] if 512 in first else None,
            "ttft_fixed_ms_512_raw_client": (first[512]["timeline_ms"]["colocated_fixed_raw_client"]
                                             if 512 in first else None)}


def profile_requests(system: System, lens: list[int], vocab: int) -> tuple[dict[str, str], dict[str, list]]:
    """One 1P1D request of each length under both nodes' torch.profiler (/start_profile, /stop_profile):
    each node's GPU timeline (kernels, copies, NCCL, every stream) beside its threads' ops, for the
    handoff's own costs (the export, the send, the receive, the first token's way). Trace paths by
    length and node, and by length the request's way through both nodes (disagg/timeline.py). A request
    of 64 tokens goes first in each trace: the profiler's first op on a thread costs that thread ~1 ms."""
    rng, traces, timelines = random.Random(7), {}, {}
    for n in lens:
        first, prompt = ([rng.randrange(1000, vocab) for _ in range(k)] for k in (64, n))
        nodes = [system.prefill, system.front]

        def run(first: list[int] = first, prompt: list[int] = prompt) -> None:
            ttft_of(system.front.url, first)
            ttft_of(system.front.url, prompt)

        traced = node_traces(nodes, run)
        traces |= {f"{n}-{node}": trace for node, trace in traced.items()}
        timelines[str(n)] = timeline(*(traced[f"{node.role}-{node.port}"] for node in nodes))
        print(f"one request of {n} tokens, both nodes (ms from the decode node's API):\n{show(timelines[str(n)])}",
              flush=True)
    return traces, timelines


def start_router(log_dir: Path, fronts: list[System], model: Path,
                 extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """`disagg router` (cache aware unless `extra` says otherwise) in front of the systems' front nodes; it
    hashes prompts with the served model's tokenizer, as the nodes do."""
    port = free_port()
    nodes = ",".join(f"127.0.0.1:{s.front.port}" for s in fronts)
    argv = [sys.executable, "-m", "disagg.cli", "router", "--decode-nodes", nodes, "--port", str(port),
            "--tokenizer", str(model), *extra]
    proc = subprocess.Popen(argv, stdout=(log_dir / f"router-{port}.log").open("w"), stderr=subprocess.STDOUT,
                            cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 60)
    return proc, url


# Two workloads: prefill-heavy (every prompt 4k tokens, short answers) and chat-shaped (prompts
# lognormal around 1k tokens, answers around 512; lengths capped at 4x the median).
WORKLOADS = {"4k": dict(input_len=4096, output_len=256, len_dist="fixed", len_range=0.0),
             "chat": dict(input_len=1024, output_len=512, len_dist="lognormal", len_range=0.6)}
# The SLO: TTFT <= 4x and TPOT <= 1.25x the unloaded colocated values (the tight SLO); each
# run's attainment is also reported at these multiples of both limits (DistServe's SLO-scale plot).
TTFT_SLO, TPOT_SLO = 4.0, 1.25
SLO_SCALES = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0)


def serve_once(url: str, args: argparse.Namespace, workload: str, rate: str, num_requests: int, seed: int,
               slo: list[str], max_concurrency: int | None = None) -> dict:
    # exact_rate: 40 Poisson arrivals otherwise land +-16% off their rate by chance, blurring the curve.
    bench = bench_args(url, qps=rate, num_requests=num_requests, prompt_kind="token-ids", vocab_size=args.vocab,
                       seed=seed, goodput=slo, max_concurrency=max_concurrency, exact_rate=True, **WORKLOADS[workload])
    cpu = time.process_time()
    run = run_benchmark(bench)["runs"][0]
    # The client's own CPU a second of the run: near 1, its event loop (which stamps each token) is the limit.
    run["client_cpu"] = round((time.process_time() - cpu) / run["duration_s"], 3)
    requests = run.pop("requests")
    # Per request, for attainment at any SLO: [ttft ms, tpot ms] (None where it failed).
    run["per_request"] = [[r["ok"] and 1e3 * r["ttft"], r["tpot"] and 1e3 * r["tpot"]] for r in requests]
    return run


def attainment(per_request: list, ttft_ms: float, tpot_ms: float) -> float:
    met = [t is not None and p is not None and t <= ttft_ms and p <= tpot_ms for t, p in per_request]
    return sum(met) / len(met) if met else 0.0


def goodput_phase(args: argparse.Namespace, model: Path) -> dict:
    gpu0, gpu1 = specs(args)
    log_dir = Path(args.work) / "logs-goodput"
    kwargs = node_kwargs(args, model, args.kv_modes.split(",")[-1])
    if args.profile:  # every node serves /start_profile; TraceWindow uses it during the middle rate
        kwargs["extra"] = kwargs["extra"] + ["--profiler-config", json.dumps(
            {"profiler": "torch", "torch_profiler_dir": str(log_dir / "traces")})]
    result = {}
    prefill_extra = ["--max-num-batched-tokens", str(args.prefill_max_num_batched_tokens)] \
        if args.prefill_max_num_batched_tokens else []
    with systems(log_dir, gpu0, gpu0, gpu1, prefill_extra=prefill_extra, **kwargs) as pair_and_first, \
            systems(log_dir, gpu1, None, None, **kwargs) as second:
        router, router_url = start_router(log_dir, [pair_and_first["colocated"], second["colocated"]], model)
        disagg = pair_and_first["disagg"]
        try:
            urls = {"colocated_x2": router_url, "disagg_1p1d": disagg.front.url}
            decoders = {"colocated_x2": [pair_and_first["colocated"].front, second["colocated"].front],
                        "disagg_1p1d": [disagg.front]}
            for system in (pair_and_first["colocated"], second["colocated"], disagg):
                warm_up(system, args.vocab)
            for workload in args.workloads.split(","):
                rates = getattr(args, f"rates_{workload}").split(",")
                result[workload] = workload_sweep(args, workload, rates, urls, decoders, pair_and_first, disagg,
                                                  log_dir)
                write_json(args, summarize_goodput(result))  # what is known so far, if the time limit stops the run
        finally:
            router.terminate()
            router.wait(timeout=20)
    return summarize_goodput(result)


def workload_sweep(args: argparse.Namespace, workload: str, rates: list[str], urls: dict, decoders: dict,
                   pair_and_first: dict, disagg: System, log_dir: Path) -> dict:
    for url in urls.values():  # a few loaded batches of the sweep's shape: first-batch costs stay out
        serve_once(url, args, workload, rates[len(rates) // 2], 8, 99, [])
    # Unloaded: one request at a time on one colocated node.
    unloaded = serve_once(pair_and_first["colocated"].front.url, args, workload, "inf", 6, 100, [], max_concurrency=1)
    ttft, tpot = unloaded["median_ttft_ms"], unloaded["median_tpot_ms"]
    slo = {"ttft_ms": TTFT_SLO * ttft, "tpot_ms": TPOT_SLO * tpot, "unloaded_ttft_ms": ttft, "unloaded_tpot_ms": tpot}
    print(f"{workload}: unloaded colocated TTFT {ttft:.0f} ms, TPOT {tpot:.2f} ms -> SLO TTFT <= "
          f"{slo['ttft_ms']:.0f} ms, TPOT <= {slo['tpot_ms']:.2f} ms", flush=True)
    goodput = [f"ttft:{slo['ttft_ms']:.0f}", f"tpot:{slo['tpot_ms']:.2f}"]
    runs = {name: {} for name in urls}
    for i, rate in enumerate(rates):
        for name in (list(urls) if i % 2 == 0 else list(urls)[::-1]):
            middle = rate == rates[len(rates) // 2]
            profile = args.profile and middle
            # py-spy on the system's first decoding node (and the 1P1D prefill node), alone with --pyspy.
            sampled = decoders[name][:1] + ([disagg.prefill] if name == "disagg_1p1d" else [])
            samplers = start_profiles(sampled, log_dir, f"{workload}-{rate}-{name}") \
                if middle and (args.pyspy or profile) else []
            window = TraceWindow(sampled) if profile else None
            before, engines_before = handoff_sums(disagg), engine_sums(decoders[name])
            r = runs[name][rate] = serve_once(urls[name], args, workload, rate, args.num_requests, args.seed + i,
                                              goodput)
            r["engine"] = engine_means(engines_before, engine_sums(decoders[name]))
            stop_profiles(samplers)
            if window is not None:
                r["torch_traces"] = window.join()
                print(f"    torch.profiler traces: {r['torch_traces']}", flush=True)
            r["attainment_by_slo_scale"] = {str(k): attainment(r["per_request"], k * slo["ttft_ms"], k * slo["tpot_ms"])
                                            for k in SLO_SCALES}
            line = (f"  {workload} {name:13s} rate {rate:>5s}: {100 * r['goodput_fraction']:.0f}% within SLO, "
                    f"TTFT p50/p99 {r['median_ttft_ms']:.0f}/{r['p99_ttft_ms']:.0f} ms, TPOT p50/p99 "
                    f"{r['median_tpot_ms']:.2f}/{r['p99_tpot_ms']:.2f} ms, ITL p99 {r['p99_itl_ms']:.1f} ms")
            print(line, flush=True)
            print("    decoding engines: " + ", ".join(f"{k} {v:.2f}" for k, v in r["engine"].items()), flush=True)
            if name == "disagg_1p1d":
                r["handoff_mean_ms"] = handoff_means(before, handoff_sums(disagg))
                print("    handoff means, ms: " + ", ".join(f"{step} {ms:.1f}"
                                                          for step, ms in r["handoff_mean_ms"].items()), flush=True)
        save_metrics(pair_and_first, log_dir)
    return {"slo": slo, "unloaded": unloaded, "runs": runs}


def start_profiles(nodes: list, log_dir: Path, label: str) -> list[subprocess.Popen]:
    """py-spy (if installed) sampling the nodes for one run: every thread (--idle: waits too) of each,
    and the thread that holds the GIL (--gil) of the first."""
    samplers = []
    for node, mode in [(node, "--idle") for node in nodes] + [(nodes[0], "--gil")]:
        out = log_dir / f"pyspy-{label}-{node.role}{mode.replace('--', '-')}.txt"
        argv = ["py-spy", "record", "--pid", str(node.proc.pid), "--rate", "200", "--format", "raw",
                "--threads", mode, "--output", str(out), "--nonblocking"]
        try:
            log = (log_dir / f"{out.name}.log").open("w")
            samplers.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log))
        except FileNotFoundError:
            print("    (py-spy is not installed: no profile)", flush=True)
            break
    return samplers


class TraceWindow:
    """A torch.profiler trace (the nodes' /start_profile, /stop_profile) of `length_s` seconds from
    `delay_s` into a run, on a thread of its own while the run goes on: each node's GPU timeline
    (kernels, NCCL, copies, on every stream) beside its engine thread's ops."""

    def __init__(self, nodes: list, delay_s: float = 8.0, length_s: float = 2.0):
        self.nodes, self.traces = nodes, {}
        self.thread = threading.Thread(target=self._run, args=(delay_s, length_s), daemon=True)
        self.thread.start()

    def _run(self, delay_s: float, length_s: float) -> None:
        time.sleep(delay_s)
        self.traces = node_traces(self.nodes, lambda: time.sleep(length_s))

    def join(self) -> dict[str, str]:
        self.thread.join()
        return self.traces


def node_traces(nodes: list, run: Callable[[], object]) -> dict[str, str]:
    """The nodes' torch.profiler traces (their /start_profile, /stop_profile) around run(): the trace's
    path by node ("role-port")."""
    for node in nodes:
        httpx.post(f"{node.url}/start_profile", timeout=60).raise_for_status()
    run()
    traces = {}
    for node in nodes:
        stopped = httpx.post(f"{node.url}/stop_profile", timeout=600)
        traces[f"{node.role}-{node.port}"] = stopped.json().get("trace") or stopped.text
    return traces


def stop_profiles(samplers: list[subprocess.Popen]) -> None:
    for proc in samplers:
        proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    for proc in samplers:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def handoff_sums(disagg: System) -> dict[str, tuple[float, float]]:
    """Each handoff step's histogram (sum, count) on the 1P1D pair's nodes."""
    nodes = {"decode": disagg.front, "prefill": disagg.prefill}
    return {name: (nodes[role].metric_sum(f"disagg_{name}_seconds_sum"),
                   nodes[role].metric_sum(f"disagg_{name}_seconds_count"))
            for role, names in HANDOFF_STEPS.items() for name in names}


# The decoding nodes' own view of a run: histograms (sum, count) summed over a system's decoding nodes.
ENGINE_SUMS = {"tpot_ms": "disagg_request_time_per_output_token_seconds", "step_tokens": "disagg_engine_step_tokens",
               "ttft_ms": "disagg_time_to_first_token_seconds", "queue_ms": "disagg_request_queue_time_seconds",
               "prefill_ms": "disagg_request_prefill_time_seconds"}


def engine_sums(nodes: list) -> dict[str, tuple[float, float]]:
    return {key: (sum(n.metric_sum(f"{name}_sum") for n in nodes), sum(n.metric_sum(f"{name}_count") for n in nodes))
            for key, name in ENGINE_SUMS.items()}


def engine_means(before: dict, after: dict) -> dict[str, float]:
    """Means over one run: the engines' TPOT (first token to last, per token), the node's TTFT (its API's
    request to first token), a request's queue time (arrival to its first blocks) and prefill time (blocks to
    first token), in ms, and the tokens of a step (with decoding alone, the batch)."""
    out = {}
    for key, (total, count) in after.items():
        mean = (total - before[key][0]) / max(1.0, count - before[key][1])
        out[key] = mean * 1e3 if key.endswith("_ms") else mean
    out["steps"] = after["step_tokens"][1] - before["step_tokens"][1]
    return out


def handoff_means(before: dict, after: dict) -> dict[str, float]:
    """Mean ms of each handoff step over one run (a kv_part_send is a part, the others a request)."""
    return {name: 1e3 * (after[name][0] - before[name][0]) / max(1.0, after[name][1] - before[name][1])
            for name in after}


def kept_rate(rate: str, run: dict) -> float:
    """The rate a run's arrivals kept (`arrival_rate`), or the nominal `rate` where it has none."""
    return run.get("arrival_rate") or float(rate)


def summarize_goodput(result: dict) -> dict:
    """Per workload: each system's goodput rate (the highest rate its arrivals kept, `arrival_rate`, with
    >= 90% of its requests within the SLO) and 1P1D's over the colocated pair's."""
    out = {"goodput": result, "goodput_rate": {}, "goodput_ratio": {}}
    for workload, w in result.items():
        best = {name: max([kept_rate(rate, r) for rate, r in by_rate.items()
                           if r["goodput_fraction"] >= ATTAINMENT], default=0.0) for name, by_rate in w["runs"].items()}
        out["goodput_rate"][workload] = best
        out["goodput_ratio"][workload] = best["disagg_1p1d"] / best["colocated_x2"] if best["colocated_x2"] else None
    return out


def pool_goodput(paths: list[str]) -> dict:
    """Goodput phases of the same systems on one machine, some rates repeated: each run a point at the
    rate its arrivals kept (`arrival_rate`; the nominal rate where a run has none), the requests within
    the SLO (each run's own) counted over every run at that rate, and the goodput rates and ratio from
    those fractions, as summarize_goodput takes them. The systems of one run see the same arrivals."""
    pooled: dict = {}
    for path in paths:
        for workload, w in json.loads(Path(path).read_text())["goodput"].items():
            for name, by_rate in w["runs"].items():
                for rate, r in by_rate.items():
                    key = f"{kept_rate(rate, r):.2f}"
                    cell = pooled.setdefault(workload, {}).setdefault(name, {}).setdefault(
                        key, {"within": 0, "requests": 0, "runs": 0, "nominal": []})
                    cell["within"] += round(r["goodput_fraction"] * r["num_requests"])
                    cell["requests"] += r["num_requests"]
                    cell["runs"] += 1
                    cell["nominal"].append(rate)
    runs = {workload: {"runs": {name: {rate: {"goodput_fraction": c["within"] / c["requests"]} | c
                                       for rate, c in sorted(by_rate.items(), key=lambda kv: float(kv[0]))}
                                for name, by_rate in systems.items()}}
            for workload, systems in pooled.items()}
    summary = summarize_goodput(runs)
    return {"goodput_pooled": {"files": [Path(p).name for p in paths], "attainment": runs},
            "goodput_rate": summary["goodput_rate"], "goodput_ratio": summary["goodput_ratio"]}


def plot_goodput(result: dict, png: str) -> None:
    """Per workload: attainment against rate at the SLO, and against SLO scale at each rate (DistServe's
    two plots), both systems."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = result["goodput"]
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 4 * len(workloads)), squeeze=False)
    for row, (workload, w) in zip(axes, workloads.items()):
        for name, runs in w["runs"].items():
            rates = sorted(runs, key=float)
            row[0].plot([float(r) for r in rates], [100 * runs[r]["goodput_fraction"] for r in rates], "o-", label=name)
            for rate in rates:
                scales = runs[rate]["attainment_by_slo_scale"]
                row[1].plot([float(k) for k in scales], [100 * v for v in scales.values()],
                            "o-" if name == "disagg_1p1d" else "s--", label=f"{name} @ {rate} req/s")
        slo = w["slo"]
        row[0].set(title=f"{workload}: TTFT <= {slo['ttft_ms']:.0f} ms, TPOT <= {slo['tpot_ms']:.2f} ms",
                   xlabel="request rate (req/s)", ylabel="% of requests within SLO", ylim=(0, 105))
        row[1].set(title=f"{workload}: attainment against SLO scale", xlabel="SLO scale (x both limits)",
                   ylabel="% within SLO", ylim=(0, 105))
        row[0].axhline(100 * ATTAINMENT, color="grey", lw=0.5)
        row[1].axhline(100 * ATTAINMENT, color="grey", lw=0.5)
        row[0].legend()
        row[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def load(spec: str) -> dict:
    """FILE, or FILE:KEY.KEY for the part of it under those keys."""
    path, _, keys = spec.partition(":")
    data = json.loads(Path(path).read_text())
    for key in keys.split(".") if keys else []:
        data = data[key]
    return data


def merge_json(paths: list[str], out: str) -> None:
    """Phase results (one JSON object each) joined into one file, later keys winning."""
    result = {}
    for path in paths:
        result.update(json.loads(Path(path).read_text()))
    Path(out).write_text(json.dumps(result, indent=1))


def write_json(args: argparse.Namespace, result: dict) -> None:
    args_key = f"{args.phase}_args"
    Path(args.json).write_text(json.dumps({args_key: {k: v for k, v in vars(args).items() if k != "merge"}} | result,
                                          indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer-dir")
    ap.add_argument("--phase", choices=["ttft", "goodput"])
    ap.add_argument("--merge", nargs="+", help="phase JSON files to join into one result")
    ap.add_argument("--pool", nargs="+", help="goodput phase JSON files of one machine to pool by rate (pool_goodput)")
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--device", default="cuda", help="cpu (with --shape tiny) tries the script without GPUs")
    ap.add_argument("--connector", default="torch_dist")
    ap.add_argument("--work", default="/tmp/handoff_h200x2")
    ap.add_argument("--lens", default="512,2048,8192,16384")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-modes", default="whole,layerwise", help="whole and/or layerwise, comma-separated")
    ap.add_argument("--gpus", type=int, default=2, choices=[1, 2])
    ap.add_argument("--prefill-tp", type=int, default=1, choices=[1, 2],
                    help="ttft: the 1P1D prefill node's TP (2: on both GPUs, beside the decode node, so the KV "
                         "pipe must be nixl or tcp: NCCL pairs no two processes on one GPU)")
    ap.add_argument("--kv-buffer-device", default="cuda", help="cpu with --gpus 1 --connector tcp")
    ap.add_argument("--workloads", default="4k,chat", help=f"of {', '.join(WORKLOADS)}")
    ap.add_argument("--rates-4k", default="2,3,4,5,6")
    ap.add_argument("--rates-chat", default="4,8,12,16")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--seed", type=int, default=7, help="the arrivals of the sweep's i-th rate are drawn with "
                    "seed + i (the same for every system); another seed, other arrival sequences to pool")
    ap.add_argument("--prefill-max-num-batched-tokens", type=int,
                    help="the prefill node's chunk size alone (goodput; it has no decode batch to keep moving)")
    ap.add_argument("--pyspy", action="store_true",
                    help="during the middle rate's runs: py-spy alone (no torch.profiler) on each system's first "
                         "decoding node and the 1P1D prefill node")
    ap.add_argument("--profile", action="store_true",
                    help="goodput: during the middle rate's run, py-spy on both 1P1D nodes, and a 2 s torch.profiler "
                         "trace of the decoding nodes (and the prefill node) of each system; ttft: after the timed "
                         "requests, one 1P1D request of each length under both nodes' torch.profiler")
    ap.add_argument("--kv-cache-memory", default="24GiB")
    ap.add_argument("--async-scheduling", action="store_true", help="every node steps ahead (--async-scheduling)")
    ap.add_argument("--max-model-len", type=int, default=16384 + 64)
    ap.add_argument("--max-num-batched-tokens", type=int, help="the nodes' chunk size (default: theirs, 2048)")
    ap.add_argument("--json", required=True)
    ap.add_argument("--plot", help="with --json of a goodput result: write its attainment plots to this PNG")
    args = ap.parse_args()
    if args.plot:
        plot_goodput(json.loads(Path(args.json).read_text()), args.plot)
        return 0
    if args.pool:
        Path(args.json).write_text(json.dumps(pool_goodput(args.pool), indent=1))
        return 0
    if args.merge:
        merge_json(args.merge, args.json)
        return 0
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.vocab = SHAPES[args.shape]["vocab_size"]
    start = time.time()
    model = write_model(args.shape, Path(args.work) / f"llama-{args.shape}", Path(args.tokenizer_dir),
                        "cuda" if args.device == "cuda" else "cpu")
    write_json(args, ttft_phase(args, model) if args.phase == "ttft" else goodput_phase(args, model))
    print(f"{args.phase} done in {time.time() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
