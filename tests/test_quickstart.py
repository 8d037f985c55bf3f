"""The README's main command: `disagg up` brings up 1 prefill + 1 decode node and answers."""

import os
import signal
import time

import pytest
from servers import KV_CACHE_BYTES, free_port, free_port_pair, output_until_serving, start_up

from disagg import LLM, SamplingParams
from disagg.launch import SAMPLE

pytestmark = pytest.mark.slow


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(300)
def test_up_starts_both_nodes_answers_the_sample_and_stops_on_ctrl_c(model_dir):
    proc = start_up(free_port_pair(), free_port(), free_port_pair())
    try:
        output = output_until_serving(proc)
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
    expected = LLM(str(model_dir), device="cpu", kv_cache_memory=KV_CACHE_BYTES).chat(
        [{"role": "user", "content": SAMPLE}], SamplingParams(temperature=0, max_tokens=64))[0].text
    answer = output.split(f"> {SAMPLE}\n", 1)[1].split("\n\n(first token after", 1)[0]
    assert answer == expected
