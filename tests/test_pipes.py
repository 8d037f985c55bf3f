"""Pipes between real processes: stress, preallocated receives, faults, handshake.

The test process listens; tests/pipe_peer.py is the connecting peer.
"""

import concurrent.futures
import importlib.util
import json
import os
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from disagg import pipes
from disagg.lookup_buffer import EntryCancelled, FirstToken, LookupBufferConsumer, LookupBufferProducer
from disagg.pipes import (
    AuthError,
    PeerMayWrite,
    PipeClosed,
    PipeConfig,
    PipeError,
    PipeTimeout,
    ProtocolError,
    RowScatter,
    sockets,
    wire,
)
from disagg.pipes.base import AT_ONCE_MAX_BYTES

HERE = Path(__file__).parent
PEER = HERE / "pipe_peer.py"
_spec = importlib.util.spec_from_file_location("pipe_peer", PEER)
pipe_peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pipe_peer)


def _missing(pipe: str, package: str) -> str | None:
    """Why an optional pipe cannot be used here, or None. Found, not imported: NIXL must not
    be loaded into a process that holds grpc_tools (see test_nixl_pipe_in_a_process_of_its_own)."""
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed"
    return None


UCX_MISSING = _missing("ucx", "ucxx")
# NIXL's bundled abseil and grpc_tools' protoc in one process abort it (munmap_chunk(): invalid
# pointer), and the suite's collection imports grpc_tools: the nixl cases run in a pytest process
# of their own, which sets this variable.
NIXL_HERE = "DISAGG_TEST_NIXL" in os.environ
# The pipe imports whichever of NIXL's packages is installed (disagg/pipes/nixl.py).
NIXL_PACKAGE_MISSING = None if any(importlib.util.find_spec(p) for p in ("nixl_cu12", "nixl_cu13", "nixl")) \
    else "none of nixl-cu12, nixl-cu13, nixl is installed"
NIXL_MISSING = NIXL_PACKAGE_MISSING or (None if NIXL_HERE else "runs in a process of its own")
ALL_PIPES = [
    "tcp",
    "torch_dist",
    pytest.param(
        "ucx",
        marks=pytest.mark.skipif(
            UCX_MISSING is not None, reason=f"ucx unavailable: {UCX_MISSING}"
        ),
    ),
    pytest.param(
        "nixl",
        marks=pytest.mark.skipif(
            NIXL_MISSING is not None, reason=f"nixl: {NIXL_MISSING}"
        ),
    ),
]


