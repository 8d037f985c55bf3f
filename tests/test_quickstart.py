"""The README's main command: `disagg up` brings up 1 prefill + 1 decode node and answers."""

import os
import socket
import subprocess
import sys

import pytest

from disagg import LLM, SamplingParams
from disagg.launch import SAMPLE
from servers import free_port


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


@pytest.mark.timeout(300)
def test_up_starts_both_nodes_and_answers_the_sample(model_dir):
    port, grpc_port, kv_port = free_port_pair(), free_port(), free_port_pair()
    result = subprocess.run(
        [sys.executable, "-m", "disagg.cli", "up", "--once", "--port", str(port), "--grpc-port", str(grpc_port),
         "--kv-port", str(kv_port), "--device", "cpu"],
        capture_output=True, text=True, timeout=280, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "disagg prefill node ready" in result.stdout and "disagg decode node ready" in result.stdout
    expected = LLM(str(model_dir), device="cpu").chat(
        [{"role": "user", "content": SAMPLE}], SamplingParams(temperature=0, max_tokens=64))[0].text
    answer = result.stdout.split(f"> {SAMPLE}\n", 1)[1].split("\n\n(first token after", 1)[0]
    assert answer == expected
