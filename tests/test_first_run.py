"""A first run, as a new user makes it (issue 25): Ctrl-C stops any node in one line, `disagg up` refuses
ports in use and fails when a node dies, an idle KV connection closing is no warning, no flag is
abbreviated, and the README's `openai` snippet runs."""

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lookup_peer import make_request
from servers import (
    KV_CACHE_BYTES,
    Node,
    exec_with,
    free_port,
    free_port_pair,
    output_until_serving,
    start_up,
    wait_for,
    wait_ready,
)

from disagg import cli
from disagg.lookup_buffer import LookupBufferConsumer, LookupBufferProducer
from disagg.pipes import PipeConfig

REPO = Path(__file__).resolve().parent.parent


def test_an_idle_kv_connection_closed_by_its_producer_is_logged_at_info(caplog: pytest.LogCaptureFixture):
    consumer = LookupBufferConsumer("tcp", PipeConfig(kv_port=0), ttl=30.0)
    producer = LookupBufferProducer("tcp", PipeConfig(kv_port=0), 1 << 20, 30.0, 5.0, idle_sender_s=0.2)
    try:
        with caplog.at_level(logging.INFO, logger="disagg.lookup_buffer"):
            token_ids, kv, extras = make_request(0)
            producer.insert("req-0", token_ids, kv, extras, consumer.address)
            consumer.drop_select("req-0", token_ids, 20.0)
            wait_for(lambda: "closed its connection between entries" in caplog.text, 10, "the idle close logged")
    finally:
        producer.close()
        consumer.close()
    closes = [r for r in caplog.records if "closed its connection" in r.getMessage()]
    assert [r.levelno for r in closes] == [logging.INFO]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_no_parser_takes_an_abbreviation():
    """Every command and subcommand: a long flag cut short by one letter (a prefix of no other flag) is
    left unparsed, not taken for the flag."""
    parser, _ = cli.build_parser()
    checked = []
    for sub in cli.all_parsers(parser):
        for action in sub._actions:
            action.required = False  # so that parse_known_args reports what it did not take
        flags = [f for a in sub._actions for f in a.option_strings if f.startswith("--") and f != "--help"]
        unique = [f[:-1] for f in flags if sum(g.startswith(f[:-1]) for g in flags) == 1]
        if unique:
            # FLAG=VALUE in one word: a separate value would be read as a subcommand (`disagg plan profile`)
            assert f"{unique[0]}=1" in sub.parse_known_args([f"{unique[0]}=1"])[1], f"{sub.prog} took {unique[0]}"
            checked.append(sub.prog)
    assert {"disagg serve", "disagg up", "disagg generate", "disagg router", "disagg bench serve", "disagg plan",
            "disagg plan profile"} <= set(checked)


