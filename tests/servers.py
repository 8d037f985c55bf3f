"""Real node processes for the serving tests: `disagg serve ...` on free loopback ports."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from disagg.launch import wait_healthy

PAIR_MAX_MODEL_LEN = 512  # conftest's shared CPU 1P1D pair
# A node's KV cache unless its test sizes it, and the offline references': 2,912 tokens of the embedded model
# (the CPU default, 512 MiB, is 400 MB more per process than any test fills; max_model_len follows the cache
# down from 8,192 where unset).
KV_CACHE_BYTES = 128 * 2**20
KV_SIZE_FLAGS = ("--kv-cache-memory", "--kv-cache-memory-bytes", "--gpu-memory-utilization")


def free_port() -> int:
    """A free loopback port for a node to bind later: not one the kernel hands out itself (port 0), which
    an outgoing connection may take as its own meanwhile (a node then failed to bind its HTTP port)."""
    return free_port_run(1)


def free_port_pair() -> int:
    """A port p with p + 1 free too (`disagg up` gives the prefill node port + 1)."""
    return free_port_run(2)


def free_port_run(count: int) -> int:
    """A port p with p + 1 ... p + count - 1 free too (`disagg up` counts its nodes' ports up from its flags):
    below the kernel's ephemeral range (32768 and up), where no outgoing connection takes one meanwhile."""
    while True:
        p = random.randrange(20000, 30000 - count)
        if all(port_free(p + i) for i in range(count)):
            return p


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def start_up(port: int, grpc_port: int, kv_port: int, *extra: str) -> subprocess.Popen:
    """`disagg up` on the CPU in a process group of its own, as a terminal starts it (Ctrl-C signals the
    group: up and its nodes); its output on stdout, text. Its nodes' KV cache is every test node's,
    through the environment default that `disagg serve` reads (the CPU default, 512 MiB, in each of the
    two was the suite's memory peak, beside test_serving's nodes). extra: more flags of `disagg up`."""
    return subprocess.Popen(
        [sys.executable, "-m", "disagg.cli", "up", "--port", str(port), "--grpc-port", str(grpc_port),
         "--kv-port", str(kv_port), "--device", "cpu", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
             "DISAGG_KV_CACHE_MEMORY": str(KV_CACHE_BYTES)})


def output_until_serving(proc: subprocess.Popen) -> str:
    """`disagg up`'s output up to the line that says both nodes serve (or to its end, if it exits first)."""
    output = ""
    for line in proc.stdout:
        output += line
        if "Ctrl-C stops" in line:
            break
    return output


@dataclass
class Node:
    role: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    grpc_port: int | None = None
    kv_port: int | None = None
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def metric(self, name: str) -> float:
        """One unlabelled sample of /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(f"{name} not in /metrics")

    def labelled(self, name: str, label: str) -> dict[str, float]:
        """{label value: sample} of one metric with one label in /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        pattern = re.compile(rf'^{name}\{{{label}="([^"]+)"\}} (\S+)$', re.MULTILINE)
        return {value: float(sample) for value, sample in pattern.findall(text)}

    def samples(self) -> list[Sample]:
        """Every sample of /metrics (read them with `metric_sum`)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return [s for family in text_string_to_metric_families(text) for s in family.samples]


def metric_sum(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of the samples named `name` that carry `labels` (and maybe others)."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


# Sets up the process, then becomes args. Not Popen's preexec_fn: Python code between fork and exec lets gRPC's
# at-fork handlers (this test process has run gRPC) restart a poller thread in the child, which aborts it
# (epoll_wait: Bad file descriptor) when Popen closes the inherited descriptors before exec.
EXEC_WITH = """import os, resource, signal, sys
max_open_files, sigint_default, args = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3:]
if max_open_files:
    resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files, max_open_files))
