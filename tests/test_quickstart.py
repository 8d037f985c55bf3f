"""The README's main command: `disagg up` brings up 1 prefill + 1 decode node (or the layout its flags ask
for) and answers."""

import os
import signal
import time

import pytest
from servers import KV_CACHE_BYTES, free_port, free_port_pair, free_port_run, output_until_serving, start_up

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


@pytest.mark.timeout(180)
def test_up_2p2d_answers_through_the_router_and_leaves_no_process(model_dir):
    """`disagg up --num-prefill 2 --num-decode 2 --once`: four nodes and the router on ports counted up
    from the flags, each decode node over both prefill nodes; the sample's answer comes through the
    router, and once it is printed every process of the group is gone."""
    # One run of free ports for all (runs taken one by one may overlap): HTTP for the router, 2 decode and
    # 2 prefill nodes, then 4 pipe ports, then 2 gRPC ports.
    port = free_port_run(11)
    proc = start_up(port, port + 9, port + 5, "--num-prefill", "2", "--num-decode", "2", "--once")
    try:
        output = proc.communicate(timeout=150)[0]
        deadline = time.monotonic() + 10
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_alive(proc.pid), f"processes left in the group after --once:\n{output}"
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output
    assert output.count("disagg prefill node ready") == 2 and output.count("disagg decode node ready") == 2, output
    assert f"disagg router ready: http://127.0.0.1:{port} decode 127.0.0.1:{port + 1},127.0.0.1:{port + 2}" in output
    answer = output.split(f"> {SAMPLE}\n", 1)[1].split("\n\n(first token after", 1)[0]
    assert answer.strip(), output