@pytest.mark.slow
@pytest.mark.timeout(260)
@pytest.mark.skipif(NIXL_HERE or NIXL_PACKAGE_MISSING is not None, reason=f"nixl: {NIXL_PACKAGE_MISSING}")
def test_nixl_pipe_in_a_process_of_its_own():
    """Every [nixl] case of this file, in a pytest process that has not loaded grpc_tools."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "nixl"],
        env={**os.environ, "DISAGG_TEST_NIXL": "1"}, capture_output=True, text=True, timeout=250,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    # pytest's summary line, not the whole output: UCX logs a refused connect it then retries as an ERROR line.
    summary = result.stdout.strip().splitlines()[-1]
    assert " passed" in summary and " failed" not in summary, summary


def start_peer(
    pipe: str, mode: str, address: tuple[str, int], *extra: str
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(PEER), pipe, mode, address[0], str(address[1]), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"},
    )


def finish(peer: subprocess.Popen) -> None:
    try:
        _, err = peer.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        peer.kill()
        _, err = peer.communicate()
    assert peer.returncode == 0, f"peer failed ({peer.returncode}): {err[-2000:]}"


def echo_roundtrip(
    listener: pipes.PipeListener,
    pipe_name: str,
    seed: int,
    count: int,
    devices: tuple[str, str] = ("cpu", "cpu"),
) -> None:
    """A peer receives the seeded sequence, checks it and echoes it; we check the echoes.
    We send from devices[0] (on a GPU, every other tensor of a message stays on the CPU,
    as a lookup-buffer header does beside its KV); the peer receives into devices[1]."""
    args = ["--seed", str(seed), "--count", str(count), "--device", devices[1]]
    peer = start_peer(pipe_name, "echo", listener.address, *args)
    try:
        pipe = listener.accept(timeout=30)
        for i, msg in enumerate(pipe_peer.messages(seed, count)):
            if msg is not None:
                msg = [t.to(devices[0]) if j % 2 == 0 else t for j, t in enumerate(msg)]
            pipe.send(msg)
            if i % 3 == 0 and msg is not None:
                out = [torch.empty_like(t) for t in msg]
                got = pipe.recv(out=out)
                assert all(g is o for g, o in zip(got, out)), (
                    "recv(out=...) must fill the given tensors"
                )
            elif i % 3 == 1 and msg is not None:  # into views, as into a KV cache's blocks
                out = [scattered_views(t) for t in msg]
                assert all(g is o for g, o in zip(pipe.recv(out=out), out))
                got = [gathered(views, t) for views, t in zip(out, msg)]
            else:
                got = pipe.recv()
                if pipe_name == "torch_dist" and msg is not None and i % 2 == 0:
                    # torch_dist keeps each tensor where it was, CUDA over NCCL and CPU
                    # inline (odd messages the peer took into tensors on devices[1]).
                    assert [g.device.type for g in got] == [t.device.type for t in msg]
            assert pipe_peer.same(got, msg), f"echo of message {i} differs"
        with pytest.raises(
            PipeClosed
        ):  # the peer closes cleanly after the last message
            pipe.recv()
        pipe.close()
        finish(peer)
    finally:
        peer.kill()


def scattered_views(like: torch.Tensor) -> list[torch.Tensor]:
    """Up to four views of a larger tensor, with gaps between them, holding like.numel() elements."""
    n = like.numel()
    chunk = max(1, -(-n // 4))
    backing = torch.zeros(2 * n + 8, dtype=like.dtype)
    return [backing[2 * start + 3 : 2 * start + 3 + min(chunk, n - start)] for start in range(0, n, chunk)]


def gathered(views: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    flat = torch.cat(views) if views else torch.empty(0, dtype=like.dtype)
    return flat.view(like.shape)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipe_name", ALL_PIPES)
def test_stress_echo(pipe_name):
    listener = pipes.listen(pipe_name, PipeConfig(kv_port=0, timeout=20))
    try:
        echo_roundtrip(listener, pipe_name, seed=1234, count=500)
    finally:
        listener.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipe_name", ALL_PIPES)
def test_a_message_sent_just_before_close_arrives_whole(pipe_name):
    """A peer that sends and closes at once, as a producer does with its last KV: the close must not drop
    what the transport still holds (ucxx closes by force; before its close handshake, a 16 MiB message
    sent just before close() was cut off in 2 of 3 tries)."""
    listener = pipes.listen(pipe_name, PipeConfig(kv_port=0, timeout=20))
    peer = start_peer(pipe_name, "last", listener.address, "--repeat", "6", "--count", "16")
    try:
        expected = pipe_peer.last_message(16)
        for i in range(6):
            pipe = listener.accept(timeout=30)
            try:
                assert pipe_peer.same(pipe.recv(), expected), f"message of connection {i} differs"
                with pytest.raises(PipeClosed):  # then the clean close
                    pipe.recv()
            finally:
                pipe.close()
        finish(peer)
    finally:
        peer.kill()
        listener.close()


# Messages whose receiving memory is partly on the GPU and partly on the CPU: nixl's receiver stages
# what lies outside its registered memory (disagg/pipes/nixl.py).
CUDA_ECHO_PIPES = [*ALL_PIPES[:3], pytest.param("nixl", marks=[
    pytest.mark.skipif(NIXL_MISSING is not None, reason=f"nixl: {NIXL_MISSING}")])]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipe_name", CUDA_ECHO_PIPES)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_cuda_tensors_between_two_gpus(pipe_name):
    torch.cuda.set_device(0)
    listener = pipes.listen(pipe_name, PipeConfig(kv_port=0, timeout=60))
    try:
        echo_roundtrip(
            listener, pipe_name, seed=99, count=100, devices=("cuda:0", "cuda:1")
        )
    finally:
        listener.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipe_name", ALL_PIPES)
def test_peer_killed_mid_transfer(pipe_name):
    timeout = 5.0
    listener = pipes.listen(pipe_name, PipeConfig(kv_port=0, timeout=timeout))
    peer = start_peer(
        pipe_name, "big", listener.address, "--count", "1024", "--timeout", str(timeout)
    )
    try:
        pipe = listener.accept(timeout=30)
        result: dict = {}

        def receive():
            start = time.monotonic()
            try:
                pipe.recv([torch.empty(1024 << 20, dtype=torch.uint8)])
            except PipeError as e:
                result["error"] = e
            result["elapsed"] = time.monotonic() - start

        receiver = threading.Thread(target=receive)
        receiver.start()
        assert peer.stdout.readline().strip() == "sending"
        time.sleep(0.3)  # well inside the 1 GiB transfer
        peer.send_signal(signal.SIGKILL)
        receiver.join(timeout + 10)
        assert not receiver.is_alive(), "recv hung after the peer died"
        assert isinstance(result.get("error"), PipeError), result
        # A dead peer writes no more: its memory may be reused (nixl sees its socket close).
        assert not isinstance(result["error"], PeerMayWrite), result
        assert result["elapsed"] < timeout + 5
    finally:
        peer.kill()
        peer.wait()
        listener.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"nixl: {NIXL_MISSING}")
@pytest.mark.parametrize("cut_off_by,registered", [("timeout", False), ("close", False), ("timeout", True)])
def test_nixl_receive_cut_off_while_the_peer_may_still_write_is_said_so(cut_off_by, registered):
    """A one-sided receive into memory registered once (a KV cache) cut off (by the pipe's timeout, or
    by close() from another thread, as a discard does) while the peer is alive but stopped (it could
    write any moment) raises PeerMayWrite once the drain time is up: that memory must not be reused,
    and it stays registered after the pipe is closed. The peer is stopped after its header arrived,
    before it could have written. Into other memory, the peer was handed only the pipe's staging
    memory: the receive raises the cut-off's own error, the caller's memory is free to reuse, and
    the staging memory stays registered for good."""
    timeout = 1.0 if cut_off_by == "timeout" else 30.0
    listener = pipes.listen("nixl", PipeConfig(kv_port=0, timeout=timeout))
    peer = start_peer("nixl", "big", listener.address, "--count", "1", "--timeout", "30")
    try:
        pipe = listener.accept(timeout=30)
        pipe._agent = agent = pipe_peer.CountingAgent(pipe._agent)
        if registered:
            cache = torch.zeros(3 << 20, dtype=torch.uint8)
            pipe.register(cache)
            dest = cache[1 << 20:2 << 20]
        else:
            dest = torch.zeros(1 << 20, dtype=torch.uint8)
        assert peer.stdout.readline().strip() == "sending"
        readable, _, _ = select.select([pipe._sock], [], [], 30)  # the message's header is here
        assert readable
        peer.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        if cut_off_by == "close":
            threading.Timer(0.5, pipe.close).start()  # the receive has handed out its memory by then
        if registered:
            with pytest.raises(PeerMayWrite, match="must not be reused"):
                pipe.recv([dest])
        else:
            with pytest.raises(PipeTimeout if cut_off_by == "timeout" else PipeClosed) as raised:
                pipe.recv([dest])
            assert not isinstance(raised.value, PeerMayWrite)
        assert time.monotonic() - start < 10  # the timeout or close, then the drain (5 s at most)
        with pytest.raises(PipeError, match="broken|closed"):
            pipe.recv()
        pipe.close()
        assert agent.calls.get("deregister_memory", 0) == 0  # neither the staging memory nor the cache
    finally:
        peer.send_signal(signal.SIGCONT)
        peer.kill()
        peer.wait()
        listener.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipe", ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(
    NIXL_MISSING is not None, reason=f"nixl: {NIXL_MISSING}"))])
def test_some_heads_of_each_row_take_the_message_and_nothing_else_is_touched(pipe: str):
    """A tensor-parallel prefill rank's share of a decode rank's heads (RowScatter.heads), through one
    buffer: each row's heads 1-2 of 4 take the message, in order; the other heads and rows keep what
    they held."""
    listener = pipes.listen(pipe, PipeConfig(kv_port=0, timeout=20))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(listener.accept, 30)
        sender = pipes.connect(pipe, PipeConfig(timeout=20), *listener.address)
        receiver = accepted.result()
        try:
            cache = torch.full((2, 2, 16, 4, 8), -3.0)  # [layers, 2, rows, kv heads, head dim]
            before = cache.clone()
            rows = torch.tensor([3, 4, 5, 12, 0])  # a run of three, then single rows
            message = torch.randn(2, 2, 5, 2, 8)
            sent = pool.submit(sender.send, [message])
            receiver.recv([RowScatter(cache, rows, (1, 3))])
            sent.result(timeout=20)
            assert torch.equal(cache[:, :, rows, 1:3], message)
            before[:, :, rows, 1:3] = message
            assert torch.equal(cache, before)  # nothing else was written
        finally:
            sender.close()
            receiver.close()
            listener.close()


@pytest.mark.timeout(60)
@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"nixl: {NIXL_MISSING}")
def test_nixl_memory_registered_once_takes_no_metadata_per_message():
    """Messages into a registered KV cache (a RowScatter's rows) and a registered buffer (a view in it)
    cost no registration and no metadata per message: both registrations' metadata crosses once, with
    the first message. A destination outside them (message 4) lands in the pipe's staging memory,
    registered once as well, and is copied from there. Every byte lands bit-exact in its rows, and no
    other row is touched."""
    seed, count, sentinel = 7, 6, -3.0
    listener = pipes.listen("nixl", PipeConfig(kv_port=0, timeout=20))
    peer = start_peer("nixl", "kv", listener.address, "--seed", str(seed), "--count", str(count))
    try:
        pipe = listener.accept(timeout=30)
        pipe._agent = agent = pipe_peer.CountingAgent(pipe._agent)
        cache = torch.zeros(2, 2, 32, 2, 8, dtype=torch.bfloat16)  # [layers, 2, rows, kv heads, head dim]
        side = torch.zeros(count, 3)
        pipe.register(cache)
        pipe.register(side)
        pipe.register(cache[1])  # inside the cache: nothing new
        for i in range(count):
            kv, small = pipe_peer.kv_message(seed, i)
            rows = torch.tensor([i, i + 1, i + 2, 30 - i, 15])  # a run of three, then single rows
            cache.fill_(sentinel)
            into = torch.zeros(3) if i == 4 else side[i]
            pipe.recv([RowScatter(cache, rows), into])
            assert torch.equal(cache[:, :, rows], kv), f"message {i}"
            others = torch.ones(32, dtype=torch.bool)
            others[rows] = False
            assert bool((cache[:, :, others] == sentinel).all()), f"message {i} wrote outside its rows"
            assert torch.equal(into, small), f"message {i}"
        with pytest.raises(PipeClosed):  # the peer's goodbye
            pipe.recv()
        # The cache, the buffer and the staging memory: one registration and one metadata blob each.
        assert agent.calls["register_memory"] == 3
        assert agent.calls["get_partial_agent_metadata"] == 3
        assert "deregister_memory" not in agent.calls
        pipe.close()
        assert agent.calls["deregister_memory"] == 3  # all of it, as the pipe closes
        line = peer.stdout.readline()  # printed once its pipe closed; its exit takes seconds more
        assert line, peer.stderr.read()[-2000:]
        # The cache's and the buffer's metadata (with the first message), the staging memory's (message 4).
        assert json.loads(line) == {"add_remote_agent": 3}
    finally:
        peer.kill()
        peer.wait()
        listener.close()


@pytest.mark.timeout(60)
@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"nixl: {NIXL_MISSING}")
def test_nixl_sends_from_memory_registered_once_register_nothing_per_message():
    """A sender's buffer registered once (a prefill node's KV) is written from with no registration
    per message; a source outside it is registered for its message alone. Every byte arrives."""
    listener = pipes.listen("nixl", PipeConfig(kv_port=0, timeout=20))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        accepted = pool.submit(listener.accept, 30)
        sender = pipes.connect("nixl", PipeConfig(timeout=20), *listener.address)
        receiver = accepted.result()
        try:
            source = torch.randn(4, 64)
            sender.register(source)
            sender._agent = agent = pipe_peer.CountingAgent(sender._agent)
            for i, tensor in enumerate([source[0], source[1:3], torch.randn(5), source[3]]):
                sent = pool.submit(sender.send, [tensor])
                out = receiver.recv()
                sent.result(timeout=20)
                assert torch.equal(out[0], tensor), f"message {i}"
            assert agent.calls["register_memory"] == agent.calls["deregister_memory"] == 1  # message 2's
        finally:
            sender.close()
            receiver.close()
            listener.close()


@pytest.mark.timeout(60)
@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"nixl: {NIXL_MISSING}")
def test_nixl_consumer_registers_its_cache_once():
    """The lookup-buffer consumer registers a RowScatter's tensor (a decode node's KV cache) with the
    connection before its first entry: a layer-wise entry in two chunks lands in its rows, and the
    next entry's KV lands in other rows with no registration and no metadata at all (its header lands
    in the pipe's staging memory, registered with the first entry's)."""
    config = PipeConfig(kv_port=0, timeout=20)
    consumer = LookupBufferConsumer("nixl", config)
    producer = LookupBufferProducer("nixl", config, 1 << 24, 30.0, 5.0)
    try:
        cache = torch.zeros(4, 2, 16, 2, 3)
        kv, later = torch.randn(4, 2, 7, 2, 3), torch.randn(4, 2, 5, 2, 3)
        rows, later_rows = torch.tensor([9, 10, 11, 4, 5, 14, 15]), torch.tensor([0, 1, 2, 7, 8])
        groups = [(0, 1), (1, 4)]
        consumer.expect("layers", [RowScatter(cache, rows)])
        producer.open("layers", [1], groups, 7, kv.nbytes, consumer.address)
        for start, stop in ((0, 3), (3, 7)):
            for first, end in groups:
                producer.put("layers", first, end, kv[first:end, :, start:stop].clone())
        assert consumer.drop_select("layers", [1], 20).in_place
        assert torch.equal(cache[:, :, rows], kv)
        (pipe,) = consumer._pipes
        pipe._agent = agent = pipe_peer.CountingAgent(pipe._agent)
        consumer.expect("whole", [RowScatter(cache, later_rows)])
        producer.insert("whole", [2], [later], None, consumer.address)
        assert consumer.drop_select("whole", [2], 20).in_place
        assert torch.equal(cache[:, :, later_rows], later) and torch.equal(cache[:, :, rows], kv)
        assert "register_memory" not in agent.calls and "get_partial_agent_metadata" not in agent.calls
    finally:
        producer.close()
        consumer.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipe_name", ALL_PIPES)
def test_bad_peers_do_not_stop_the_listener(pipe_name):
    listener = pipes.listen(pipe_name, PipeConfig(kv_port=0, timeout=5))
    try:
        bad_hellos = [
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(64),  # garbage
            wire.HELLO.pack(
                b"XXXX", wire.PROTOCOL_VERSION, 0, b"\0" * 16
            ),  # wrong magic
            wire.HELLO.pack(
                wire.MAGIC, wire.PROTOCOL_VERSION + 1, 0, b"\0" * 16
            ),  # wrong version
        ]
        for hello in bad_hellos:
            with socket.create_connection(listener.address, timeout=5) as s:
                s.sendall(hello)
                if (
                    pipe_name != "ucx"
                ):  # a raw TCP peer meets UCX's own connection protocol, not ours
                    assert _read_until_closed(s) <= wire.HELLO.size, (
                        "listener kept talking to a bad peer"
                    )
        with pytest.raises(AuthError, match="kv_auth_token mismatch"):
            pipes.connect(
                pipe_name, PipeConfig(auth_token="wrong", timeout=5), *listener.address
            )
        echo_roundtrip(listener, pipe_name, seed=7, count=20)
        with pytest.raises(PipeTimeout):  # no rejected peer ever came out of accept()
            listener.accept(timeout=0.5)
    finally:
        listener.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipe_name", ALL_PIPES)
def test_auth_token_mismatch(pipe_name):
    listener = pipes.listen(
        pipe_name, PipeConfig(kv_port=0, auth_token="secret", timeout=5)
    )
    try:
        for token in ("wrong", None):
            with pytest.raises(AuthError, match="kv_auth_token mismatch"):
                pipes.connect(
                    pipe_name,
                    PipeConfig(auth_token=token, timeout=5),
                    *listener.address,
                )
        good = pipes.connect(
            pipe_name, PipeConfig(auth_token="secret", timeout=5), *listener.address
        )
        served = listener.accept(timeout=10)
        # torch_dist's send waits for the matching recv, so send from another thread.
        sender = threading.Thread(target=good.send, args=([torch.arange(5)],))
        sender.start()
        assert torch.equal(served.recv()[0], torch.arange(5))
        sender.join()
        good.close()
        served.close()
    finally:
        listener.close()


@pytest.mark.timeout(30)
def test_version_mismatch_named_on_connect():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def old_listener():
        conn, _ = server.accept()
        conn.sendall(wire.HELLO.pack(wire.MAGIC, 99, 0, b"\0" * 16))
        conn.recv(1024)
        conn.close()

    threading.Thread(target=old_listener, daemon=True).start()
    with pytest.raises(
        ProtocolError, match=f"version 99, we speak {wire.PROTOCOL_VERSION}"
    ):
        pipes.connect("tcp", PipeConfig(timeout=5), "127.0.0.1", port)
    server.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pipe_name", ALL_PIPES)
def test_close_wakes_both_sides(pipe_name):
    listener = pipes.listen(pipe_name, PipeConfig(kv_port=0, timeout=10))
    try:
        client = pipes.connect(pipe_name, PipeConfig(timeout=10), *listener.address)
        server = listener.accept(timeout=10)
        for closer, waiter in ((client, server), (server, client)):
            threading.Timer(0.3, closer.close).start()
            start = time.monotonic()
            with pytest.raises(PipeClosed):
                waiter.recv()
            assert time.monotonic() - start < 5
            waiter.close()
            client = pipes.connect(pipe_name, PipeConfig(timeout=10), *listener.address)
            server = listener.accept(timeout=10)
        client.close()
        server.close()
    finally:
        listener.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipe_name", ALL_PIPES)
def test_a_refused_send_keeps_the_pipe_and_a_cut_off_one_breaks_it(pipe_name):
    """A message the wire cannot describe is refused before any byte leaves: the pipe carries on.
    A send that fails once the message has started (the peer is gone) breaks the pipe for good."""
    listener = pipes.listen(pipe_name, PipeConfig(kv_port=0, timeout=2))
    try:
        client = pipes.connect(pipe_name, PipeConfig(timeout=2), *listener.address)
        server = listener.accept(timeout=10)
        with pytest.raises(ProtocolError, match="cannot send dtype"):
            client.send([torch.ones(2), torch.zeros(2, dtype=torch.complex64)])
        got: list = []
        receiver = threading.Thread(target=lambda: got.extend(server.recv()))  # gloo sends wait for the recv
        receiver.start()
        client.send([torch.arange(5)])
        receiver.join(10)
        assert len(got) == 1 and torch.equal(got[0], torch.arange(5))
        server.close()
        with pytest.raises(PipeError):
            for _ in range(8):  # the first may still fit in the socket buffers
                client.send([torch.ones(1 << 22)])
        with pytest.raises(PipeError, match="broken"):
            client.send([torch.arange(5)])
        client.close()
    finally:
        listener.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipe_name", ["tcp", "torch_dist"])
def test_send_at_once_never_waits(pipe_name):
    """send_at_once sends a small message of CPU tensors only when nothing can make it wait: not while
    another send holds the pipe (one blocked on a peer that does not read), not a message over its
    bound, and not over gloo (CPU torch_dist: its bytes wait for the peer's receive); then it returns
    False at once with nothing sent, and the messages arrive in the order they were sent."""
    listener = pipes.listen(pipe_name, PipeConfig(kv_port=0, timeout=30))
    try:
        client = pipes.connect(pipe_name, PipeConfig(timeout=30), *listener.address)
        server = listener.accept(timeout=10)
        small = [torch.arange(8)]
        if pipe_name == "torch_dist":
            assert not client.send_at_once(small)
        else:
            assert client.send_at_once(small)
            assert torch.equal(server.recv()[0], small[0])
            assert not client.send_at_once([torch.zeros(AT_ONCE_MAX_BYTES + 1, dtype=torch.uint8)])
            big = threading.Thread(target=client.send, args=([torch.ones(16 << 20)],))
            big.start()  # blocks: nobody reads its 64 MiB yet
            deadline = time.monotonic() + 10
            while not client._send_lock.locked() and time.monotonic() < deadline:
                time.sleep(0.01)
            start = time.monotonic()
            assert not client.send_at_once([torch.arange(3)])
            assert time.monotonic() - start < 2  # not the big send's wait, which lasts until the peer reads
            assert torch.equal(server.recv()[0], torch.ones(16 << 20))
            big.join(10)
            assert client.send_at_once([torch.arange(3)])
            assert torch.equal(server.recv()[0], torch.arange(3))  # the refused one was never sent
        client.close()
        server.close()
    finally:
        listener.close()


def test_a_socket_past_descriptor_1023_is_polled_too():
    """select() refuses descriptors above 1023, which a node with many peers and CUDA's files reaches."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard if hard != resource.RLIM_INFINITY else soft) < 2048:
        pytest.skip("the open-file limit is below 2048")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    a, b = socket.socketpair()
    high = socket.socket(fileno=os.dup2(a.fileno(), 2000))
    try:
        assert sockets.writable(high)
        high.close()
        assert not sockets.writable(high)  # closed: fd -1
    finally:
        for s in (a, b, high):
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(30)
def test_idle_recv_times_out_and_pipe_stays_usable():
    listener = pipes.listen("tcp", PipeConfig(kv_port=0, timeout=0.5))
    try:
        client = pipes.connect("tcp", PipeConfig(timeout=0.5), *listener.address)
        server = listener.accept(timeout=10)
        with pytest.raises(PipeTimeout):
            server.recv()
        client.send([torch.ones(3, dtype=torch.bfloat16)])
        assert torch.equal(server.recv()[0], torch.ones(3, dtype=torch.bfloat16))
        with pytest.raises(ProtocolError, match="out has 2"):
            client.send([torch.ones(1)])
            server.recv(out=[torch.empty(1), torch.empty(1)])
        client.close()
        server.close()
    finally:
        listener.close()


def test_unknown_pipe_names_the_known_ones():
    with pytest.raises(ValueError, match="tcp, torch_dist, ucx"):
        pipes.listen("carrier_pigeon", PipeConfig())


def test_wire_rejects_malformed_headers():
    good = wire.encode(wire.Kind.TENSORS, [wire.TensorMeta(torch.float32, (2, 3))])
    head, meta = good[: wire.HEADER.size], good[wire.HEADER.size :]
    assert wire.decode_meta(meta, 1, 1 << 20) == [wire.TensorMeta(torch.float32, (2, 3))]
    with pytest.raises(ProtocolError, match="bad magic"):
        wire.decode_header(b"XKV1" + head[4:])
    with pytest.raises(ProtocolError, match="version 7, we speak"):
        wire.decode_header(head[:4] + struct.pack("!H", 7) + head[6:])
    with pytest.raises(ProtocolError, match="unknown message kind"):
        wire.decode_header(head[:6] + bytes([9]) + head[7:])
    with pytest.raises(ProtocolError, match="unknown dtype code"):
        wire.decode_meta(bytes([99]) + meta[1:], 1, 1 << 20)
    with pytest.raises(ProtocolError, match="at most 8"):
        wire.decode_meta(struct.pack("!BB9QQ", 1, 9, *[1] * 9, 4), 1, 1 << 20)
    with pytest.raises(ProtocolError, match="does not match shape"):
        wire.decode_meta(struct.pack("!BB2QQ", 1, 2, 2, 3, 25), 1, 1 << 20)
    with pytest.raises(ProtocolError, match="truncated"):
        wire.decode_meta(meta[:-3], 1, 1 << 20)
    with pytest.raises(ProtocolError, match="larger than 1048576 bytes"):
        wire.decode_meta(struct.pack("!BB1QQ", 9, 1, (1 << 20) + 1, (1 << 20) + 1), 1, 1 << 20)
    with pytest.raises(ProtocolError, match="larger than"):  # 512 GiB claimed by two tensors
        wire.decode_meta(struct.pack("!BB1QQ", 9, 1, 1 << 38, 1 << 38) * 2, 2, 1 << 38)
    with pytest.raises(ProtocolError, match="too large to allocate"):  # empty, but torch would overflow
        wire.decode_meta(struct.pack("!BB2QQ", 1, 2, 1 << 63, 0, 0), 1, 1 << 40)
    with pytest.raises(ProtocolError, match="does not match shape"):  # the product overflows 64 bits
        wire.decode_meta(struct.pack("!BB2QQ", 9, 2, 1 << 32, 1 << 32, 0), 1, 1 << 40)
    with pytest.raises(ProtocolError, match="header is 16 bytes, got 3"):
        wire.decode_header(head[:3])
    with pytest.raises(ProtocolError, match="cannot send dtype"):
        wire.TensorMeta.of(torch.zeros(1, dtype=torch.complex64))


def _read_until_closed(s: socket.socket) -> int:
    """Bytes the listener sent before hanging up on us (a reset counts as hanging up)."""
    total = 0
    try:
        while chunk := s.recv(4096):
            total += len(chunk)
    except ConnectionResetError:
        pass
    return total


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipe_name", ALL_PIPES)
def test_layer_wise_entries_on_every_pipe(pipe_name):
    """The lookup buffer's layer-wise entries on each transport, on one connection: parts into the
    views of a cache (into a tensor of its own where the peer writes one-sided), an entry cancelled
    after its first part, then a whole entry."""
    config = PipeConfig(kv_port=0, timeout=20)
    received: list[int] = []  # bytes of each KV message the consumer took
    consumer = LookupBufferConsumer(pipe_name, config, on_received=received.append)
    producer = LookupBufferProducer(pipe_name, config, 1 << 24, 30.0, 5.0)
    try:
        kv = torch.randn(4, 2, 5, 2, 3)
        cache = torch.zeros(4, 2, 8, 2, 3)
        consumer.expect("parts", [[cache[layer, k, row:row + rows] for layer in range(4) for k in (0, 1)
                                   for row, rows in ((3, 2), (0, 3))]])
        groups = [(0, 1), (1, 3), (3, 4)]
        producer.open("parts", [1], groups, kv.shape[2], kv.nbytes, consumer.address)
        producer.open("cancelled", [2], [(0, 2), (2, 4)], kv.shape[2], kv.nbytes, consumer.address)
        for first, end in groups:
            producer.put("parts", first, end, kv[first:end].clone())
        producer.put("cancelled", 0, 2, kv[0:2].clone())
        entry = consumer.drop_select("parts", [1], 20)
        assert entry.in_place
        got = torch.cat([cache[:, :, 3:5], cache[:, :, 0:3]], dim=2) if entry.in_place else entry.kv_tensors[0]
        assert torch.equal(got, kv)
        # Aborted once on the wire (its first part received): the consumer is told. Aborted before, it
        # would be dropped unsent and untold (the prefill node's failed call tells the decode node).
        deadline = time.monotonic() + 20
        while len(received) < len(groups) + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        producer.abort("cancelled")
        with pytest.raises(EntryCancelled):
            consumer.drop_select("cancelled", [2], 20)
        producer.insert("whole", [3], [torch.ones(3)], None, consumer.address)
        assert torch.equal(consumer.drop_select("whole", [3], 20).kv_tensors[0], torch.ones(3))
        assert consumer.stats().connections == 1
    finally:
        producer.close()
        consumer.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipe_name", ALL_PIPES)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_chunked_cuda_parts_land_in_the_rows_of_a_cache_between_two_gpus(pipe_name):
    """A prompt computed in two chunks on cuda:0, its layer parts landing in scattered rows of a cache on
    cuda:1 (a RowScatter, as a decode node's reserved blocks): the chunk message between them (a CPU
    tensor alone) and every part arrive, and nothing lands outside those rows; twice on one connection."""
    torch.cuda.set_device(0)
    config = PipeConfig(kv_port=0, timeout=60)
    consumer = LookupBufferConsumer(pipe_name, config, device="cuda:1")
    producer = LookupBufferProducer(pipe_name, config, 1 << 30, 30.0, 5.0)
    try:
        groups = [(0, 3), (3, 7), (7, 8)]
        for request in ("a", "b"):
            kv = torch.randn(8, 2, 3000, 8, 128, device="cuda:0")
            cache = torch.zeros(8, 2, 8192, 8, 128, device="cuda:1")
            rows = torch.randperm(8192, generator=torch.Generator().manual_seed(len(request)))[:3000].pin_memory()
            consumer.expect(request, [RowScatter(cache, rows)])
            producer.open(request, [1], groups, 3000, kv.nbytes, consumer.address)
            for start, stop in ((0, 2048), (2048, 3000)):
                for first, end in groups:
                    ready = torch.cuda.Event()
                    part = kv[first:end, :, start:stop] * 1.0
                    ready.record()
                    producer.put(request, first, end, part, ready)
            entry = consumer.drop_select(request, [1], 60)
            torch.cuda.synchronize("cuda:1")
            assert entry.in_place
            assert torch.equal(cache[:, :, rows.to("cuda:1")].cpu(), kv.cpu())
            others = torch.ones(8192, dtype=torch.bool, device="cuda:1")
            others[rows.to("cuda:1")] = False
            assert not cache[:, :, others].any()
    finally:
        producer.close()
        consumer.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipe_name", ALL_PIPES)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_layer_wise_cuda_parts_between_two_gpus(pipe_name):
    """Layer parts computed on cuda:0 by a stream still busy with later work, each handed over with
    the event after its own layer (as a prefill node's do), land in views of a cache on cuda:1; the
    prompt's first token follows them (sent on the caller's thread where the pipe takes it at once)."""
    torch.cuda.set_device(0)
    config = PipeConfig(kv_port=0, timeout=60)
    consumer = LookupBufferConsumer(pipe_name, config, device="cuda:1")  # receives as a decode node on GPU 1
    producer = LookupBufferProducer(pipe_name, config, 1 << 30, 30.0, 5.0)
    try:
        layers, kv = 8, torch.randn(8, 2, 4096, 8, 128, device="cuda:0")
        cache = torch.zeros(8, 2, 4096, 8, 128, device="cuda:1")
        consumer.expect("r", [[cache[layer, k] for layer in range(layers) for k in (0, 1)]])
        producer.open("r", [1], [(layer, layer + 1) for layer in range(layers)], kv.shape[2], kv.nbytes,
                      consumer.address, first_token=True)
        big = torch.randn(8192, 8192, device="cuda:0")
        for layer in range(layers):
            part = kv[layer:layer + 1] * 1.0  # computed on the engine's stream
            ready = torch.cuda.Event()
            ready.record()
            producer.put("r", layer, layer + 1, part, ready)
            big = big @ big / 8192  # later work queued behind it
        torch.cuda.synchronize("cuda:0")  # as the engine reads its sampled token back
        assert producer.put_first_token("r", FirstToken(7, -0.5, [(7, -0.5)]))
        entry = consumer.drop_select("r", [1], 60)
        torch.cuda.synchronize("cuda:1")
        got = cache if entry.in_place else entry.kv_tensors[0]
        assert torch.equal(got.cpu(), kv.cpu()) and entry.first_token == FirstToken(7, -0.5, [(7, -0.5)])
    finally:
        producer.close()
        consumer.close()
