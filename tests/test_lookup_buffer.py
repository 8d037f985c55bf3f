"""LookupBuffer over the tcp pipe: producers in their own processes (tests/lookup_peer.py),
consumers in this one, all on loopback and CPU."""

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from lookup_peer import make_request

from disagg.lookup_buffer import (
    BufferFullError,
    DigestMismatch,
    EntryCancelled,
    FirstToken,
    KVEntry,
    LookupBufferConsumer,
    LookupBufferProducer,
    LookupDiscarded,
    LookupTimeout,
    ProducerLost,
    token_digest,
)
from disagg.lookup_buffer import consumer as consumer_module
from disagg.lookup_buffer.messages import Hello, encode_entry, encode_hello
from disagg.pipes import PipeConfig, PipeError, RowScatter, sockets, tcp, wire

ROOT = Path(__file__).resolve().parent.parent
PEER = Path(__file__).resolve().parent / "lookup_peer.py"


@pytest.fixture
def make_consumer() -> Iterator[Callable[..., LookupBufferConsumer]]:
    consumers = []

    def make(ttl: float = 30.0) -> LookupBufferConsumer:
        consumers.append(LookupBufferConsumer("tcp", PipeConfig(kv_port=0), ttl=ttl))
        return consumers[-1]

    yield make
    for consumer in consumers:
        consumer.close()


@pytest.fixture
def make_producer() -> Iterator[Callable[..., LookupBufferProducer]]:
    producers = []

    def make(kv_buffer_size: int = 1 << 20, ttl: float = 30.0, insert_timeout: float = 5.0,
             **kwargs) -> LookupBufferProducer:
        producers.append(LookupBufferProducer("tcp", PipeConfig(kv_port=0), kv_buffer_size, ttl, insert_timeout,
                                              **kwargs))
        return producers[-1]

    yield make
    for producer in producers:
        producer.close()


