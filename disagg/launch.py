"""`disagg up`: prefill and decode nodes (or colocated nodes) on localhost, then a sample request.

What the quick start runs (1 prefill + 1 decode node by default), and how a layout `disagg plan`
recommends is tried on one host (`--num-prefill X --num-decode Y`, `--colocated N`). The nodes are
ordinary `disagg serve` processes and the router an ordinary `disagg router`: `plan_layout` computes
who runs what (roles, ports, GPUs, flags), with no side effects; `up` checks the ports, starts the
processes, waits until each answers, and shows a streamed answer.
"""

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

logger = logging.getLogger(__name__)

SAMPLE = "In one sentence, what does a prefill node do in disaggregated LLM serving?"
LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class Process:
    """One process `disagg up` starts: a node or the router."""
    name: str  # "prefill node", "decode node 2", "router": what an error about it says
    command: list[str]
    port: int  # its HTTP port (health, and the OpenAI API on a decode or colocated node and the router)
    ports: dict[int, str]  # every port it listens on, and the flag it comes from
    env: dict[str, str] = field(default_factory=dict)  # beside the launcher's environment (CUDA_VISIBLE_DEVICES)

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"


@dataclass(frozen=True)
class Layout:
    """The processes of one `disagg up`: prefill nodes, the nodes that serve the API (decode or
    colocated), and the router in front of those when there are several."""
    prefill: list[Process]
    front: list[Process]
    router: Process | None

    @property
    def processes(self) -> list[Process]:
        return self.prefill + self.front + ([self.router] if self.router else [])

    @property
    def url(self) -> str:
        """Where clients (and the sample request) go."""
        return (self.router or self.front[0]).url

    def bound_ports(self) -> dict[int, str]:
        return {port: what for process in self.processes for port, what in process.ports.items()}


def node_counts(args: argparse.Namespace) -> tuple[int, int]:
    """(prefill nodes, decode or colocated nodes) from --num-prefill/--num-decode or --colocated
    (0 prefill nodes: colocated); ValueError for a combination that makes no layout."""
    if args.colocated is not None:
        if args.num_prefill is not None or args.num_decode is not None:
            raise ValueError("--colocated N starts N colocated nodes and no prefill or decode node: give it "
                             "without --num-prefill and --num-decode")
        if args.colocated < 1:
            raise ValueError(f"--colocated must be at least 1, got {args.colocated}")
        return 0, args.colocated
    num_prefill = 1 if args.num_prefill is None else args.num_prefill
    num_decode = 1 if args.num_decode is None else args.num_decode
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(f"--num-prefill and --num-decode must be at least 1, got {num_prefill} and {num_decode} "
                         "(for nodes that prefill and decode both, --colocated N)")
    return num_prefill, num_decode


def numbered(role: str, index: int, count: int) -> str:
    return f"{role} {index + 1}" if count > 1 else role


def offset(flag: str, n: int) -> str:
    return f"{flag} + {n}" if n else flag


def plan_layout(args: argparse.Namespace, gpus_on_host: list[str]) -> Layout:
    """Who runs what. HTTP ports from --port up: the router's (when there are several front nodes),
    then the decode or colocated nodes', then the prefill nodes' (1P1D: decode --port, prefill --port + 1);
    prefill nodes' gRPC ports from --grpc-port up; pipe ports from --kv-port up, the prefill nodes'
    then the decode nodes'. On CUDA each node takes -tp GPUs of its own from `gpus_on_host` (as
    CUDA_VISIBLE_DEVICES names them; from the K-th with --device cuda:K), prefill nodes first;
    ValueError if there are too few. On the CPU (or with no GPU and no --device) they share it."""
    num_prefill, num_front = node_counts(args)
    gpus = node_gpus(args, gpus_on_host, num_prefill + num_front)
    first_front = args.port + 1 if num_front > 1 else args.port  # the router's is --port
    prefill_nodes = [f"{LOCALHOST}:{args.grpc_port + i}" for i in range(num_prefill)]
    prefill = [prefill_process(args, i, num_prefill, first_front + num_front + i, gpus[i]) for i in range(num_prefill)]
    front = [front_process(args, j, num_front, first_front + j, prefill_nodes, gpus[num_prefill + j])
             for j in range(num_front)]
    router = None
    if num_front > 1:
        router = Process("router", router_command(args, args.port, [node.port for node in front]), args.port,
                         {args.port: "the router's HTTP port, --port"})
    layout = Layout(prefill, front, router)
    check_distinct_ports(layout)
    return layout