def test_up_refuses_a_port_in_use_in_one_line(capsys: pytest.CaptureFixture):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        grpc_port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            cli.main(["up", "--port", str(free_port_pair()), "--grpc-port", str(grpc_port), "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_.value.code != 0
    assert err.count("\n") == 1, err
    assert f"port {grpc_port} (the prefill node's gRPC port, --grpc-port) is in use" in err, err


def start_signallable(role: str, tmp_path: Path, extra: list[str] = ()) -> Node:
    """`disagg serve` as a terminal starts it: SIGINT at its default (a test runner in the background may
    ignore it, and the child would inherit that), so Ctrl-C is what Python makes of it. Its KV cache is
    every test node's (servers.KV_CACHE_BYTES), not the CPU default's 512 MiB: with it, the loading test's
    Ctrl-C often lands while the node imports its servers, where it used to end the node by SIGINT (-2)."""
    port = free_port()
    args = [sys.executable, "-m", "disagg.cli", "serve", "--kv-role", role, "--port", str(port), "--device", "cpu",
            "--log-level", "INFO", "--kv-cache-memory", str(KV_CACHE_BYTES), *extra]
    grpc_port = free_port() if role == "producer" else None
    if role == "producer":
        args += ["--grpc-port", str(grpc_port), "--kv-transfer-config", json.dumps({"kv_port": free_port()})]
    log_path = tmp_path / f"{role}-{port}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(exec_with(args, sigint_default=True), stdout=log_path.open("w"),
                            stderr=subprocess.STDOUT, env=env)
    return Node(role, proc, port, log_path, grpc_port, args=args)


def assert_stops_cleanly(node: Node, sig: signal.Signals) -> None:
    start = time.monotonic()
    node.proc.send_signal(sig)
    code = node.proc.wait(timeout=30)
    log = node.log()
    assert time.monotonic() - start < 10, log
    assert code == 0 and "Traceback" not in log, log
    assert log.count(f"node stopped ({sig.name})") == 1, log


def readme_openai_snippet(port: int) -> str:
    readme = (REPO / "README.md").read_text()
    start = readme.index("Structured output and tools from the `openai` SDK")
    code = re.search(r"```python\n(.*?)```", readme[start:], re.S).group(1)
    return code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_stops_a_prefill_node_in_one_line(tmp_path: Path):
    node = start_signallable("producer", tmp_path)
    try:
        wait_ready(node)
        assert_stops_cleanly(node, signal.SIGINT)
    finally:
        node.kill()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_readme_openai_snippet_runs_and_ctrl_c_stops_a_colocated_node_in_one_line(tmp_path: Path):
    node = start_signallable("both", tmp_path)
    try:
        wait_ready(node)
        # Issue 25: it failed 3 runs in 10 (a tool call cut by max_tokens); at temperature 0 each run is this one.
        result = subprocess.run([sys.executable, "-c", readme_openai_snippet(node.port)], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0].startswith("{'city': 'Paris'") and lines[1] in ("yes", "no") and "city" in lines[2], lines
        assert_stops_cleanly(node, signal.SIGINT)
    finally:
        node.kill()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_while_a_node_loads_is_one_line(tmp_path: Path):
    node = start_signallable("both", tmp_path)
    try:
        wait_for(lambda: "KV cache:" in node.log(), 60, "the model loaded")
        node.proc.send_signal(signal.SIGINT)
        code = node.proc.wait(timeout=30)
    finally:
        node.kill()
    log = node.log()
    assert "Traceback" not in log, log
    if code == 130:  # before the server took SIGINT over: the shell's convention, 128 + SIGINT
        assert log.strip().endswith("disagg serve: interrupted"), log
    else:  # the model loaded fast: the server's clean stop
        assert code == 0 and "stopped (SIGINT)" in log, log


def test_ctrl_c_as_the_http_server_starts_is_one_line():
    """SIGINT just before the server takes signals over (asyncio.run's handler cancels the task at its
    next await, inside the server's start): no traceback, only the caller's KeyboardInterrupt."""
    code = ("import asyncio, os, signal\n"
            "from fastapi import FastAPI\n"
            "from disagg.serving import serve_http\n"
            "async def main():\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    await serve_http(FastAPI(), '127.0.0.1', 0, 'test ready', 'info')\n"
            "try:\n"
            "    asyncio.run(main())\n"
            "except KeyboardInterrupt:\n"
            "    print('interrupted')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    assert "Traceback" not in output and result.stdout.strip() == "interrupted", output


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_up_exits_non_zero_when_a_node_dies_and_stops_the_other():
    proc = start_up(free_port_pair(), free_port(), free_port())
    try:
        output = output_until_serving(proc)
        nodes = {pid: Path(f"/proc/{pid}/cmdline").read_text() for pid in children(proc.pid)}
        prefill = next(pid for pid, cmdline in nodes.items() if "producer" in cmdline)
        os.kill(prefill, signal.SIGKILL)
        start = time.monotonic()
        output += proc.communicate(timeout=30)[0]
        assert time.monotonic() - start < 10, output
        assert proc.returncode != 0, output
        assert f"the prefill node exited with code {-signal.SIGKILL}" in output, output
        assert "disagg decode node stopped (SIGTERM)" in output and "Traceback" not in output, output
        assert not [pid for pid in nodes if Path(f"/proc/{pid}").exists()], output
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever is left of the group
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_generate_answers():
    """`disagg generate`, the README's offline command, failed with a TypeError before it loaded anything."""
    result = subprocess.run([sys.executable, "-m", "disagg.cli", "generate", "--device", "cpu", "--prompt", "Hi!",
                             "--max-tokens", "4"], capture_output=True, text=True, timeout=100,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    output = result.stdout + result.stderr
    assert result.returncode == 0 and re.search(r"1 completions, \d+ tokens", result.stdout), output
