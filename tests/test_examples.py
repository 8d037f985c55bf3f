"""The examples run as a user runs them: as scripts, against the real engine and a real node."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from servers import free_port, start_node

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# One thread per process: the examples start several engines on a shared two-core machine.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

pytestmark = pytest.mark.slow


def run_example(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], check=False, capture_output=True, text=True, timeout=timeout,
                          env=ENV)


def test_offline_disaggregated_prefill_matches_colocated():
    result = run_example([str(EXAMPLES / "offline_disaggregated_prefill.py")], timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "OK: all 3 disaggregated completions match the colocated run" in result.stdout, output
    assert "[prefill] prompt-2:" in result.stdout, output


def test_openai_client_streams_from_a_node(tmp_path: Path):
    node = start_node("both", tmp_path)
    try:
        result = run_example([str(EXAMPLES / "openai_client.py"), "--base-url", f"{node.url}/v1",
                              "--max-tokens", "12", "Say hello."], timeout=60)
    finally:
        node.kill()
    assert result.returncode == 0, result.stdout + result.stderr + node.log()[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "> Say hello."
    assert lines[1].strip(), f"no streamed text:\n{result.stdout}"
    assert "first token after" in result.stdout


def test_openai_client_names_an_unreachable_node():
    url = f"http://127.0.0.1:{free_port()}/v1"
    result = run_example([str(EXAMPLES / "openai_client.py"), "--base-url", url], timeout=30)
    assert result.returncode == 1
    assert f"cannot reach {url}" in result.stderr