def prefill_process(args: argparse.Namespace, i: int, count: int, port: int, env: dict[str, str]) -> Process:
    name = numbered("prefill node", i, count)
    # A prefill node listens on its pipe port too, for prefix blocks it pulls from other prefill nodes.
    kv_port, grpc_port = args.kv_port + i, args.grpc_port + i
    ports = {port: f"the {name}'s HTTP port, {offset('--port', port - args.port)}",
             grpc_port: f"the {name}'s gRPC port, {offset('--grpc-port', i)}",
             kv_port: f"the {name}'s pipe port, {offset('--kv-port', i)}"}
    command = serve_command(args, "producer", port, kv_port) + ["--grpc-port", str(grpc_port)]
    return Process(name, command, port, ports, env)


def front_process(args: argparse.Namespace, j: int, count: int, port: int, prefill_nodes: list[str],
                  env: dict[str, str]) -> Process:
    """The j-th decode node (over every prefill node), or colocated node when there are no prefill nodes."""
    name = numbered("decode node" if prefill_nodes else "colocated node", j, count)
    ports = {port: f"the {name}'s HTTP port, {offset('--port', port - args.port)}"}
    if not prefill_nodes:
        return Process(name, serve_command(args, "both", port, None), port, ports, env)
    kv_port = args.kv_port + len(prefill_nodes) + j  # after the prefill nodes'
    ports[kv_port] = f"the {name}'s pipe port, {offset('--kv-port', len(prefill_nodes) + j)}"
    command = serve_command(args, "consumer", port, kv_port) + ["--prefill-nodes", ",".join(prefill_nodes)]
    return Process(name, command, port, ports, env)


def node_gpus(args: argparse.Namespace, gpus_on_host: list[str], num_nodes: int) -> list[dict[str, str]]:
    """Each node's CUDA_VISIBLE_DEVICES, in the order nodes are laid out (prefill nodes first); {} for
    each on the CPU."""
    device = args.device or ("cuda" if gpus_on_host else "cpu")
    if not device.startswith("cuda"):
        return [{} for _ in range(num_nodes)]
    index = device.partition(":")[2] or "0"
    if not index.isdigit():
        raise ValueError(f"--device {device}: a GPU is cuda or cuda:N")
    first, tp = int(index), args.tensor_parallel_size
    if first >= len(gpus_on_host):
        raise ValueError(f"--device {device}: this host has {len(gpus_on_host)} GPU(s)")
    needed, available = first + num_nodes * tp, gpus_on_host[first:]
    if needed > len(gpus_on_host) and tp == 1:
        # Fewer GPUs than nodes (the quick start on one GPU): the nodes take them in turn and share, each
        # node's KV cache a share of what the others leave free, as serve's --kv-cache-memory sizes it.
        logger.warning("%d nodes on %d GPU(s): some share one", num_nodes, len(available))
        return [{"CUDA_VISIBLE_DEVICES": available[n % len(available)]} for n in range(num_nodes)]
    if needed > len(gpus_on_host):
        raise ValueError(f"{num_nodes} node(s) of {tp} GPU(s) each from GPU {first} on need {needed} GPUs; this "
                         f"host has {len(gpus_on_host)}: start fewer nodes, or lower -tp (on the CPU: --device cpu)")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus_on_host[first + n * tp:first + (n + 1) * tp])}
            for n in range(num_nodes)]


