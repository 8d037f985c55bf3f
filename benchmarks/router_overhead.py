"""The router's and the bench client's share of a TTFT while many streams flow, on the CPU.

Stand-in decode nodes (raw asyncio HTTP, all in one process of their own) answer a completion
TTFT seconds after its request arrived, then send one server-sent event per sequence every STEP
seconds, every sequence of a node at once, as a decode step does. They cost little CPU, so what a
client measures above their own TTFT is the time spent in the client, the router and the loopback
hops. `disagg bench serve` sends the chat-shaped workload of the four-H200 runs (prompts around 1k
tokens, answers around 512, 8.25 req/s: about 3,800 streamed tokens a second) to one stand-in
directly, and through `disagg router` over four (least loaded, and cache aware: it hashes each prompt):

    python benchmarks/router_overhead.py --json benchmarks/results/router_overhead.json
    python benchmarks/router_overhead.py --compare /tmp/old-checkout ...   # that checkout's client and router too

`overhead_ms`: the client's mean TTFT minus the stand-ins' (from a request's arrival to its first
event); `router_cpu`, `client_cpu`: CPU seconds a second of the run.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# --- the stand-in decode nodes (run as `router_overhead.py --stand-in PORTS TTFT STEP LOG`) ---------

class StandIn:
    def __init__(self, ttft: float, step: float, log):
        self.ttft, self.step, self.log = ttft, step, log
        # [writer, tokens left, finished, when the request arrived (None once sent), tokens]
        self.streams: list[list] = []

    @staticmethod
    def done(tokens: int) -> bytes:
        event = f'data: {{"id":"cmpl-x","choices":[],"usage":{{"completion_tokens":{tokens}}}}}\n\ndata: [DONE]\n\n'
        return b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event.encode())

    async def steps(self) -> None:
        event = json.dumps({"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "stand-in",
                            "choices": [{"index": 0, "text": " a", "logprobs": None, "finish_reason": None}]})
        chunk = f"data: {event}\n\n".encode()
        chunk = b"%x\r\n%s\r\n" % (len(chunk), chunk)
        while True:
            began = time.perf_counter()
            for stream in list(self.streams):
                if stream[3] is not None:
                    self.log.write(f"{1e3 * (began - stream[3]):.3f}\n")
                    stream[3] = None
                stream[1] -= 1
                stream[0].write(chunk if stream[1] > 0 else chunk + self.done(stream[4]))
                if stream[1] <= 0:
                    self.streams.remove(stream)
                    stream[2].set()
            await asyncio.sleep(max(0.0, self.step - (time.perf_counter() - began)))

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                headers = dict(line.lower().split(": ", 1) for line in head[1:] if ": " in line)
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                arrived = time.perf_counter()
                if not head[0].startswith("POST"):  # /health
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                    continue
                tokens = json.loads(body).get("max_tokens", 16)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                await asyncio.sleep(self.ttft)
                finished = asyncio.Event()
                self.streams.append([writer, tokens, finished, arrived, tokens])
                await finished.wait()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def stand_ins(ports: list[int], ttft: float, step: float, log) -> None:
    for port in ports:
        node = StandIn(ttft, step, log)
        asyncio.get_running_loop().create_task(node.steps())
        await asyncio.start_server(node.serve, "127.0.0.1", port)
    await asyncio.Event().wait()


# --- the measurement --------------------------------------------------------------------------------

def free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_up(url: str, limit: float = 60) -> None:
    import urllib.request

    deadline = time.monotonic() + limit
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def run(args: argparse.Namespace, checkout: Path, routing: str | None, work: Path) -> dict:
    """One bench run against the stand-ins: straight to the first (`routing` None) or through the router."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    ports = free_ports(args.nodes + 1)
    log = work / f"stand-in-{ports[0]}.log"
    procs = [subprocess.Popen([sys.executable, __file__, "--stand-in", ",".join(map(str, ports[1:])), str(args.ttft),
                               str(args.step), str(log)])]
    try:
        url = f"http://127.0.0.1:{ports[1]}"
        for port in ports[1:]:
            wait_up(f"http://127.0.0.1:{port}")
        if routing:
            nodes = ",".join(f"127.0.0.1:{p}" for p in ports[1:])
            argv = [sys.executable, "-m", "disagg.cli", "router", "--decode-nodes", nodes, "--port", str(ports[0]),
                    "--routing", routing]
            if routing == "cache_aware":  # prompts hashed as the nodes would, with the embedded model's tokenizer
                argv += ["--tokenizer", str(tokenizer_dir())]
            with (work / f"router-{ports[0]}.log").open("w") as log_file:
                procs.append(subprocess.Popen(argv, env=env, cwd=checkout, stdout=log_file, stderr=subprocess.STDOUT))
            url = f"http://127.0.0.1:{ports[0]}"
            wait_up(url)
        out = work / f"bench-{ports[0]}.json"
        router_cpu = cpu_seconds(procs[-1].pid) if routing else 0.0
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "disagg.cli", "bench", "serve", "--base-url", url, "--model", "stand-in",
                        "--qps", str(args.rate), "--exact-rate", "--num-requests", str(args.num_requests),
                        "--input-len", "1024", "--output-len", "512", "--len-dist", "lognormal", "--len-range", "0.6",
                        "--prompt-kind", "token-ids", "--vocab-size", "128000", "--seed", str(args.seed),
                        "--no-progress", "--save-json", str(out)], env=env, cwd=checkout, check=True,
                       stdout=subprocess.DEVNULL)
        elapsed = time.perf_counter() - started
        result = json.loads(out.read_text())["runs"][0]
        node_ttft = [float(line) for line in log.read_text().split()]
        ttft = [1e3 * r["ttft"] for r in result["requests"] if r["ok"]]
        return {"ok": len(ttft), "client_ttft_ms": {"mean": statistics.mean(ttft), "median": statistics.median(ttft),
                                                    "p99": sorted(ttft)[int(0.99 * (len(ttft) - 1))]},
                "stand_in_ttft_ms": statistics.mean(node_ttft),
                "overhead_ms": statistics.mean(ttft) - statistics.mean(node_ttft),
                "router_cpu": round((cpu_seconds(procs[-1].pid) - router_cpu) / elapsed, 3) if routing else None,
                "tokens_per_s": result["total_output_tokens"] / result["duration_s"] if result["total_output_tokens"]
                else None}
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(10)