@pytest.fixture
def spawn_producer() -> Iterator[Callable[..., subprocess.Popen]]:
    """Start tests/lookup_peer.py; killed at teardown if still running."""
    procs = []

    def spawn(dests: list[tuple[str, int]], source_port: int, count: int, first: int = 0, **opts) -> subprocess.Popen:
        cmd = [sys.executable, str(PEER), f"--source-port={source_port}", f"--count={count}", f"--first={first}"]
        for host, port in dests:
            cmd += ["--dest", f"{host}:{port}"]
        for name, value in opts.items():
            cmd += [f"--{name.replace('_', '-')}", str(value)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
        return procs[-1]

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


def producer_stats(proc: subprocess.Popen, timeout: float = 30.0) -> dict:
    """The stats the peer prints once everything is sent."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"producer exited with {proc.returncode}"
    return json.loads(out.strip().splitlines()[-1])


def assert_entry(entry: KVEntry, i: int, big_floats: int = 0) -> None:
    token_ids, kv, extras = make_request(i)
    kv += [torch.ones(big_floats)] if big_floats else []
    assert entry.request_id == f"req-{i}"
    assert entry.token_digest == token_digest(token_ids)
    assert entry.extras == extras
    assert len(entry.kv_tensors) == len(kv)
    for got, want in zip(entry.kv_tensors, kv):
        assert got.dtype == want.dtype and torch.equal(got, want)


def lookup(consumer: LookupBufferConsumer, i: int, timeout: float = 20.0, **kwargs) -> KVEntry:
    token_ids, _, _ = make_request(i)
    return consumer.drop_select(f"req-{i}", token_ids, timeout, **kwargs)


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_shuffled_lookups_with_backpressure(make_consumer, spawn_producer):
    consumer = make_consumer()
    # ~20 KB entries through a 64 KB buffer: the producer's inserts must wait for the sender.
    proc = spawn_producer([consumer.address], source_port=1001, count=200, buffer_bytes=64 << 10)
    order = list(range(200))
    random.Random(0).shuffle(order)
    results: dict[int, KVEntry] = {}
    errors: list[BaseException] = []

    def worker(indices: list[int]) -> None:
        try:
            for i in indices:
                results[i] = lookup(consumer, i, source=("127.0.0.1", 1001))
        except BaseException as e:  # noqa: BLE001  the main thread raises it
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(order[k::4],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in range(200):
        assert_entry(results[i], i)

    sent = producer_stats(proc)
    assert sent["inserts"] == sent["sent"] == 200
    assert sent["insert_waits"] > 0, "buffer never filled: backpressure not exercised"
    assert sent["full_errors"] == sent["expiries"] == 0
    assert sent["entries"] == sent["bytes"] == 0
    stats = consumer.stats()
    assert stats.hits == stats.received == 200
    assert stats.entries == stats.bytes == 0
    assert stats.bytes_received == sent["bytes_sent"]


@pytest.mark.timeout(30)
def test_lookup_never_inserted_times_out(make_consumer):
    consumer = make_consumer()
    start = time.monotonic()
    with pytest.raises(LookupTimeout, match=r"'never'.*0\.3s"):
        consumer.drop_select("never", [1, 2, 3], timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 1.0
    assert consumer.stats().timeouts == 1


@pytest.mark.timeout(30)
def test_producer_ttl_frees_unreachable_entries(make_producer):
    producer = make_producer(ttl=0.5)
    token_ids, kv, extras = make_request(0)
    start = time.monotonic()
    producer.insert("req-0", token_ids, kv, extras, ("127.0.0.1", unused_port()))
    assert producer.stats().bytes > 0
    wait_until(lambda: producer.stats().entries == 0, timeout=5.0)
    assert time.monotonic() - start >= 0.5
    stats = producer.stats()
    assert (stats.bytes, stats.expiries, stats.sent) == (0, 1, 0)
    assert stats.send_errors >= 1


def sender_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kv-producer-send-")]


@pytest.mark.timeout(30)
def test_senders_survive_unresolvable_names_and_idle_ones_go_away(make_consumer, make_producer):
    """A destination whose name cannot even be encoded (a 70-character label) is retried until its
    entry expires, like an unreachable one, without hurting other destinations; a sender with
    nothing to send closes its connection and ends, and the next insert starts a new one."""
    consumer = make_consumer()
    producer = make_producer(ttl=1.0, idle_sender_s=0.5)
    token_ids, kv, extras = make_request(0)
    producer.insert("req-bad", token_ids, kv, extras, ("a" * 70 + ".example", 9))
    for i in (1, 2):
        token_ids, kv, extras = make_request(i)
        producer.insert(f"req-{i}", token_ids, kv, extras, consumer.address)
        assert_entry(lookup(consumer, i), i)
        if i == 1:
            wait_until(lambda: sender_threads() == [], timeout=10.0)  # both idle once req-bad expired
            assert producer.stats().expiries == 1 and producer.stats().send_errors >= 1
    wait_until(lambda: sender_threads() == [], timeout=10.0)
    assert producer.stats().sent == 2


@pytest.mark.timeout(30)
def test_consumer_ttl_frees_unclaimed_entries(make_consumer, make_producer):
    consumer = make_consumer(ttl=0.5)
    producer = make_producer()
    token_ids, kv, extras = make_request(0)
    producer.insert("req-0", token_ids, kv, extras, consumer.address)
    wait_until(lambda: consumer.stats().received == 1, timeout=5.0)
    assert consumer.stats().bytes > 0
    wait_until(lambda: consumer.stats().entries == 0, timeout=5.0)
    stats = consumer.stats()
    assert (stats.bytes, stats.expiries, stats.hits) == (0, 1, 0)
    with pytest.raises(LookupTimeout):
        consumer.drop_select("req-0", token_ids, timeout=0.1)


@pytest.mark.timeout(30)
def test_insert_into_full_buffer_raises_after_insert_timeout(make_producer):
    producer = make_producer(kv_buffer_size=1000, ttl=60.0, insert_timeout=0.3)
    nowhere = ("127.0.0.1", unused_port())  # nothing drains the buffer
    producer.insert("a", [1], [torch.zeros(200)], None, nowhere)  # 800 bytes
    start = time.monotonic()
    with pytest.raises(BufferFullError, match=r"800 of 1000 bytes"):
        producer.insert("b", [2], [torch.zeros(200)], None, nowhere)
    assert 0.3 <= time.monotonic() - start < 1.0
    with pytest.raises(BufferFullError, match="more than the whole kv_buffer_size"):
        producer.insert("huge", [3], [torch.zeros(251)], None, nowhere)
    # An entry opened without waiting is refused at once while there is no room, and queues nothing.
    start = time.monotonic()
    assert not producer.open("c", [4], [(0, 1)], 1, 800, nowhere, wait=False)
    assert time.monotonic() - start < 0.1
    # Aborting the unsent entry gives its bytes back.
    assert producer.abort("a")
    producer.insert("b", [2], [torch.zeros(200)], None, nowhere)
    assert producer.open("c", [4], [(0, 1)], 1, 200, nowhere, wait=False)
    stats = producer.stats()
    assert (stats.entries, stats.bytes, stats.aborts, stats.full_errors, stats.insert_waits) == (2, 1000, 1, 2, 1)


@pytest.mark.timeout(30)
def test_wrong_digest_is_refused(make_consumer, make_producer):
    consumer = make_consumer()
    producer = make_producer()
    producer.insert("r", [1, 2, 3], [torch.ones(4)], None, consumer.address)
    with pytest.raises(DigestMismatch) as excinfo:
        consumer.drop_select("r", [1, 2, 4], timeout=5.0)
    assert token_digest([1, 2, 3]) in str(excinfo.value)
    assert token_digest([1, 2, 4]) in str(excinfo.value)
    assert consumer.stats().digest_mismatches == 1


@pytest.mark.timeout(30)
def test_discard_ends_lookup_and_drops_late_entry(make_consumer, make_producer):
    consumer = make_consumer()
    producer = make_producer()
    threading.Timer(0.2, consumer.discard, args=("r",)).start()
    with pytest.raises(LookupDiscarded):
        consumer.drop_select("r", [1], timeout=10.0)
    producer.insert("r", [1], [torch.ones(4)], None, consumer.address)  # arrives after the discard
    producer.insert("s", [2], [torch.ones(4)], None, consumer.address)
    consumer.drop_select("s", [2], timeout=5.0)  # entries arrive in order: "r" came and went first
    stats = consumer.stats()
    assert (stats.received, stats.hits, stats.entries, stats.bytes) == (2, 1, 0, 0)


@pytest.mark.timeout(30)
def test_unsendable_entry_is_dropped_without_blocking_the_queue(make_consumer, make_producer):
    consumer = make_consumer()
    producer = make_producer()
    producer.insert("bad", [1], [torch.zeros(2, dtype=torch.complex64)], None, consumer.address)  # tcp lacks it
    producer.insert("good", [2], [torch.ones(2)], None, consumer.address)
    assert torch.equal(consumer.drop_select("good", [2], timeout=5.0).kv_tensors[0], torch.ones(2))
    wait_until(lambda: producer.stats().sent == 1, timeout=5.0)  # the sender counts after send() returns
    stats = producer.stats()
    assert (stats.rejected, stats.sent, stats.entries, stats.bytes) == (1, 1, 0, 0)
    assert consumer.stats().connections == 1  # the pipe was kept


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_two_producers_feed_one_consumer(make_consumer, spawn_producer):
    consumer = make_consumer()
    procs = [
        spawn_producer([consumer.address], source_port=1001, first=0, count=30),
        spawn_producer([consumer.address], source_port=1002, first=1000, count=30),
    ]
    for i in [*range(30), *range(1000, 1030)]:
        assert_entry(lookup(consumer, i), i)
    assert [producer_stats(proc)["sent"] for proc in procs] == [30, 30]
    stats = consumer.stats()
    assert (stats.received, stats.hits, stats.entries) == (60, 60, 0)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_one_producer_feeds_two_consumers(make_consumer, spawn_producer):
    consumers = [make_consumer(), make_consumer()]
    proc = spawn_producer([c.address for c in consumers], source_port=1001, count=40)
    assert producer_stats(proc)["sent"] == 40
    # Sent means handed to the socket: wait until all 40 are in, then no consumer has a stray.
    wait_until(lambda: sum(c.stats().received for c in consumers) == 40, timeout=5.0)
    for k, consumer in enumerate(consumers):
        assert consumer.stats().received == 20
        for i in range(k, 40, 2):  # entry i is addressed to consumer i % 2
            assert_entry(lookup(consumer, i, timeout=1.0), i)
        assert consumer.stats().entries == 0


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_producer_killed_mid_transfer(make_consumer, make_producer, spawn_producer):
    consumer = make_consumer()
    big = 1 << 21  # 8 MB per entry, streamed until the kill: the kill lands mid-message
    victim_source = ("127.0.0.1", 1001)
    victim = spawn_producer([consumer.address], source_port=1001, count=0, big_floats=big, buffer_bytes=32 << 20)
    for i in range(3):  # the stream is flowing
        assert_entry(lookup(consumer, i, source=victim_source), i, big)

    outcome: dict[str, BaseException] = {}
    waited: dict[str, float] = {}

    def claim_stream() -> None:  # claims the stream as it comes, so memory stays bounded
        try:
            for i in range(3, 10**6):
                lookup(consumer, i, timeout=2.0, source=victim_source)
        except BaseException:  # noqa: BLE001  ends when the consumer is closed under it
            pass

    def expect_error(name: str, request_id: str, timeout: float, **kwargs) -> None:
        start = time.monotonic()
        try:
            consumer.drop_select(request_id, [1], timeout, **kwargs)
        except BaseException as e:  # noqa: BLE001  the test asserts on it
            outcome[name] = e
        waited[name] = time.monotonic() - start

    threads = [
        threading.Thread(target=claim_stream),
        # Names the victim as its source: fails as soon as the victim's connection breaks.
        threading.Thread(target=expect_error, args=("sourced", "never-1", 20.0), kwargs={"source": victim_source}),
        # Names no source: ends at its own timeout.
        threading.Thread(target=expect_error, args=("plain", "never-2", 1.0)),
    ]
    for t in threads:
        t.start()
    time.sleep(0.3)
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    threads[1].join(timeout=5.0)
    assert isinstance(outcome.get("sourced"), ProducerLost), outcome
    assert time.monotonic() - killed < 2.0, "lookup waited for its timeout instead of failing fast"
    assert "127.0.0.1:1001" in str(outcome["sourced"])
    threads[2].join()
    assert isinstance(outcome["plain"], LookupTimeout)
    assert 1.0 <= waited["plain"] < 2.0
    threads[0].join()

    assert consumer.stats().connections == 0  # the victim's pipe was dropped

    other = make_producer()  # the consumer still accepts and serves other producers
    for i in range(5000, 5020):
        other.insert(f"req-{i}", *make_request(i), consumer.address)
    for i in range(5000, 5020):
        assert_entry(lookup(consumer, i), i)


def reset_peak_rss() -> int:
    """Reset this process's peak resident set (Linux) and return the current one, in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    return _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_expected_kv_lands_in_its_views_with_no_buffer_of_its_own(make_consumer, spawn_producer):
    """An entry the consumer expects is received straight into the views it named (blocks spread
    over a cache-like tensor): the process's peak memory grows by far less than the KV, where the
    same entry not expected grows it by all of it."""
    big = 16 << 20  # floats: 64 MiB
    block = 1 << 16
    cache = torch.full((2 * big // block, block), -1.0)  # written: its pages are resident already
    blocks = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(0))[: big // block]
    consumer = make_consumer()
    _, kv, _ = make_request(0)
    consumer.expect("req-0", [torch.empty_like(t) for t in kv] + [[cache[b] for b in blocks.tolist()]])
    growth = {}
    for i in (0, 1):  # one producer process each, so that one entry's bytes never overlap the other's
        base = reset_peak_rss()
        proc = spawn_producer([consumer.address], unused_port(), count=1, first=i, big_floats=big,
                              buffer_bytes=4 * big + (1 << 20))
        entry = lookup(consumer, i)
        growth[i] = peak_rss() - base
        producer_stats(proc)
        assert entry.in_place == (i == 0)
    assert consumer.stats().received_in_place == 1
    assert torch.equal(cache[blocks], torch.ones(len(blocks), block))
    assert int((cache == -1).sum()) == cache.numel() - big  # nothing landed outside the views
    assert growth[0] < big  # a quarter of the KV's 4 * big bytes: sockets, allocator slack
    assert growth[1] > 3 * big, growth  # the same measure sees a buffer of its own


@pytest.mark.timeout(30)
def test_a_receive_cut_by_discard_loses_no_other_request_of_its_producer(make_consumer, make_producer):
    """A request discarded while its KV lands in its views (its client went away): the cut connection is
    not its producer's loss. Another request's lookup from that producer, waiting meanwhile (as a decode
    node's waits through the prefill), gets its entry on the producer's next connection."""
    consumer, producer = make_consumer(), make_producer()
    kv = layer_kv()
    cache = torch.zeros(4, 2, 8, 2, 3)
    consumer.expect("gone", [[cache[layer, k, 0:5].reshape(-1) for layer in range(4) for k in (0, 1)]])
    producer.open("gone", [1], [(0, 1), (1, 4)], kv.shape[2], kv.nbytes, consumer.address)
    producer.put("gone", 0, 1, kv[0:1].clone())
    wait_until(lambda: torch.equal(cache[0, :, :5], kv[0]), 5)  # its receive is in progress
    answers = {}
    other = threading.Thread(target=lambda: answers.update(
        other=consumer.drop_select("other", [2], 10.0, source=producer.source)))
    other.start()
    assert consumer.discard("gone") is False
    producer.put("gone", 1, 4, kv[1:4].clone())  # the rest goes on the next connection, and is dropped there
    producer.insert("other", [2], [torch.ones(2)], None, consumer.address)
    other.join(10)
    assert torch.equal(answers["other"].kv_tensors[0], torch.ones(2))
    assert consumer.stats().producer_losses == 0


@pytest.mark.timeout(30)
def test_an_idle_close_said_with_a_bye_loses_no_lookup_of_its_producer(make_consumer, make_producer):
    """A producer closes a connection it had nothing to send on, and says so: a lookup naming it that
    waits meanwhile (a decode node's waits through the prefill, before the entry is opened) goes on, and
    gets its entry on the producer's next connection."""
    consumer, producer = make_consumer(), make_producer(idle_sender_s=0.3)
    producer.insert("first", [1], [torch.ones(2)], None, consumer.address)
    consumer.drop_select("first", [1], timeout=5)
    answers = {}
    later = threading.Thread(target=lambda: answers.update(
        later=consumer.drop_select("later", [2], 10.0, source=producer.source)))
    later.start()
    wait_until(lambda: sender_threads() == [] and consumer.stats().connections == 0, 5)  # closed, idle
    producer.insert("later", [2], [torch.ones(3)], None, consumer.address)
    later.join(10)
    assert torch.equal(answers["later"].kv_tensors[0], torch.ones(3))
    assert consumer.stats().producer_losses == 0


@pytest.mark.timeout(30)
def test_discard_cuts_off_a_receive_into_views_before_it_returns(make_consumer):
    """A producer that stalls mid-KV: discard closes its connection and returns at once, and the
    receiver has let go of the views by then (so the decode node may give the blocks back)."""
    consumer = make_consumer()
    views = [torch.zeros(1024) for _ in range(4)]
    consumer.expect("r", [views])
    config = PipeConfig(timeout=10)
    sock = sockets.connect_socket(config, *consumer.address)
    pipe = tcp.TcpPipe(sock, config)
    pipe.send(encode_hello(Hello(("127.0.0.1", unused_port()))))
    header = encode_entry(KVEntry("r", token_digest([1]), [torch.ones(4096)]))
    pipe.send(header)
    sock.sendall(wire.encode(wire.Kind.TENSORS, [wire.TensorMeta(torch.float32, (4096,))]))
    sock.sendall(torch.ones(1500).numpy().tobytes())  # the first view and some of the second, then silence
    wait_until(lambda: bool(views[1][0] == 1), 10)
    start = time.monotonic()
    assert consumer.discard("r") is False
    assert time.monotonic() - start < 2  # not the pipe timeout
    assert "r" not in consumer._filling  # private, but it is the promise: nobody writes into the views now
    wait_until(lambda: consumer.stats().connections == 0, 5)
    with pytest.raises(LookupDiscarded):
        consumer.drop_select("r", [1], timeout=1)
    sock.close()


def layer_kv(num_layers: int = 4, tokens: int = 5) -> torch.Tensor:
    return torch.randn(num_layers, 2, tokens, 2, 3)


@pytest.mark.timeout(30)
def test_layer_parts_travel_as_they_are_put(make_consumer, make_producer):
    """An opened entry's parts are sent one by one as they come (layer 0's KV is in the decode
    node's views while later layers are still to be put), into the views when expected, else
    joined into one tensor; an entry whose first part has not come does not hold up those behind it."""
    consumer, producer = make_consumer(), make_producer()
    kv = layer_kv()
    cache = torch.zeros(4, 2, 8, 2, 3)
    views = [cache[layer, k, row:row + rows] for layer in range(4) for k in (0, 1) for row, rows in ((3, 2), (0, 3))]
    consumer.expect("in-place", [views])
    groups = [(0, 1), (1, 3), (3, 4)]
    for request_id in ("in-place", "buffered"):
        producer.open(request_id, [1, 2], groups, kv.shape[2], kv.nbytes, consumer.address)
    producer.insert("whole", [3], [torch.ones(3)], None, consumer.address)
    assert torch.equal(consumer.drop_select("whole", [3], timeout=5).kv_tensors[0], torch.ones(3))
    producer.put("in-place", 0, 1, kv[0:1].clone())
    wait_until(lambda: torch.equal(cache[0, 0, 3:5], kv[0, 0, :2]), 5)
    assert consumer.stats().received == 1  # the entry is not complete yet
    with pytest.raises(ValueError, match="layers \\[1, 3\\] come next"):
        producer.put("in-place", 3, 4, kv[3:4].clone())
    for request_id in ("in-place", "buffered"):
        for first, end in groups[request_id == "in-place":]:
            producer.put(request_id, first, end, kv[first:end].clone())
    entry = consumer.drop_select("in-place", [1, 2], timeout=5)
    assert entry.in_place
    assert torch.equal(torch.cat([cache[:, :, 3:5], cache[:, :, 0:3]], dim=2), kv)
    entry = consumer.drop_select("buffered", [1, 2], timeout=5)
    assert not entry.in_place and torch.equal(entry.kv_tensors[0], kv)
    wait_until(lambda: producer.stats().sent == 3, 5)
    assert (producer.stats().entries, producer.stats().bytes) == (0, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pipe", ["tcp", "torch_dist"])
def test_layer_parts_land_in_the_rows_of_a_cache(pipe):
    """A decode node's reserved blocks as a RowScatter (the cache rows of the request's tokens, blocks
    out of order): a layer-wise entry computed in two chunks lands in exactly those rows, over a
    socket pipe (written where they land) and torch_dist (received, then one indexed copy a part)."""
    consumer = LookupBufferConsumer(pipe, PipeConfig(kv_port=0))
    producer = LookupBufferProducer(pipe, PipeConfig(kv_port=0), 1 << 20, 30.0, 5.0)
    try:
        kv, groups = layer_kv(tokens=7), [(0, 1), (1, 4)]
        cache = torch.zeros(4, 2, 16, 2, 3)
        rows = torch.tensor([9, 10, 11, 4, 5, 14, 15])  # blocks of 2 rows: 4 (half), 5 (half), 2, 7
        consumer.expect("r", [RowScatter(cache, rows)])
        producer.open("r", [1], groups, 7, kv.nbytes, consumer.address)
        for start, stop in ((0, 3), (3, 7)):
            for first, end in groups:
                producer.put("r", first, end, kv[first:end, :, start:stop].clone())
        entry = consumer.drop_select("r", [1], timeout=20)
        assert entry.in_place and entry.nbytes == kv.nbytes
        assert torch.equal(cache[:, :, rows], kv)
        others = torch.ones(16, dtype=torch.bool)
        others[rows] = False
        assert not cache[:, :, others].any()  # nothing landed outside its rows
    finally:
        producer.close()
        consumer.close()


@pytest.mark.timeout(30)
def test_a_prompt_still_computing_holds_up_no_entry_that_is_ready(make_consumer, make_producer):
    """An entry on the wire whose next chunk is still being computed is withdrawn between two chunks
    when an entry whose KV is all there waits for the connection: that one arrives at once, and the
    withdrawn one comes again, from its start, into the same views, once its prefill goes on. Its ttl
    runs from its latest part: a prefill longer than the ttl does not expire it."""
    consumer, producer = make_consumer(), make_producer(ttl=1.0)
    kv, groups = layer_kv(tokens=7), [(0, 1), (1, 4)]
    cache = torch.zeros(4, 2, 8, 2, 3)
    consumer.expect("computing", [[cache[layer, k, 0:7].reshape(-1) for layer in range(4) for k in (0, 1)]])
    producer.open("computing", [1], groups, 7, kv.nbytes, consumer.address)
    for first, end in groups:
        producer.put("computing", first, end, kv[first:end, :, :3].clone())
    wait_until(lambda: torch.equal(cache[:, :, :3], kv[:, :, :3]), 5)  # its first chunk is in the views
    producer.insert("ready", [2], [torch.ones(3)], None, consumer.address)
    assert torch.equal(consumer.drop_select("ready", [2], timeout=3).kv_tensors[0], torch.ones(3))
    for start, stop in ((3, 4), (4, 7)):
        time.sleep(0.6)  # 1.2 s in all since its first part, more than its ttl
        for first, end in groups:
            producer.put("computing", first, end, kv[first:end, :, start:stop].clone())
    entry = consumer.drop_select("computing", [1], timeout=5)
    assert entry.in_place and torch.equal(cache[:, :, :7], kv)
    wait_until(lambda: producer.stats().entries == 0, 5)
    assert (producer.stats().sent, producer.stats().expiries, consumer.stats().cancelled) == (2, 0, 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("at_once", [True, False], ids=["sent-by-put", "pipe-busy"])
def test_the_first_token_follows_the_kv_and_completes_the_entry(make_consumer, make_producer, monkeypatch, at_once):
    """An entry opened to carry its prompt's first token is not in hand until the token has followed its KV
    (a prompt computed in two chunks, in place); it is not withdrawn while the token is awaited, though a
    ready entry waits behind it. One whose prefill fails after its KV but before its token is cancelled.
    The token's way from its put to the pipe is timed, apart from the KV's sends. Its sender waiting for it,
    the token is sent by put_first_token's caller (the engine thread) when the pipe takes it without
    blocking, else by the sender thread."""
    if not at_once:
        monkeypatch.setattr(tcp.TcpPipe, "_takes_at_once", lambda self: False)
    token_sends = []
    consumer = make_consumer()
    producer = make_producer(on_first_token_sent=lambda s: token_sends.append((s, threading.current_thread())))
    kv, groups = layer_kv(tokens=7), [(0, 1), (1, 4)]
    cache = torch.zeros(4, 2, 8, 2, 3)
    consumer.expect("first", [[cache[layer, k, 0:7].reshape(-1) for layer in range(4) for k in (0, 1)]])
    producer.open("first", [1], groups, 7, kv.nbytes, consumer.address, first_token=True)
    with pytest.raises(ValueError, match="takes no first token now"):
        producer.put_first_token("first", FirstToken(5))  # its KV is not all put
    for start, stop in ((0, 3), (3, 7)):
        for first, end in groups:
            producer.put("first", first, end, kv[first:end, :, start:stop].clone())
    wait_until(lambda: torch.equal(cache[:, :, :7], kv), 5)
    producer.insert("ready", [2], [torch.ones(3)], None, consumer.address)
    with pytest.raises(LookupTimeout):  # all of its KV is there, its first token is not
        consumer.drop_select("first", [1], timeout=0.3)
    assert producer.stats().entries == 2  # "ready" waits behind it: its token comes in a moment
    top = [(5, -0.25), (9, -1.5)]
    assert producer.put_first_token("first", FirstToken(5, -0.25, top))
    entry = consumer.drop_select("first", [1], timeout=5)
    assert entry.in_place and entry.first_token == FirstToken(5, -0.25, top)
    wait_until(lambda: token_sends, 5)  # timed once its send has returned
    assert len(token_sends) == 1 and 0 <= token_sends[0][0] < 5
    sender = token_sends[0][1]
    assert (sender is threading.current_thread()) == at_once, sender.name
    assert torch.equal(consumer.drop_select("ready", [2], timeout=5).kv_tensors[0], torch.ones(3))

    producer.open("failed", [3], groups, 7, kv.nbytes, consumer.address, first_token=True)
    for first, end in groups:
        producer.put("failed", first, end, kv[first:end].clone())
    time.sleep(0.2)  # its KV is on its way
    producer.abort("failed")  # sampling its first token failed
    with pytest.raises(EntryCancelled):
        consumer.drop_select("failed", [3], timeout=5, source=producer.source)
    assert not producer.put_first_token("failed", FirstToken(5))  # too late: dropped
    wait_until(lambda: producer.stats().entries == 0, 5)
    assert (producer.stats().sent, producer.stats().aborts, consumer.stats().cancelled) == (2, 1, 1)


@pytest.mark.timeout(30)
def test_a_first_token_whose_send_failed_after_an_abort_is_dropped(make_consumer, make_producer, monkeypatch):
    """The engine thread's send of the first token fails just as the request is aborted (its client went
    away): the token is dropped, not handed to the sender, which cancels the entry on the wire."""
    consumer, producer = make_consumer(), make_producer()
    kv, groups = layer_kv(tokens=3), [(0, 2), (2, 4)]
    producer.open("gone", [1], groups, 3, kv.nbytes, consumer.address, first_token=True)
    for first, end in groups:
        producer.put("gone", first, end, kv[first:end].clone())
    wait_until(lambda: consumer.stats().connections == 1, 5)
    time.sleep(0.3)  # its KV is sent: the sender waits for the token

    def aborted_then_cut(pipe, tensors):
        assert not producer.abort("gone")  # on the wire: marked aborted, dropped by its sender
        raise PipeError("cut off")

    monkeypatch.setattr(tcp.TcpPipe, "send_at_once", aborted_then_cut)
    assert not producer.put_first_token("gone", FirstToken(5))
    with pytest.raises(EntryCancelled):
        consumer.drop_select("gone", [1], timeout=5, source=producer.source)
    wait_until(lambda: producer.stats().entries == 0, 5)
    assert (producer.stats().aborts, consumer.stats().cancelled) == (1, 1)


@pytest.mark.timeout(30)
def test_an_entry_whose_parts_stop_coming_ends_alone(make_consumer, make_producer):
    """The prefill failed after its first layers were sent: aborting the entry cancels it on the wire
    (a None message in place of its next part). Its lookup fails at once; another request's lookup
    naming the same producer goes on and is answered on the same connection."""
    consumer, producer = make_consumer(), make_producer()
    kv = layer_kv()
    producer.open("failed", [1], [(0, 2), (2, 4)], kv.shape[2], kv.nbytes, consumer.address)
    assert producer.put("failed", 0, 2, kv[0:2].clone())
    wait_until(lambda: consumer.stats().connections == 1, 5)
    answers = {}
    other = threading.Thread(target=lambda: answers.update(
        other=consumer.drop_select("other", [2], 10.0, source=producer.source)))
    other.start()
    time.sleep(0.2)  # the first part is on its way
    start = time.monotonic()
    producer.abort("failed")
    with pytest.raises(EntryCancelled):
        consumer.drop_select("failed", [1], timeout=10, source=producer.source)
    assert time.monotonic() - start < 3
    assert not producer.put("failed", 2, 4, kv[2:4].clone())  # too late: dropped
    producer.insert("other", [2], [torch.ones(2)], None, consumer.address)
    other.join(10)
    assert torch.equal(answers["other"].kv_tensors[0], torch.ones(2))
    wait_until(lambda: producer.stats().entries == 0, 5)
    stats = producer.stats()
    assert (stats.aborts, stats.bytes, stats.sent) == (1, 0, 1)
    assert (consumer.stats().connections, consumer.stats().cancelled) == (1, 1)


@pytest.mark.timeout(30)
def test_a_layer_wise_entry_beyond_the_buffer_is_refused_before_it_is_allocated(make_consumer, caplog):
    """Each part passes the message limit, but their sum is checked against kv_buffer_size at the
    first part, before the whole tensor is allocated: a peer claiming 1,024 layers of 2 MiB each
    (the first part holding a chunk of half its tokens) loses its connection, and the consumer
    holds nothing."""
    consumer = make_consumer()
    config = PipeConfig(timeout=10)
    pipe = tcp.TcpPipe(sockets.connect_socket(config, *consumer.address), config)
    pipe.send(encode_hello(Hello(("127.0.0.1", unused_port()))))
    entry = KVEntry("big", token_digest([1]), [], layers=[(0, 1), (1, 1024)], tokens=1 << 15, chunk=1 << 14)
    pipe.send(encode_entry(entry))
    pipe.send([torch.zeros(1, 2, 1 << 14, 2, 4)])  # layer 0's first chunk: 1 MiB, so 2 GiB in all
    wait_until(lambda: "an entry of 2147483648 bytes of KV; kv_buffer_size is" in caplog.text, 10)
    stats = consumer.stats()
    assert (stats.connections, stats.received, stats.entries, stats.bytes) == (0, 0, 0, 0)
    pipe.close()


@pytest.mark.timeout(30)
def test_a_prompt_computed_in_chunks_travels_chunk_by_chunk(make_consumer, make_producer):
    """Each chunk's layer groups travel as they are put: straight into the token share of the views
    when expected (the first chunk's KV is in the blocks before the second is put), else assembled;
    a put that breaks the chunk's size or overruns the entry's tokens is refused."""
    consumer, producer = make_consumer(), make_producer()
    kv = layer_kv(tokens=7)
    cache = torch.zeros(4, 2, 8, 2, 3)
    # Flat views, as a KV cache's: per layer K then V, rows [5, 7) of the cache for tokens 0-1, [0, 5) for 2-6.
    views = [cache[layer, k, row:row + rows].reshape(-1) for layer in range(4) for k in (0, 1)
             for row, rows in ((5, 2), (0, 5))]
    consumer.expect("in-place", [views])
    groups = [(0, 1), (1, 4)]
    for request_id in ("in-place", "buffered"):
        producer.open(request_id, [1, 2], groups, 7, kv.nbytes, consumer.address)
        for first, end in groups:
            producer.put(request_id, first, end, kv[first:end, :, :3].clone())
    wait_until(lambda: torch.equal(cache[:, :, 5:7], kv[:, :, :2]) and torch.equal(cache[:, :, 0:1], kv[:, :, 2:3]), 5)
    producer.open("bad", [3], groups, 7, kv.nbytes, consumer.address)
    producer.put("bad", 0, 1, kv[0:1, :, :1].clone())
    with pytest.raises(ValueError, match="put of 2 tokens for 'bad' in a chunk of 1"):
        producer.put("bad", 1, 4, kv[1:4, :, :2].clone())
    producer.put("bad", 1, 4, kv[1:4, :, :1].clone())
    with pytest.raises(ValueError, match="put of 7 tokens for 'bad'; 6 are left"):
        producer.put("bad", 0, 1, kv[0:1].clone())
    producer.abort("bad")
    for request_id in ("in-place", "buffered"):
        for start, stop in ((3, 4), (4, 7)):
            for first, end in groups:
                producer.put(request_id, first, end, kv[first:end, :, start:stop].clone())
    entry = consumer.drop_select("in-place", [1, 2], timeout=5)
    assert entry.in_place and torch.equal(torch.cat([cache[:, :, 5:7], cache[:, :, 0:5]], dim=2), kv)
    entry = consumer.drop_select("buffered", [1, 2], timeout=5)
    assert not entry.in_place and torch.equal(entry.kv_tensors[0], kv)
    wait_until(lambda: (producer.stats().entries, producer.stats().bytes) == (0, 0), 5)


@pytest.mark.timeout(60)
def test_async_lookups_wait_on_the_event_loop_without_threads(make_consumer, make_producer, monkeypatch):
    """64 lookups wait at once on one event loop (more than a default thread pool's threads here),
    holding no thread; entries arriving in reverse order answer each at once, each waking its own
    lookup alone (not all that wait: under load that was a turn of the event loop per lookup per
    arrival); a discard and a timeout end theirs as drop_select's would."""
    consumer, producer = make_consumer(), make_producer()
    n = 64
    wakes = []
    real_set_done = consumer_module._set_done
    monkeypatch.setattr(consumer_module, "_set_done", lambda future: wakes.append(future) or real_set_done(future))

    async def scenario():
        threads = threading.active_count()
        tasks = [asyncio.create_task(consumer.drop_select_async(f"r{i}", [i], 20.0)) for i in range(n)]
        discarded = asyncio.create_task(consumer.drop_select_async("gone", [1], 20.0))
        start = time.monotonic()
        with pytest.raises(LookupTimeout):
            await consumer.drop_select_async("never", [1], 0.3)
        assert 0.3 <= time.monotonic() - start < 2
        assert threading.active_count() <= threads  # the waits took no thread
        await asyncio.to_thread(consumer.discard, "gone")
        with pytest.raises(LookupDiscarded):
            await discarded
        for i in reversed(range(n)):
            producer.insert(f"r{i}", [i], [torch.full((4,), float(i))], None, consumer.address)
        return await asyncio.gather(*tasks)

    entries = asyncio.run(scenario())
    assert [int(e.kv_tensors[0][0]) for e in entries] == list(range(n))
    stats = consumer.stats()
    assert (stats.hits, stats.timeouts, stats.entries) == (n, 1, 0)
    assert len(wakes) <= n + 1  # one an arrival, one the discard: with every lookup woken, ~n * n / 2


@pytest.mark.timeout(30)
def test_an_opened_entry_waits_for_its_prefill_beyond_the_ttl(make_consumer, make_producer):
    """buffer_ttl bounds how long sent-to-be KV waits for its consumer, not how long the prefill
    computing it takes: it runs from the first part."""
    consumer, producer = make_consumer(), make_producer(ttl=0.5)
    kv = layer_kv()
    producer.open("slow", [1], [(0, 4)], kv.shape[2], kv.nbytes, consumer.address)
    time.sleep(1.0)  # a long prefill
    assert producer.stats().expiries == 0
    assert producer.put("slow", 0, 4, kv.clone())
    assert torch.equal(consumer.drop_select("slow", [1], timeout=5).kv_tensors[0], kv)