def check_distinct_ports(layout: Layout) -> None:
    """ValueError if two processes would listen on one port (base flags too close together), or on
    no port at all."""
    seen: dict[int, str] = {}
    for process in layout.processes:
        for port, what in process.ports.items():
            if not 0 < port < 65536:
                raise ValueError(f"{what} would be {port}, not a port number: lower the base flag")
            if port in seen:
                raise ValueError(f"{seen[port]} and {what} would both be port {port}: set --port, --grpc-port "
                                 "and --kv-port further apart")
            seen[port] = what


def serve_command(args: argparse.Namespace, role: str, port: int, kv_port: int | None) -> list[str]:
    """`disagg serve` for a node of `role` (producer, consumer or both): what every node shares. The
    node sees only its own GPUs (CUDA_VISIBLE_DEVICES), so its device is plain `cuda`."""
    command = [sys.executable, "-m", "disagg.cli", "serve"] + ([args.model] if args.model else [])
    command += ["--kv-role", role, "--port", str(port), "--log-level", args.log_level]
    if role != "both":
        kv = {"kv_connector": args.kv_connector, "kv_port": kv_port}
        if role == "consumer":  # the quick start shows a handoff: under "auto" its short sample would stay here
            kv["kv_connector_extra_config"] = {"remote_prefill": "always"}
        command += ["--kv-transfer-config", json.dumps(kv)]
    if args.tensor_parallel_size > 1:
        command += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    batched_tokens = args.prefill_max_num_batched_tokens if role == "producer" else args.max_num_batched_tokens
    for flag, value in (("--max-num-seqs", args.max_num_seqs), ("--max-num-batched-tokens", batched_tokens)):
        if value is not None:
            command += [flag, str(value)]
    if args.async_scheduling:
        command.append("--async-scheduling")
    if args.device:
        command += ["--device", "cuda" if args.device.startswith("cuda") else args.device]
    return command


def router_command(args: argparse.Namespace, port: int, front_ports: list[int]) -> list[str]:
    """cache_aware routing: the router starts once the nodes serve, and hashes prompts with the tokenizer
    of the model directory they name in /v1/models (a .gguf file or Hub id: the one they converted or fetched)."""
    return [sys.executable, "-m", "disagg.cli", "router", "--host", LOCALHOST, "--port", str(port),
            "--decode-nodes", ",".join(f"{LOCALHOST}:{p}" for p in front_ports), "--log-level", args.log_level]


def host_gpus(device: str | None) -> list[str]:
    """The GPUs this host offers the nodes, as CUDA_VISIBLE_DEVICES names them (the launcher's own
    CUDA_VISIBLE_DEVICES, if set, narrows them); none for --device cpu, or with no CUDA."""
    if device is not None and not device.startswith("cuda"):
        return []
    import torch  # only to count GPUs: not on the CPU path

    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [name.strip() for name in visible.split(",")] if visible is not None else [str(i) for i in range(count)]
    return names[:count]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0,
                 until: Callable[[dict], bool] = lambda health: True) -> None:
    """Until GET {url}/health answers 200 with a body `until` accepts; RuntimeError if `proc`
    exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the node behind {url} exited with code {proc.returncode}")
        try:
            response = httpx.get(f"{url}/health", timeout=2)
            if response.status_code == 200 and until(response.json()):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy within {timeout:.0f}s")


def sample_request(url: str, model: str) -> None:
    print(f"\n> {SAMPLE}")
    body = {"model": model, "messages": [{"role": "user", "content": SAMPLE}], "max_tokens": 64,
            "temperature": 0, "stream": True}
    start = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"]
            text = delta[0]["delta"].get("content") if delta else None
            if text:
                first = first or time.perf_counter()
                print(text, end="", flush=True)
    print(f"\n\n(first token after {first - start:.2f}s, all in {time.perf_counter() - start:.2f}s)")


def stop_on_signals() -> threading.Event:
    """An event SIGINT and SIGTERM set from now on. Ctrl-C in a terminal signals the whole process
    group, so the nodes may be stopping already when it is set."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def interrupt_on_sigterm() -> None:
    """SIGTERM while the processes start raises KeyboardInterrupt, as Ctrl-C does, so that `up` stops
    what it started (Python's default would end it at once, leaving them running)."""
    def interrupt(*_) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def wait_for_stop(stop: threading.Event, processes: dict[str, subprocess.Popen]) -> None:
    """Until `stop` is set; RuntimeError if a process exits first (the caller then stops the rest)."""
    while not stop.wait(0.2):
        exited = [(name, proc) for name, proc in processes.items() if proc.poll() is not None]
        if exited and not stop.wait(1.0):  # not Ctrl-C, which the terminal sends the nodes too
            name, proc = exited[0]
            raise RuntimeError(f"the {name} exited with code {proc.returncode}; stopped the rest "
                               "(its output is above)")