def tokenizer_dir() -> Path:
    from disagg.router.server import embedded_tokenizer_dir

    return embedded_tokenizer_dir()


def commit(checkout: Path) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stand-in", nargs=4, metavar=("PORTS", "TTFT", "STEP", "LOG"), help=argparse.SUPPRESS)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rate", type=float, default=8.25)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--ttft", type=float, default=0.030, help="the stand-ins' TTFT, seconds")
    ap.add_argument("--step", type=float, default=0.0054, help="the stand-ins' decode step, seconds (4k-chat TPOT)")
    ap.add_argument("--seed", type=int, default=61)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--routings", default="least_loaded,cache_aware", help="the router's --routing, one run each")
    ap.add_argument("--compare", type=Path, help="another checkout whose client and router run beside this one's")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.stand_in:
        ports, ttft, step, log = args.stand_in
        with open(log, "w", buffering=1) as f:
            asyncio.run(stand_ins([int(p) for p in ports.split(",")], float(ttft), float(step), f))
        return
    checkouts = [REPO] + ([args.compare.resolve()] if args.compare else [])
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for repeat in range(args.repeats):
            for checkout in checkouts:
                for routing in [None, *args.routings.split(",")]:
                    key = f"{commit(checkout)}/{routing or 'direct'}"
                    r = run(args, checkout, routing, Path(work))
                    results.setdefault(key, []).append(r)
                    print(f"{key} #{repeat}: client TTFT {r['client_ttft_ms']['mean']:.1f} ms, stand-ins "
                          f"{r['stand_in_ttft_ms']:.1f} ms: overhead {r['overhead_ms']:.1f} ms; router CPU "
                          f"{r['router_cpu']}", flush=True)
    summary = {key: {"overhead_ms_median": statistics.median(r["overhead_ms"] for r in runs),
                     "client_ttft_ms_median": statistics.median(r["client_ttft_ms"]["mean"] for r in runs),
                     "router_cpu_median": None if runs[0]["router_cpu"] is None
                     else statistics.median(r["router_cpu"] for r in runs), "runs": runs}
               for key, runs in results.items()}
    for key, s in summary.items():
        print(f"{key}: overhead {s['overhead_ms_median']:.1f} ms (median of {args.repeats}), router CPU "
              f"{s['router_cpu_median']}")
    if args.json:
        out = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{os.cpu_count()} CPUs",
               "command": " ".join(sys.argv), "config": {k: str(v) for k, v in vars(args).items() if k != "stand_in"},
               "results": summary}
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
