"""End to end: disaggregated 1P1D against a colocated node, same model, same total cores, QPS sweep.

    python benchmarks/e2e_disagg_vs_colocated.py --qps 0.1,0.2,0.4 --num-requests 6 --repeats 2 \
        --input-len 128 --output-len 32 --json e2e.json --plot e2e.png

Both systems are up for the whole run (idle nodes cost nothing) and each rate is measured on
both, side by side, alternating which goes first. Load comes from `disagg bench serve`'s load
generator (Poisson arrivals, streaming, random token-id prompts so no prefix-cache hits, ignore_eos).

CPU layout (--cores 0,1): the prefill node is pinned to the first core and the decode node to the
second (`taskset -c N`, OMP_NUM_THREADS=1 each); the colocated node gets both cores and
--colocated-threads threads (default 2). The helpers here (node start/stop, a sweep) are reused by
kv_handoff.py and gpu_e2e.py.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from disagg.bench import add_serve_args  # noqa: E402
from disagg.bench.serve import run_benchmark  # noqa: E402
from disagg.launch import wait_healthy  # noqa: E402

# `disagg serve` without building the whole CLI parser: the node's own flags and nothing else.
SERVE = ("import argparse, logging, sys; from disagg import cli, vllm_flags; p = argparse.ArgumentParser(); "
         "cli.add_engine_args(p); cli.add_serve_args(p); vllm_flags.add_vllm_flags(p); a = p.parse_args(sys.argv[1:]); "
         "logging.basicConfig(level=a.log_level.upper(), "
         "format='%(asctime)s %(levelname)s %(name)s: %(message)s'); cli.serve(a)")

EMBEDDED_VOCAB = 49152  # SmolLM2's


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    role: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    grpc_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric_sum(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(f"{name} not in {self.url}/metrics")


@dataclass
class NodeSpec:
    """How to start one node: cores to pin, threads, device, environment."""
    cpus: str | None = None  # taskset list, e.g. "0" or "0,1"
    threads: int = 1
    device: str = "cpu"
    env: dict = field(default_factory=dict)


def start_node(role: str, log_dir: Path, spec: NodeSpec, *, model: str | None = None, dtype: str | None = None,
               connector: str = "tcp", prefill_node: Node | None = None, extra: list[str] = (),
               kv_buffer_device: str | None = None, kv_buffer_size: float | None = None,
               kv_extra: dict | None = None) -> Node:
    port = free_port()
    argv = [sys.executable, "-c", SERVE] + ([model] if model else [])
    argv += ["--kv-role", role, "--port", str(port), "--device", spec.device, "--log-level", "INFO"]
    if dtype:
        argv += ["--dtype", dtype]
    grpc_port = None
    if role != "both":
        kv = {"kv_connector": connector, "kv_ip": "127.0.0.1", "kv_port": free_port()}
        if kv_buffer_device:
            kv["kv_buffer_device"] = kv_buffer_device
        if kv_buffer_size:
            kv["kv_buffer_size"] = kv_buffer_size
        if kv_extra:
            kv["kv_connector_extra_config"] = kv_extra
        argv += ["--kv-transfer-config", json.dumps(kv)]
    if role == "producer":
        grpc_port = free_port()
        argv += ["--grpc-port", str(grpc_port)]
    if prefill_node is not None:
        argv += ["--prefill-nodes", f"127.0.0.1:{prefill_node.grpc_port}"]
    argv += list(extra)
    if spec.cpus:
        argv = ["taskset", "-c", spec.cpus] + argv
    env = {**os.environ, "OMP_NUM_THREADS": str(spec.threads), "PYTHONUNBUFFERED": "1", **spec.env}
    log_path = log_dir / f"{role}-{port}.log"
    proc = subprocess.Popen(argv, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return Node(role, proc, port, log_path, grpc_port)


def wait_ready(node: Node, timeout: float = 600.0) -> None:
    try:
        wait_healthy(node.url, node.proc, timeout)
    except RuntimeError as e:
        raise RuntimeError(f"{node.role} node: {e}:\n{node.log()[-3000:]}") from None


def stop(nodes: list[Node]) -> None:
    for node in nodes:
        if node.proc.poll() is None:
            node.proc.terminate()
    for node in nodes:
        try:
            node.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait()


@dataclass
class System:
    name: str
    front: Node  # the node clients call
    nodes: list[Node]
    prefill: Node | None = None


def save_metrics(sys_by_name: dict[str, System], log_dir: Path) -> None:
    """Every node's /metrics beside its log: the TTFT split and the tiers' counters, for a later look."""
    for system in sys_by_name.values():
        for node in system.nodes:
            (log_dir / f"{node.role}-{node.port}.metrics").write_text(httpx.get(f"{node.url}/metrics", timeout=10).text)


@contextmanager
def systems(log_dir: Path, colocated: NodeSpec | None, prefill: NodeSpec | None, decode: NodeSpec | None,
            prefill_extra: list[str] = (), **node_kwargs):
    """Start the colocated node and/or the 1P1D pair, wait for them, yield {name: System}, stop them.
    prefill_extra: flags for the prefill node alone (after node_kwargs' extra)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    started: list[Node] = []
    out: dict[str, System] = {}
    try:
        if colocated is not None:
            node = start_node("both", log_dir, colocated, **node_kwargs)
            started.append(node)
            out["colocated"] = System("colocated", node, [node])
        if prefill is not None:
            extra = [*node_kwargs.get("extra", ()), *prefill_extra]
            p = start_node("producer", log_dir, prefill, **(node_kwargs | {"extra": extra}))
            started.append(p)
            wait_ready(p)  # the decode node handshakes with it at start
            d = start_node("consumer", log_dir, decode, prefill_node=p, **node_kwargs)
            started.append(d)
            out["disagg"] = System("disagg", d, [p, d], prefill=p)
        for node in started:
            wait_ready(node)
        yield out
    finally:
        stop(started)


def bench_args(base_url: str, **overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--base-url", base_url, "--no-progress"])
    for key, value in overrides.items():
        setattr(args, key.replace("-", "_"), value)
    return args


def warm_up(system: System, vocab: int) -> None:
    """Two short requests: first-call costs (allocations, kernel choices, the pipe's connect) stay out."""
    args = bench_args(system.front.url, qps="inf", num_requests=2, input_len=64, output_len=4,
                      prompt_kind="token-ids", vocab_size=vocab, seed=12345)
    run_benchmark(args)


SUMMARY_KEYS = ["request_throughput", "output_throughput"] + [
    f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2e") for stat in ("mean", "median", "p99")]


def median_runs(runs: list[dict]) -> dict:
    """Medians, key by key, of the same rate's summaries over repeats."""
    out = {"qps": runs[0]["qps"], "repeats": len(runs), "failed": sum(r["failed"] for r in runs)}
    for key in SUMMARY_KEYS:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def sweep(sys_by_name: dict[str, System], rates: list[str], repeats: int, **bench_overrides) -> dict[str, dict]:
    """Each rate on every system, alternating which goes first; {name: bench-serve-style result}."""
    names = list(sys_by_name)
    per: dict[str, dict[str, list[dict]]] = {n: {r: [] for r in rates} for n in names}
    step = 0
    for repeat in range(repeats):
        for rate in rates:
            order = names if step % 2 == 0 else names[::-1]
            step += 1
            for name in order:
                args = bench_args(sys_by_name[name].front.url, qps=rate, seed=1000 * repeat + 17,
                                  label=name, **bench_overrides)
                result = run_benchmark(args)
                run = result["runs"][0]
                run.pop("requests")
                print(f"  [{name} repeat {repeat}] load {os.getloadavg()[0]:.1f}", flush=True)
                per[name][rate].append(run)
    return {name: {"label": name, "runs": [median_runs(per[name][r]) for r in rates],
                   "all_runs": per[name]} for name in names}


def table(results: dict[str, dict]) -> str:
    lines = ["| QPS | system | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | E2E p50 ms |",
             "|---|---|---|---|---|---|---|"]
    names = list(results)
    for i in range(len(results[names[0]]["runs"])):
        for name in names:
            r = results[name]["runs"][i]
            lines.append(f"| {r['qps']} | {name} | {r['request_throughput']:.3f} | {r['output_throughput']:.2f} | "
                         f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                         f"{r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} | {r['median_e2e_ms']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--qps", default="0.1,0.2,0.4", help="comma-separated rates (inf = all at once)")
    ap.add_argument("--num-requests", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--cores", default="0,1", help="two CPU ids: prefill on the first, decode on the second")
    ap.add_argument("--colocated-threads", type=int, default=2)
    ap.add_argument("--connector", default="tcp")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--vocab-size", type=int, default=EMBEDDED_VOCAB)
    ap.add_argument("--log-dir", default="/tmp/disagg-e2e-logs")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    first, second = args.cores.split(",")
    rates = [r.strip() for r in args.qps.split(",")]
    start = time.time()
    with systems(Path(args.log_dir), NodeSpec(cpus=args.cores, threads=args.colocated_threads),
                 NodeSpec(cpus=first), NodeSpec(cpus=second), model=args.model,
                 connector=args.connector) as sys_by_name:
        for system in sys_by_name.values():
            warm_up(system, args.vocab_size)
        results = sweep(sys_by_name, rates, args.repeats, num_requests=args.num_requests, input_len=args.input_len,
                        output_len=args.output_len, prompt_kind="token-ids", vocab_size=args.vocab_size)
        remote = sys_by_name["disagg"].front.log().count("recomputing it here")
    print(f"\n{time.time() - start:.0f}s; decode node recomputed {remote} prompt(s) locally")
    print(table(results))
    if args.json:
        report = {"args": vars(args), "results": results, "recomputed": remote}
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.plot:
        from disagg.bench.plot import plot_results

        plot_results(list(results.values()), args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
