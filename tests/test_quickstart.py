"""The README's main command: `disagg up` brings up 1 prefill + 1 decode node and answers."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from servers import free_port

from disagg import LLM, SamplingParams
from disagg.launch import SAMPLE

pytestmark = pytest.mark.slow


def free_port_pair() -> int:
    """A port p with p + 1 free too (`disagg up` gives the prefill node port + 1)."""
    while True:
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
                return p
            except OSError:
                continue


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(300)
def test_up_starts_both_nodes_answers_the_sample_and_stops_on_ctrl_c(model_dir):
    port, grpc_port, kv_port = free_port_pair(), free_port(), free_port_pair()
    # Its own process group, as a terminal gives it: Ctrl-C signals the group (up and both nodes).
    proc = subprocess.Popen(
        [sys.executable, "-m", "disagg.cli", "up", "--port", str(port), "--grpc-port", str(grpc_port),
         "--kv-port", str(kv_port), "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    try:
        output = ""
        for line in proc.stdout:
            output += line
            if "Ctrl-C stops" in line:
                break
        assert "Ctrl-C stops" in output, output
        os.killpg(proc.pid, signal.SIGINT)
        start = time.monotonic()
        output += proc.communicate(timeout=30)[0]
        deadline = start + 10
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_alive(proc.pid), f"processes left in the group after Ctrl-C:\n{output}"
        assert time.monotonic() - start < 10 and proc.returncode == 0, output
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    assert "disagg prefill node ready" in output and "disagg decode node ready" in output
    expected = LLM(str(model_dir), device="cpu").chat(
        [{"role": "user", "content": SAMPLE}], SamplingParams(temperature=0, max_tokens=64))[0].text
    answer = output.split(f"> {SAMPLE}\n", 1)[1].split("\n\n(first token after", 1)[0]
    assert answer == expected
