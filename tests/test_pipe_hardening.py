"""Hostile peers: what they can cost a listener (threads, sockets, log lines, time). Real
sockets on loopback; the flood comes from tests/pipe_peer.py in its own process, so this
process's counts are the listener's alone. The wire decoder is fuzzed with hypothesis."""

import json
import math
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg import pipes
from disagg.pipes import PipeConfig, PipeError, ProtocolError, wire

PEER = Path(__file__).parent / "pipe_peer.py"
TOKEN = "hardening-secret"
FUZZ = settings(max_examples=200, deadline=None)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))



# -- the listeners: what peers that never authenticate can cost --


@pytest.fixture
def flood() -> Iterator:
    """flood(address, count): a process holding `count` silent connections; returns its counts."""
    procs = []

    def start(address: tuple[str, int], count: int) -> dict:
        cmd = [sys.executable, str(PEER), "tcp", "flood", address[0], str(address[1]), "--count", str(count)]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        return json.loads(procs[-1].stdout.readline())

    yield start
    for proc in procs:
        proc.stdin.close()  # it exits, and its sockets close
        proc.wait(timeout=10)
        proc.stdout.close()


def exchange(listener: pipes.PipeListener, pipe_name: str, config: PipeConfig, within: float) -> None:
    """A real authenticated peer gets in (retrying while refused, as a producer does) and a message
    crosses; torch_dist's send waits for the recv, so it runs on its own thread."""
    deadline = time.monotonic() + within
    while True:
        try:
            client = pipes.connect(pipe_name, config, *listener.address)
            break
        except PipeError:
            assert time.monotonic() < deadline, "an authenticated peer never got in"
            time.sleep(0.2)
    served = listener.accept(timeout=10)
    sender = threading.Thread(target=client.send, args=([torch.arange(6)],))
    sender.start()
    assert torch.equal(served.recv()[0], torch.arange(6))
    sender.join()
    client.close()
    served.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipe_name", ["tcp", "torch_dist"])
def test_idle_connections_cost_bounded_threads_fds_and_log_lines(pipe_name, flood, caplog):
    config = PipeConfig(kv_port=0, auth_token=TOKEN, timeout=10, handshake_timeout=2.0)
    listener = pipes.listen(pipe_name, config)
    try:
        threads, fds = threading.active_count(), open_fds() + 2  # + the flood process's stdin and stdout
        counts = flood(listener.address, 300)  # all from 127.0.0.1: max_handshakes_per_host (16) bounds them
        assert counts == {"hello": 16, "closed": 284, "pending": 0}
        assert threading.active_count() - threads <= 16
        assert open_fds() - fds <= 16
        time.sleep(config.handshake_timeout + 0.5)  # the 16 in handshake pass their deadline
        assert threading.active_count() <= threads
        assert open_fds() <= fds
        rejections = [r for r in caplog.records if r.name == "disagg.pipes.base"]
        # 284 refusals and 16 timeouts: one line per reason, the rest held back
        assert [r.getMessage().split(":")[0] for r in rejections] == [
            "refused a pipe peer from 127.0.0.1 at once",
            "rejected pipe peer 127.0.0.1",
        ], [r.getMessage() for r in rejections]
        exchange(listener, pipe_name, config, within=5.0)
    finally:
        listener.close()


@pytest.mark.timeout(30)
def test_max_handshakes_bounds_all_sources_together():
    listener = pipes.listen("tcp", PipeConfig(kv_port=0, max_handshakes=4, max_handshakes_per_host=100))
    socks = [socket.create_connection(listener.address, timeout=5) for _ in range(10)]
    try:
        answered = [len(s.recv(64)) for s in socks]  # the hello, or b"" once closed
        assert sorted(answered) == [0] * 6 + [wire.HELLO.size] * 4
    finally:
        for s in socks:
            s.close()
        listener.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pipe_name", ["tcp", "torch_dist"])
def test_slow_loris_is_dropped_at_the_handshake_deadline(pipe_name):
    # The per-call timeout (30 s) never fires: each byte is progress. Only the deadline can end it.
    config = PipeConfig(kv_port=0, timeout=30, handshake_timeout=2.0)
    listener = pipes.listen(pipe_name, config)
    try:
        with socket.create_connection(listener.address, timeout=5) as s:
            start = time.monotonic()
            assert len(s.recv(64)) == wire.HELLO.size
            hello = wire.HELLO.pack(wire.MAGIC, wire.PROTOCOL_VERSION, 0, b"\0" * 16)
            dropped = None
            for byte in hello:
                try:
                    s.sendall(bytes([byte]))
                    if select.select([s], [], [], 1.0)[0] and not s.recv(64):
                        dropped = time.monotonic() - start
                except (BrokenPipeError, ConnectionResetError):
                    dropped = time.monotonic() - start
                if dropped is not None:
                    break
        assert dropped is not None, "the listener kept a peer that trickled its hello"
        assert config.handshake_timeout - 0.1 <= dropped <= config.handshake_timeout + 1.5
        exchange(listener, pipe_name, config, within=5.0)
    finally:
        listener.close()


# -- the wire decoder: whatever bytes come in, a decode the receiver can allocate, or ProtocolError --


MAX_BYTES = 1 << 20


def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """Valid three times in four, so that whole messages decode often enough to test that path too."""
    return st.integers(0, 3).flatmap(lambda k: invalid if k == 0 else valid)


@st.composite
def meta_blocks(draw: st.DrawFn) -> tuple[bytes, int]:
    """Metadata blocks near the valid ones: codes, ranks, dims and byte counts at and past their limits."""
    big_dims = st.sampled_from([1 << 20, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1])
    entries = []
    for _ in range(draw(st.integers(0, 4))):
        code = draw(mostly(st.sampled_from(sorted(wire.CODE_DTYPES)), st.integers(0, 255)))
        ndim = draw(mostly(st.integers(0, 4), st.integers(0, 255)))
        dims = draw(st.lists(mostly(st.integers(0, 16), big_dims), min_size=ndim, max_size=ndim))
        itemsize = wire.CODE_DTYPES[code].itemsize if code in wire.CODE_DTYPES else 1
        true_nbytes = math.prod(dims) * itemsize % (1 << 64)
        nbytes = draw(mostly(st.just(true_nbytes), st.sampled_from([0, MAX_BYTES + 1, (1 << 64) - 1])))
        entries.append(bytes([code, ndim]) + b"".join(d.to_bytes(8, "big") for d in [*dims, nbytes]))
    block = b"".join(entries)
    if draw(mostly(st.just(False), st.just(True))):
        cut = draw(st.integers(0, len(block)))
        block = block[:cut] + draw(st.binary(max_size=8))
    return block, draw(mostly(st.just(len(entries)), st.integers(0, 8)))


def check_allocatable(metas: list[wire.TensorMeta]) -> None:
    assert sum(m.nbytes for m in metas) <= MAX_BYTES
    for m in metas:
        torch.empty(m.shape, dtype=m.dtype)  # what the receiver does next must not fail


@FUZZ
@given(st.binary(max_size=64))
def test_fuzz_wire_header(data):
    try:
        header = wire.decode_header(data)
    except ProtocolError:
        return
    assert header.count <= wire.MAX_TENSORS


@FUZZ
@given(st.one_of(meta_blocks(), st.tuples(st.binary(max_size=200), st.integers(0, 16))))
def test_fuzz_wire_metadata(block_and_count):
    block, count = block_and_count
    try:
        metas = wire.decode_meta(block, count, MAX_BYTES)
    except ProtocolError:
        return
    assert len(metas) == count
    check_allocatable(metas)
