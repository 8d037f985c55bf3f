"""`disagg up`: one prefill node and one decode node on localhost, then a sample request.

What the quick start runs. The two nodes are ordinary `disagg serve` processes; this only
starts them with matching ports, waits until both answer, and shows a streamed answer.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx

SAMPLE = "In one sentence, what does a prefill node do in disaggregated LLM serving?"


def serve_command(args: argparse.Namespace, role: str, port: int, kv_port: int) -> list[str]:
    command = [sys.executable, "-m", "disagg.cli", "serve"] + ([args.model] if args.model else [])
    kv = {"kv_connector": args.kv_connector, "kv_port": kv_port}
    if role == "consumer":  # the quick start shows a handoff: under "auto" its short sample would stay here
        kv["kv_connector_extra_config"] = {"remote_prefill": "always"}
    command += ["--kv-role", role, "--port", str(port), "--log-level", args.log_level,
                "--kv-transfer-config", json.dumps(kv)]
    if role == "producer":
        command += ["--grpc-port", str(args.grpc_port)]
    else:
        command += ["--prefill-nodes", f"127.0.0.1:{args.grpc_port}"]
    tp = args.tensor_parallel_size
    if tp > 1:
        command += ["--tensor-parallel-size", str(tp)]
    device = args.device
    if device and device.startswith("cuda") and tp > 1:
        # Each node's ranks take the GPUs from its --device on: the prefill node's first, the decode node's after.
        first = int(device.partition(":")[2] or 0) + (tp if role == "consumer" else 0)
        device = f"cuda:{first}"
    if device:
        command += ["--device", device]
    return command


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


def wait_for_stop(stop: threading.Event, nodes: dict[str, subprocess.Popen]) -> None:
    """Until `stop` is set; RuntimeError if a node exits first (the caller then stops the other)."""
    while not stop.wait(0.2):
        exited = [(name, proc) for name, proc in nodes.items() if proc.poll() is not None]
        if exited and not stop.wait(1.0):  # not Ctrl-C, which the terminal sends the nodes too
            name, proc = exited[0]
            raise RuntimeError(f"the {name} node exited with code {proc.returncode}; stopped the other "
                               "(its output is above)")


def bound_ports(args: argparse.Namespace) -> dict[int, str]:
    """The ports the two nodes listen on, and the flag that sets each (the prefill node listens on its
    pipe port for the prefix blocks it pulls from other prefill nodes: prefill_node/pull.py)."""
    return {args.port: "the decode node's HTTP port, --port", args.port + 1: "the prefill node's HTTP port, --port + 1",
            args.grpc_port: "the prefill node's gRPC port, --grpc-port",
            args.kv_port: "the prefill node's pipe port, --kv-port",
            args.kv_port + 1: "the decode node's pipe port, --kv-port + 1"}


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


def up(args: argparse.Namespace) -> None:
    check_ports_free(bound_ports(args))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    prefill_port, decode_port = args.port + 1, args.port
    prefill = subprocess.Popen(serve_command(args, "producer", prefill_port, args.kv_port), env=env)
    decode = subprocess.Popen(serve_command(args, "consumer", decode_port, args.kv_port + 1), env=env)
    url = f"http://127.0.0.1:{decode_port}"
    try:
        try:
            wait_healthy(f"http://127.0.0.1:{prefill_port}", prefill)
            # Until it has connected to its prefill node too (which may have come up after it).
            wait_healthy(url, decode, until=lambda health: all(health.get("prefill_nodes", {}).values()))
        except RuntimeError as e:
            raise RuntimeError(f"{e}; its output is above") from None
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        sample_request(url, model)
        if args.once:
            return
        stop = stop_on_signals()  # before the line that invites Ctrl-C
        print(f"serving {model}: OpenAI API at {url}/v1 (prefill node http://127.0.0.1:{prefill_port}); Ctrl-C stops")
        wait_for_stop(stop, {"decode": decode, "prefill": prefill})
    finally:
        for proc in (decode, prefill):
            proc.terminate()
        for proc in (decode, prefill):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