if sigint_default:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execv(args[0], args)"""


def exec_with(args: list[str], *, max_open_files: int | None = None, sigint_default: bool = False) -> list[str]:
    """args run with RLIMIT_NOFILE (soft and hard) at max_open_files, and SIGINT at its default if asked (a
    test runner in the background may ignore it, and exec keeps an ignored signal ignored)."""
    return [sys.executable, "-c", EXEC_WITH, str(max_open_files or 0), str(int(sigint_default)), *args]


def start_node(role: str, tmp_dir: Path, *, model: str | None = None, connector: str = "tcp",
               prefill_nodes: list[str] | None = None, kv_extra: dict | None = None,
               extra_args: list[str] = (), wait: bool = True, max_open_files: int | None = None,
               kv_config: dict | None = None, env: dict | None = None) -> Node:
    """Start `disagg serve` for role producer, consumer or both, and wait until /health answers.
    max_open_files: the process's RLIMIT_NOFILE (soft and hard), to run it out of descriptors;
    kv_config: more --kv-transfer-config fields (kv_buffer_device); env: more environment (the GPUs it sees)."""
    port = free_port()
    args = [sys.executable, "-m", "disagg.cli", "serve"] + ([model] if model else [])
    args += ["--kv-role", role, "--port", str(port), "--device", "cpu", "--log-level", "INFO"]
    grpc_port = kv_port = None
    if role != "both":
        kv_port = free_port()
        config = {"kv_connector": connector, "kv_ip": "127.0.0.1", "kv_port": kv_port,
                  "kv_connector_extra_config": kv_extra or {}, **(kv_config or {})}
        args += ["--kv-transfer-config", json.dumps(config)]
    if role == "producer":
        grpc_port = free_port()
        args += ["--grpc-port", str(grpc_port)]
    if prefill_nodes:
        args += ["--prefill-nodes", ",".join(prefill_nodes)]
    args += list(extra_args)
    if not any(arg.split("=")[0] in KV_SIZE_FLAGS for arg in extra_args):
        args += ["--kv-cache-memory", str(KV_CACHE_BYTES)]
    log_path = tmp_dir / f"{role}-{port}.log"
    # One thread each: the suite shares two cores between several node processes.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(exec_with(args, max_open_files=max_open_files), stdout=log_path.open("w"),
                            stderr=subprocess.STDOUT, env=env)
    node = Node(role, proc, port, log_path, grpc_port, kv_port, args)
    if wait:
        wait_ready(node)
    return node


def start_router(tmp_dir: Path, decode_nodes: list[str], extra_args: list[str] = (), wait: bool = True) -> Node:
    """`disagg router` over the given decode nodes (HTTP host:port); waits until /health answers 200."""
    port = free_port()
    args = [sys.executable, "-m", "disagg.cli", "router", "--decode-nodes", ",".join(decode_nodes),
            "--port", str(port), "--health-interval", "0.5", "--log-level", "INFO", *extra_args]
    log_path = tmp_dir / f"router-{port}.log"
    proc = subprocess.Popen(args, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    node = Node("router", proc, port, log_path, args=args)
    if wait:
        wait_ready(node)
    return node


def malformed_http_answer(port: int) -> tuple[bytes, dict]:
    """What a node's HTTP server answers a request h11 cannot parse: (status line, the JSON body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nno colon in this header\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):  # the server closes the connection after it
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer
    return head.split(b"\r\n")[0], json.loads(body)


async def read_sse_text(response: httpx.Response) -> str:
    """The text of a streamed completion or chat answer (every choice's text or delta content),
    checked to carry no error event and to end with [DONE]."""
    text, done = "", False
    async for line in response.aiter_lines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                text += choice["text"] if "text" in choice else (choice["delta"].get("content") or "")
    assert done, "the stream ended without [DONE]"
    return text


def wait_ready(node: Node, timeout: float = 120.0, until: Callable[[dict], bool] = lambda health: True) -> None:
    try:
        wait_healthy(node.url, node.proc, timeout, until)
    except RuntimeError as e:
        node.kill()
        raise RuntimeError(f"{node.role} node: {e}:\n{node.log()[-3000:]}") from None


def wait_all_ready(*nodes: Node) -> None:
    """Nodes started together (wait=False), so that their loads overlap: until each serves, a decode node
    until it holds each of its prefill nodes healthy (it may have found one still loading at its start,
    and retries it a second later). If one fails, all are stopped."""
    try:
        for node in nodes:
            wait_ready(node, until=lambda health: all(health.get("prefill_nodes", {}).values()))
    except BaseException:
        for node in nodes:
            node.kill()
        raise


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout}s: {what}")


def wait_exit(node: Node, timeout: float = 120.0) -> int:
    """For nodes expected to refuse to start: their exit code."""
    return node.proc.wait(timeout=timeout)


def socket_inodes(pid: int) -> set[str]:
    """The inodes of process `pid`'s sockets, to look up in /proc/<pid>/net/tcp{,6}."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes
