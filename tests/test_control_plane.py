"""The control plane over real gRPC on loopback: a PrefillNode running a tiny random Llama behind
start_grpc_server, and the decode node's PrefillClient / PrefillPool talking to it."""

import asyncio
import contextlib
import dataclasses
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path

import grpc
import pytest
from conftest import write_tiny_llama
from grpc_health.v1 import health_pb2, health_pb2_grpc
from servers import wait_for

from disagg.config import KVTransferConfig
from disagg.control_plane import COMPATIBILITY_FIELDS, KVRank, NodeInfo, NodeLoad, PrefillCall
from disagg.decode_node.prefill_client import (
    PrefillAuthError,
    PrefillClient,
    PrefillFailed,
    PrefillNodeBusy,
    PrefillNodeMismatch,
    PrefillNodeUnavailable,
    PrefillPool,
)
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.block_hash import prompt_block_hashes
from disagg.engine.config import EngineConfig
from disagg.engine.engine import LLMEngine
from disagg.engine.sampling_params import SamplingParams, StructuredOutputSpec
from disagg.engine.sequence import Sequence
from disagg.lookup_buffer import (
    FirstToken,
    LookupBufferConsumer,
    LookupBufferProducer,
)
from disagg.pipes import PipeConfig
from disagg.prefill_node.node import PrefillNode
from disagg.prefill_node.service import PrefillGrpcServer, start_grpc_server
from disagg.proto import SERVICE_NAME, convert, generate
from disagg.proto import disagg_pb2 as pb
from disagg.serving import node_info

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "s3cret-of-16-bytes+"  # auth tokens are at least 16 bytes
PROMPT = list(range(1000, 1040))  # 40 tokens: two full 16-token blocks for the prefix cache


def run(coro: Coroutine, timeout: float = 20.0):
    """Each test is one event loop; the engine thread behind the node serves any loop."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[AsyncEngine]:
    tiny = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), model_dir)
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny), device="cpu")))
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def make_node(engine: AsyncEngine, consumer: LookupBufferConsumer) -> Iterator[Callable[..., PrefillNode]]:
    """make_node(kv_buffer_size=...) -> a PrefillNode on the shared engine, as run_prefill_node builds
    it, with the test's decode endpoint (`consumer`) registered as its Info handshake would."""
    producers = []

    def make(kv_buffer_size: int = 10**8) -> PrefillNode:
        kv = KVTransferConfig(kv_role="producer", kv_port=14600, kv_connector_extra_config={"auth_token": TOKEN})
        producer = LookupBufferProducer(kv.kv_connector, PipeConfig(kv.kv_ip, kv.kv_port, TOKEN, 5.0),
                                        kv_buffer_size, ttl=10.0, insert_timeout=0.5)
        producers.append(producer)
        node = PrefillNode(engine, producer, node_info(engine, "tiny-llama", kv))
        node.register(consumer.address, "127.0.0.1")
        return node

    yield make
    for producer in producers:
        producer.close()


@pytest.fixture(scope="module")
def node(make_node: Callable[..., PrefillNode]) -> PrefillNode:
    return make_node()


@pytest.fixture(scope="module")
def consumer() -> Iterator[LookupBufferConsumer]:
    """The decode side's pipe endpoint: where prefill calls send their KV."""
    consumer = LookupBufferConsumer("tcp", PipeConfig("127.0.0.1", 0, TOKEN, 5.0))
    yield consumer
    consumer.close()


def address(server: PrefillGrpcServer) -> str:
    return f"127.0.0.1:{server.port}"


def prefill_call(request_id: str, consumer: LookupBufferConsumer, **params) -> PrefillCall:
    return PrefillCall(request_id, PROMPT, SamplingParams(temperature=0.0, **params), consumer.address)


async def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout}s")
        await asyncio.sleep(0.05)


# --- generated stubs ---------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_stubs_are_fresh():
    result = subprocess.run([sys.executable, "-m", "disagg.proto.generate", "--check"], check=False, cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.timeout(60)
def test_check_notices_a_changed_proto(tmp_path: Path, capsys: pytest.CaptureFixture):
    changed = tmp_path / "disagg.proto"
    shutil.copy(ROOT / "proto" / "disagg.proto", changed)
    changed.write_text(changed.read_text().replace("message AbortRequest {",
                                                   "message AbortRequest {\n  string why = 9;"))
    assert generate.main(["--check", "--proto", str(changed)]) == 1
    message = capsys.readouterr().err
    assert "disagg_pb2.py" in message and "python -m disagg.proto.generate" in message


def test_the_grammar_crosses_the_grpc_boundary():
    """The prefill node samples the first token: it gets the structured-output spec, with where the
    grammar starts (after a reasoning's end), and nothing for a request without one."""
    spec = StructuredOutputSpec("regex", "[0-9]{3}")
    for structured in (spec, StructuredOutputSpec("regex", "[0-9]{3}", (9617, 17400, 46)), None):
        call = PrefillCall("r1", [1, 2, 3], SamplingParams(temperature=0.0, structured=structured), ("127.0.0.1", 9))
        wire = pb.PrefillRequest.FromString(convert.prefill_call_to_proto(call).SerializeToString())
        assert convert.prefill_call_from_proto(wire).params.structured == structured


def test_the_decode_ranks_cross_the_grpc_boundary_rank_0_first():
    ranks = [KVRank(("127.0.0.1", 9), (0, 1)), KVRank(("127.0.0.1", 10), (1, 3))]
    call = PrefillCall("r1", [1, 2, 3], SamplingParams(), ("127.0.0.1", 9), kv_ranks=ranks)
    wire = pb.PrefillRequest.FromString(convert.prefill_call_to_proto(call).SerializeToString())
    assert convert.prefill_call_from_proto(wire).kv_ranks == ranks
    wire.kv_dest_port = 11  # rank 0's endpoint must be kv_dest, which the caller aborts by
    with pytest.raises(ValueError, match="kv_ranks must start with kv_dest's"):
        convert.prefill_call_from_proto(wire)


def test_a_prefill_node_s_rank_heads_cross_the_grpc_boundary():
    info = NodeInfo("m", "float32", 2, 3, 4, 16, "tcp", "127.0.0.1", 9, kv_rank_heads=[(0, 1), (1, 3)])
    wire = pb.NodeInfo.FromString(convert.node_info_to_proto(info).SerializeToString())
    assert convert.node_info_from_proto(wire) == info


# --- prefill through gRPC ----------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_prefill_runs_the_engine_and_the_kv_reaches_the_consumer(node: PrefillNode, consumer: LookupBufferConsumer):
    async def scenario():
        server = await start_grpc_server(node, "127.0.0.1", 0, TOKEN)
        client = PrefillClient(address(server), TOKEN)
        try:
            peer = await client.connect(node.info, timeout=5)
            assert peer == node.info and client.healthy
            result = await client.prefill(prefill_call("greedy-1", consumer, logprobs=2), idle_timeout=10)
            assert client.outstanding == 0
            entry = await asyncio.to_thread(consumer.drop_select, "greedy-1", PROMPT, 10.0)
            again = await client.prefill(prefill_call("greedy-2", consumer), idle_timeout=10)
            again_entry = await asyncio.to_thread(consumer.drop_select, "greedy-2", PROMPT, 10.0)
            return (result, entry), (again, again_entry)
        finally:
            await client.close()
            await server.stop(0)

    (result, entry), (again, again_entry) = run(scenario())
    assert result.kv_bytes == entry.nbytes > 0
    [kv] = entry.kv_tensors
    assert kv.shape[:3] == (node.info.num_layers, 2, len(PROMPT))
    # Greedy: the first token, behind the KV, is the most likely one, with its logprob and the top 2.
    first = entry.first_token
    assert first is not None and first.logprob is not None and len(first.top) == 2
    assert first.top[0] == (first.token_id, pytest.approx(first.logprob))
    # The same prompt again: the same token, mostly from the prefix cache, and no logprobs asked.
    assert again_entry.first_token == FirstToken(first.token_id)
    assert again.num_cached_tokens > 0


def hostile_calls(consumer: LookupBufferConsumer) -> list[PrefillCall]:
    """Calls a decode node would not send: a prompt longer than the context, and sampling fields out of
    range (set after SamplingParams checked them), as another gRPC client could send them."""
    too_long = PrefillCall("too-long", list(range(3000)), SamplingParams(temperature=0.0), consumer.address)
    calls = [too_long]
    for name, value in [("temperature", 1e-300), ("seed", -1), ("top_k", -5)]:
        call = prefill_call(f"bad-{name}", consumer)
        setattr(call.params, name, value)
        calls.append(call)
    return calls


async def refusal(client: PrefillClient, call: PrefillCall) -> PrefillFailed:
    with pytest.raises(PrefillFailed) as refused:
        await client.prefill(call, idle_timeout=10)
    return refused.value


@pytest.mark.timeout(60)
def test_prefill_errors_map_to_status_codes(node: PrefillNode, make_node: Callable[..., PrefillNode],
                                           consumer: LookupBufferConsumer):
    small = make_node(kv_buffer_size=1)  # no prompt's KV fits: every insert is refused

    async def scenario():
        server = await start_grpc_server(node, "127.0.0.1", 0, None)
        small_server = await start_grpc_server(small, "127.0.0.1", 0, None)
        client, small_client = PrefillClient(address(server), None), PrefillClient(address(small_server), None)
        try:
            bad = PrefillCall("bad-token", [1, 10**9], SamplingParams(temperature=0.0), consumer.address)
            with pytest.raises(PrefillFailed) as invalid:
                await client.prefill(bad, idle_timeout=10)
            with pytest.raises(PrefillNodeBusy) as busy:
                await small_client.prefill(prefill_call("too-big", consumer), idle_timeout=10)
            assert not await client.abort("never-sent", consumer.address)
            return invalid.value, busy.value, [await refusal(client, call) for call in hostile_calls(consumer)]
        finally:
            await client.close()
            await small_client.close()
            await server.stop(0)
            await small_server.stop(0)

    invalid, busy, refusals = run(scenario())
    assert invalid.code == grpc.StatusCode.INVALID_ARGUMENT and "token ids must be integers" in str(invalid)
    assert busy.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "kv_buffer_size" in str(busy)
    for error, words in zip(refusals, ["max_model_len", "temperature", "seed", "top_k"]):
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT and words in str(error), error


@pytest.mark.timeout(60)
def test_kv_goes_only_to_decode_nodes_registered_at_their_handshake(node: PrefillNode,
                                                                    consumer: LookupBufferConsumer):
    elsewhere = ("127.0.0.2", consumer.address[1])  # any address a caller might name
    inserts = node.producer.stats().inserts

    async def scenario():
        server = await start_grpc_server(node, "127.0.0.1", 0, None)
        client = PrefillClient(address(server), None)
        try:
            call = PrefillCall("elsewhere", PROMPT, SamplingParams(temperature=0.0), elsewhere)
            refused = await refusal(client, call)
            await client.connect(node.info, timeout=5, kv_endpoint=elsewhere)
            return refused, node.is_registered(elsewhere)
        finally:
            await client.close()
            await server.stop(0)

    refused, registered = run(scenario())
    assert refused.code == grpc.StatusCode.FAILED_PRECONDITION and "not a registered decode node" in str(refused)
    assert registered and node.producer.stats().inserts == inserts  # nothing was computed or queued for it


@pytest.mark.timeout(60)
def test_a_prefill_the_engine_fails_fails_alone(node: PrefillNode, consumer: LookupBufferConsumer, monkeypatch):
    engine = node.engine.engine
    free = engine.block_manager.num_free_blocks
    generator_for = engine.sampler.generator_for

    def failing(seq: Sequence):
        if seq.request_id == "fails":  # where a seed of 2**70 used to raise
            raise RuntimeError("injected sampling failure")
        return generator_for(seq)

    monkeypatch.setattr(engine.sampler, "generator_for", failing)

    async def scenario():
        server = await start_grpc_server(node, "127.0.0.1", 0, None)
        client = PrefillClient(address(server), None)
        try:
            fails = PrefillCall("fails", PROMPT, SamplingParams(temperature=0.8), consumer.address)
            results = await asyncio.gather(client.prefill(fails, idle_timeout=10),
                                           client.prefill(prefill_call("fine", consumer), idle_timeout=10),
                                           return_exceptions=True)
            entry = await asyncio.to_thread(consumer.drop_select, "fine", PROMPT, 10.0)
            return results, entry
        finally:
            await client.close()
            await server.stop(0)

    (failed, fine), entry = run(scenario())
    assert isinstance(failed, PrefillFailed) and failed.code == grpc.StatusCode.INTERNAL
    assert "injected sampling failure" in str(failed)
    assert fine.kv_bytes == entry.nbytes
    assert engine.block_manager.num_free_blocks == free


@pytest.mark.timeout(60)
def test_a_slow_prefill_is_waited_for_a_stuck_one_given_up_and_aborted_by_its_caller_only(
        node: PrefillNode, consumer: LookupBufferConsumer, monkeypatch):
    """prefill_timeout is a limit on silence, not on length: a prompt whose steps take longer
    in all than the timeout finishes; an engine that stops stepping is given up on, and the
    caller's cancellation aborts the request on the prefill node."""
    engine = node.engine.engine
    free = engine.block_manager.num_free_blocks
    run_batch = engine.runner.run
    unstick = threading.Event()
    step_seconds = {"value": 0.3}

    def slow_or_stuck(batch):
        if step_seconds["value"] is None:
            unstick.wait(30)
        else:
            time.sleep(step_seconds["value"])
        return run_batch(batch)

    monkeypatch.setattr(engine.runner, "run", slow_or_stuck)
    monkeypatch.setattr(engine.scheduler, "max_num_batched_tokens", 8)  # 40 new prompt tokens: 5 steps
    prompt = list(range(2000, 2040))  # not in the prefix cache

    async def scenario():
        server = await start_grpc_server(node, "127.0.0.1", 0, None)
        client = PrefillClient(address(server), None)
        try:
            start = time.monotonic()
            call = PrefillCall("slow", prompt, SamplingParams(temperature=0.0), consumer.address)
            result = await client.prefill(call, idle_timeout=1.0)
            slow_seconds = time.monotonic() - start
            entry = await asyncio.to_thread(consumer.drop_select, "slow", prompt, 10.0)
            step_seconds["value"] = None  # the engine stops stepping
            stuck_call = PrefillCall("stuck", prompt[::-1], SamplingParams(temperature=0.0), consumer.address)
            pending = asyncio.create_task(client.prefill(stuck_call, idle_timeout=1.0))
            await wait_until(lambda: "stuck" in engine.requests, 5, "the stuck prefill in the engine")
            # Another decode node (another pipe endpoint) cannot abort it.
            foreign_abort = await client.abort("stuck", ("127.0.0.1", 1))
            with pytest.raises(PrefillFailed, match="made no progress") as stuck:
                await pending
            return result, slow_seconds, entry, stuck.value, foreign_abort
        finally:
            unstick.set()
            await client.close()
            await server.stop(0)

    result, slow_seconds, entry, stuck, foreign_abort = run(scenario())
    assert slow_seconds > 1.5 and result.kv_bytes == entry.nbytes
    assert not foreign_abort
    assert stuck.code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: "stuck" not in engine.requests and engine.block_manager.num_free_blocks == free,
             10, "the stuck prefill aborted on the prefill node and its blocks freed")
    # Its last output came after the caller's event loop had closed: the engine thread lives on.
    time.sleep(0.5)
    assert node.engine.thread.is_alive()


@pytest.mark.timeout(60)
def test_a_step_longer_than_the_no_progress_limit_is_waited_for(make_node: Callable[..., PrefillNode],
                                                               consumer: LookupBufferConsumer, monkeypatch):
    """A chunk that takes longer than the caller's prefill_timeout (a 2,048-token chunk on a CPU takes
    more than 10 s) is progress while it runs within what the node expects of it: the caller no longer
    gives up on a node that is computing, and computes the prompt a second time. The node's first step
    has no expectation yet (UNMEASURED_STEP_S); the second is expected to take what the first took."""
    node = make_node()  # its own measurements, from this test's steps only
    engine = node.engine.engine
    run_batch = engine.runner.run

    def slow(batch):
        time.sleep(1.5)
        return run_batch(batch)

    monkeypatch.setattr(engine.runner, "run", slow)
    prompts = [list(range(3000, 3040)), list(range(3100, 3130))]  # one chunk each, not in the prefix cache

    async def scenario():
        server = await start_grpc_server(node, "127.0.0.1", 0, None)
        client = PrefillClient(address(server), None)
        try:
            for i, prompt in enumerate(prompts):
                call = PrefillCall(f"long-step-{i}", prompt, SamplingParams(temperature=0.0), consumer.address)
                result = await client.prefill(call, idle_timeout=1.0)
                entry = await asyncio.to_thread(consumer.drop_select, call.request_id, prompt, 10.0)
                assert result.kv_bytes == entry.nbytes and result.prefill_seconds > 1.5
        finally:
            await client.close()
            await server.stop(0)

    run(scenario())
    assert node.cost.step_seconds(30) > 1.0  # the second step's expectation came from the first


@pytest.mark.timeout(60)
def test_watch_streams_the_cache_and_the_load_and_ends_when_the_server_stops(make_node: Callable[..., PrefillNode],
                                                                            consumer: LookupBufferConsumer):
    """A client watching a prefill node sees its prefix cache (a snapshot, then what a prefill stored)
    and its load (the throughput measured from that prefill); a server that stops ends the stream at
    once (no grace spent on it), and the client's view is dropped."""
    node = make_node()  # its own measurements
    prompt = list(range(4000, 4100))  # not in the prefix cache: 6 full blocks of 16 once computed
    block_size = node.engine.block_size

    async def scenario():
        server = await start_grpc_server(node, "127.0.0.1", 0, None)
        client = PrefillClient(address(server), None)
        watching = asyncio.create_task(client.watch())
        try:
            await wait_until(lambda: client.view.live, 5, "the snapshot")
            assert client.view.matched_blocks(prompt_block_hashes(prompt, block_size)) == 0
            uncached = client.expected_seconds(prompt, {})
            call = PrefillCall("watched", prompt, SamplingParams(temperature=0.0), consumer.address)
            await client.prefill(call, idle_timeout=10)
            await asyncio.to_thread(consumer.drop_select, "watched", prompt, 10.0)
            await wait_until(lambda: client.view.matched_blocks(prompt_block_hashes(prompt, block_size)) == 6, 5,
                             "the prompt's blocks in the view")
            await wait_until(lambda: client.load.prefill_tokens_per_s > 0, 5, "the measured throughput")
            assert client.expected_seconds(prompt, {}) < uncached  # its blocks are there now
            start = time.monotonic()
            await server.stop(grace=10)
            stopped = time.monotonic() - start
            await wait_until(lambda: not client.view.live, 5, "the view dropped")
            return stopped
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
            await client.close()
            await server.stop(0)

    assert run(scenario()) < 2.0


# --- handshake and auth ------------------------------------------------------------------------

def changed(info: NodeInfo, field: str) -> NodeInfo:
    value = getattr(info, field)
    return dataclasses.replace(info, **{field: value + 1 if isinstance(value, int) else f"{value}-other"})


@pytest.mark.timeout(60)
def test_handshake_refuses_each_mismatched_field_by_name(node: PrefillNode):
    async def scenario():
        server = await start_grpc_server(node, "127.0.0.1", 0, TOKEN)
        try:
            errors = {}
            for field in COMPATIBILITY_FIELDS:
                client = PrefillClient(address(server), TOKEN)
                with pytest.raises(PrefillNodeMismatch) as refused:
                    await client.connect(changed(node.info, field), timeout=5)
                errors[field] = str(refused.value)
                assert not client.healthy and client.info is None
                await client.close()
            return errors
        finally:
            await server.stop(0)

    for field, message in run(scenario()).items():
        assert f"{field} differs" in message and "127.0.0.1:" in message


@pytest.mark.timeout(60)
def test_wrong_or_missing_token_is_refused_but_health_stays_open(node: PrefillNode):
    async def scenario():
        server = await start_grpc_server(node, "127.0.0.1", 0, TOKEN)
        try:
            errors = []
            for token in ("wrong", None):
                client = PrefillClient(address(server), token)
                with pytest.raises(PrefillAuthError) as refused:
                    await client.connect(node.info, timeout=5)
                errors.append(str(refused.value))
                assert await client.check_health(timeout=5) is None  # health checks need no token
                await client.close()
            pool = PrefillPool([address(server)], "wrong", node.info)
            with pytest.raises(PrefillAuthError):
                await pool.start(timeout=5)
            return errors
        finally:
            await server.stop(0)

    for message in run(scenario()):
        assert "127.0.0.1:" in message and "auth token (kv_connector_extra_config.auth_token)" in message


@pytest.mark.timeout(60)
def test_health_service_serves_and_turns_not_serving_on_stop(node: PrefillNode):
    async def scenario():
        server = await start_grpc_server(node, "127.0.0.1", 0, TOKEN)
        async with grpc.aio.insecure_channel(address(server)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", SERVICE_NAME):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            first = await watch.read()
            stopping = asyncio.create_task(server.stop(grace=2))
            second = await watch.read()
            watch.cancel()
            await stopping
        return first.status, second.status

    assert run(scenario()) == (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)


@pytest.mark.timeout(60)
def test_binding_a_port_in_use_names_the_port(node: PrefillNode):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}.*in use"):
            run(start_grpc_server(node, "127.0.0.1", port, None))


# --- pool --------------------------------------------------------------------------------------

def test_prefill_nodes_are_picked_by_pending_tokens_not_by_their_own_measured_speed():
    """Weighed at its own figures, a node that has measured nothing (a cautious default) or only warm-up
    prompts of a few tokens (a step's fixed cost spread over them, or a base fitted between two tiny
    sizes) loses every pick to a node measured on real prompts, and never gets one to correct it: on
    four GPUs, 2P2D ran as 1P2D that way."""
    async def scenario() -> None:
        pool = PrefillPool(["a:1", "b:2"], None, NodeInfo("m", "float32", 2, 2, 16, 16, "tcp", "127.0.0.1", 1))
        a, b = pool.clients
        for client in (a, b):
            client.mark_healthy()
        prompt = list(range(4096))
        a.load, a.calls = NodeLoad(prefill_tokens_per_s=40_000.0, step_base_seconds=0.01), 1
        assert pool.pick(prompt) is b  # nothing measured, and fewer calls made
        b.load = NodeLoad(prefill_tokens_per_s=1_600.0, step_base_seconds=0.08)  # fitted on 16- and 64-token warm-ups
        assert pool.pick(prompt) is b
        assert pool.tokens_per_s() == 40_000.0  # a remote prefill is estimated at the fastest measured
        b.load = NodeLoad(queued_prefill_tokens=8192, prefill_tokens_per_s=1_600.0)
        assert pool.pick(prompt) is a  # b is busy
        a.mark_unhealthy("test")
        assert pool.tokens_per_s() == 1_600.0  # the healthy ones' figures only
        await pool.close()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_pool_picks_the_node_with_fewest_prefills_in_flight(node: PrefillNode, consumer: LookupBufferConsumer):
    async def scenario():
        servers = [await start_grpc_server(node, "127.0.0.1", 0, TOKEN) for _ in range(2)]
        pool = PrefillPool([address(s) for s in servers], TOKEN, node.info)
        try:
            await pool.start(timeout=5)
            first = pool.pick(PROMPT)
            in_flight = asyncio.create_task(first.prefill(prefill_call("pick-1", consumer), idle_timeout=10))
            await asyncio.sleep(0)  # the call has started: it counts as outstanding
            assert first.outstanding == 1
            second = pool.pick(PROMPT)
            assert second is not first
            await asyncio.gather(in_flight, second.prefill(prefill_call("pick-2", consumer), idle_timeout=10))
            # Both idle again, and both report it (one engine behind both): ties go to the first node.
            await wait_until(lambda: first.load == second.load and first.view.hashes == second.view.hashes
                             and not first.sent_tokens and not second.sent_tokens,
                             10, "both nodes' state reported")
            assert pool.pick(PROMPT) is first
            for request_id in ("pick-1", "pick-2"):
                await asyncio.to_thread(consumer.drop_select, request_id, PROMPT, 10.0)
            return first.address, second.address
        finally:
            await pool.close()
            for server in servers:
                await server.stop(0)

    first, second = run(scenario())
    assert first != second


@pytest.mark.timeout(60)
def test_pool_avoids_a_dead_node_and_takes_it_back_when_it_returns(node: PrefillNode,
                                                                   consumer: LookupBufferConsumer):
    async def scenario():
        alive = await start_grpc_server(node, "127.0.0.1", 0, TOKEN)
        flaky = await start_grpc_server(node, "127.0.0.1", 0, TOKEN)
        pool = PrefillPool([address(flaky), address(alive)], TOKEN, node.info, health_interval=0.1)
        try:
            await pool.start(timeout=5)
            dead, live = pool.clients
            assert dead.healthy and live.healthy
            await flaky.stop(0)
            await wait_until(lambda: not dead.healthy, 5, "marked unhealthy")
            assert "health check failed" in dead.reason
            assert all(pool.pick(PROMPT) is live for _ in range(3))
            await pool.pick(PROMPT).prefill(prefill_call("while-down", consumer), idle_timeout=10)
            await asyncio.to_thread(consumer.drop_select, "while-down", PROMPT, 10.0)

            flaky = await start_grpc_server(node, "127.0.0.1", int(dead.address.rsplit(":", 1)[1]), TOKEN)
            await wait_until(lambda: dead.healthy, 10, "healthy again")
            # Once both report the same load (one engine behind both), a prompt no cache holds (the live
            # node holds PROMPT now) goes to the node that is back, which has had no calls.
            await wait_until(lambda: dead.view.live and dead.load == live.load and not live.sent_tokens, 10,
                             "both nodes' state reported")
            assert dead.info == node.info and pool.pick(list(range(5000, 5040))) is dead
        finally:
            await pool.close()
            await alive.stop(0)
            await flaky.stop(0)

    run(scenario())


@pytest.mark.timeout(60)
def test_a_failed_call_marks_the_node_unhealthy_at_once(node: PrefillNode, consumer: LookupBufferConsumer):
    async def scenario():
        server = await start_grpc_server(node, "127.0.0.1", 0, TOKEN)
        pool = PrefillPool([address(server)], TOKEN, node.info, health_interval=60)  # no check in time
        try:
            await pool.start(timeout=5)
            client = pool.pick(PROMPT)
            await server.stop(0)
            with pytest.raises(PrefillNodeUnavailable, match=client.address):
                await client.prefill(prefill_call("to-the-dead", consumer), idle_timeout=5)
            assert not client.healthy
            with pytest.raises(PrefillNodeUnavailable, match="no healthy prefill node: 127.0.0.1:"):
                pool.pick(PROMPT)
        finally:
            await pool.close()

    run(scenario())


@pytest.mark.timeout(60)
def test_pool_starts_with_an_unreachable_node_but_not_with_a_mismatched_one(node: PrefillNode):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"

    async def scenario():
        server = await start_grpc_server(node, "127.0.0.1", 0, TOKEN)
        try:
            pool = PrefillPool([nobody, address(server)], TOKEN, node.info)
            await pool.start(timeout=5)
            down, up = pool.clients
            assert not down.healthy and "unreachable" in down.reason and up.healthy
            assert pool.pick(PROMPT) is up
            await pool.close()

            pool = PrefillPool([nobody, address(server)], TOKEN, changed(node.info, "block_size"))
            with pytest.raises(PrefillNodeMismatch, match="block_size differs"):
                await pool.start(timeout=5)
        finally:
            await server.stop(0)

    run(scenario())