def check_ports_free(ports: dict[int, str]) -> None:
    """RuntimeError naming the first port something listens on: nodes started there would die with
    a traceback each, and the sample would go to whatever answers on the port (issue 25: a second
    `make run` asked the first one's nodes)."""
    for port, what in ports.items():
        with socket.socket() as probe:
            # As the nodes bind: a port a closed connection left in TIME_WAIT is free for them.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                raise RuntimeError(f"port {port} ({what}) is in use, by another `disagg up` perhaps: stop it, or "
                                   "start this one on other ports (--port, --grpc-port, --kv-port)") from None


def start_serving(layout: Layout, started: dict[str, subprocess.Popen], env: dict[str, str]) -> None:
    """The nodes, all at once so that their loads overlap (a decode node retries a prefill node still
    loading), each in `started` as soon as it runs (the caller stops them, whatever is raised); then,
    once every node answers (a decode node once it holds each of its prefill nodes healthy), the router,
    if any, until it holds every decode node healthy; RuntimeError if one exits first."""
    for node in layout.prefill + layout.front:
        started[node.name] = subprocess.Popen(node.command, env=env | node.env)
    try:
        for node in layout.prefill + layout.front:
            wait_healthy(node.url, started[node.name],
                         until=lambda health: all(health.get("prefill_nodes", {}).values()))
        if layout.router:
            started[layout.router.name] = subprocess.Popen(layout.router.command, env=env)
            wait_healthy(layout.router.url, started[layout.router.name], timeout=60,
                         until=lambda health: all(n["healthy"] for n in health["decode_nodes"].values()))
    except RuntimeError as e:
        raise RuntimeError(f"{e}; its output is above") from None


def describe(layout: Layout) -> str:
    """What runs behind the front door, for the line that says it serves."""
    if layout.router is None and len(layout.prefill) == 1:
        return f"prefill node {layout.prefill[0].url}"  # 1P1D, the quick start
    parts = []
    if layout.router:
        kind = "decode" if layout.prefill else "colocated"
        parts.append(f"router over {kind} nodes " + ", ".join(node.url for node in layout.front))
    if layout.prefill:
        nodes = "prefill nodes" if len(layout.prefill) > 1 else "prefill node"
        parts.append(f"{nodes} " + ", ".join(node.url for node in layout.prefill))
    return "; ".join(parts) or "one colocated node"


def stop_all(started: dict[str, subprocess.Popen], timeout: float = 15.0) -> None:
    """SIGTERM to each, then SIGKILL to any still running after `timeout` seconds (all together).
    A second Ctrl-C or SIGTERM meanwhile must not cut this short and leave processes running."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    for proc in reversed(started.values()):  # the router first: no request reaches a stopping node through it
        proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in started.values():
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def up(args: argparse.Namespace) -> None:
    layout = plan_layout(args, host_gpus(args.device))
    check_ports_free(layout.bound_ports())
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    interrupt_on_sigterm()
    started: dict[str, subprocess.Popen] = {}
    try:
        start_serving(layout, started, env)
        url = layout.url
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        sample_request(url, model)
        if args.once:
            return
        stop = stop_on_signals()  # before the line that invites Ctrl-C
        print(f"serving {model}: OpenAI API at {url}/v1 ({describe(layout)}); Ctrl-C stops")
        wait_for_stop(stop, started)
    finally:
        stop_all(started)
