"""The decode node's side of the control plane: one gRPC client per prefill node, and the pool
that picks among them.

At start the pool runs the Info handshake with every node: a node that serves another model,
dtype or block size, or refuses our auth token, is a misconfiguration and stops the decode node
with the reason; a node that is merely unreachable is marked unhealthy and retried, since the
decode node can serve meanwhile by computing prompts itself. A health loop (grpc.health.v1)
marks nodes that stop answering and takes them back, after a new handshake, when they answer.

Each client also watches its node (the Watch stream): the block hashes its prefix cache holds
(engine/kv_view.py's view, the router's too) and its load (queued prompt tokens, measured
throughput). `PrefillPool.pick` weighs the healthy nodes by both, in prompt tokens: its queue and the
part of the prompt its cache does not hold. Not by each node's measured speed: they serve one model,
and a node's own figure can be far off (a fit over warm-up prompts of a few tokens spreads a step's
fixed cost over them), and weighed by it the node would never get the prompts that correct it; a
node that really is slower builds a longer queue. A watch that breaks empties the view and is
retried; a node that stops answering drops out of the pick when its health checks fail, as before.
"""

import asyncio
import contextlib
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disagg.control_plane import NodeInfo, NodeLoad, PrefillCall, PrefillProgress, PrefillResult
from disagg.engine.block_hash import LazyBlockHashes, hashes_at
from disagg.engine.kv_view import CacheView, KVEventsError
from disagg.proto import AUTH_METADATA_KEY, SERVICE_NAME, convert, disagg_pb2_grpc
from disagg.proto import disagg_pb2 as pb

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 1.0  # an abort is best effort: never hold a request's cleanup longer
# A dead node refuses at once; this only bounds a live one that is slow to answer because its
# engine keeps the CPU busy, which must not count as down.
HEALTH_TIMEOUT_S = 5.0
# gRPC backs off reconnects up to 120 s by default; a prefill node that restarts should be
# noticed by the next health checks, not minutes later.
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]
WATCH_RETRY_S = 1.0  # between attempts to watch a node again
WATCH_SILENCE_S = 5.0  # no state for this long (the node reports every 0.5 s): its view is dropped
# A step running with no measured cost yet (the node's first prompt tokens) counts as progress for
# this long; a measured one for STEP_SLACK times what it should take.
UNMEASURED_STEP_S = 60.0
STEP_SLACK = 4.0
# A node's prompt throughput before it or a peer has measured one.
UNMEASURED_TOKENS_PER_S = 1000.0


def made_progress(progress: PrefillProgress, last: PrefillProgress | None) -> bool:
    """Whether a Prefill call's heartbeat shows the node at work on it since `last`: a new step, more
    of the prompt computed, or a step still running within what it should take (a long chunk on a
    CPU may take longer than the caller's limit). A hung engine's step outgrows that; a hung or
    stopped node sends nothing at all."""
    if last is None or (progress.engine_steps, progress.num_computed_tokens) != (
            last.engine_steps, last.num_computed_tokens):
        return True
    if progress.step_seconds <= 0:
        return False
    allowed = STEP_SLACK * progress.step_expected_seconds if progress.step_expected_seconds else UNMEASURED_STEP_S
    return progress.step_seconds <= allowed


class PrefillClientError(RuntimeError):
    """Base of every error of a call to a prefill node."""


class PrefillNodeUnavailable(PrefillClientError):
    """The node could not be reached (down, wrong address, or no healthy node to pick)."""


class PrefillNodeMismatch(PrefillClientError):
    """The node serves something this decode node cannot use (model, dtype, block size, ...)."""


class PrefillAuthError(PrefillClientError):
    """The node refused this node's auth token."""


class PrefillFailed(PrefillClientError):
    """The node answered the call with an error status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class PrefillNodeBusy(PrefillFailed):
    """RESOURCE_EXHAUSTED: the node's KV buffer is full; another node (or recomputing) may serve."""


class PrefillClient:
    """A channel to one prefill node. Create it inside the running event loop."""

    def __init__(self, address: str, auth_token: str | None):
        self.address = address  # "host:port" of the node's gRPC server
        self.metadata = ((AUTH_METADATA_KEY, auth_token),) if auth_token else ()
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = disagg_pb2_grpc.PrefillServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)
        self.info: NodeInfo | None = None  # the node's, after connect
        self.healthy = False
        self.reason = "not connected yet"  # why it is unhealthy, for logs and error messages
        self.outstanding = 0  # Prefill calls in flight
        self.calls = 0  # Prefill calls made, to break ties so light traffic still alternates
        self.view = CacheView()  # its prefix cache, from its Watch stream
        self.load = NodeLoad()  # as of its last report
        self.sent_tokens = 0  # prompt tokens sent to it since that report, not in it yet

    async def connect(self, expected: NodeInfo, timeout: float, kv_endpoint: tuple[str, int] | None = None,
                      kv_rank_ports: tuple[int, ...] = ()) -> NodeInfo:
        """The Info handshake: the node's NodeInfo, checked against `expected` (this node's).
        `kv_endpoint`: our pipe endpoint, registered with the node as a place its KV may go, and so are
        our worker ranks' on its host (`kv_rank_ports`, from rank 1 on)."""
        host, port = kv_endpoint or ("", 0)
        try:
            msg = await self.stub.Info(pb.InfoRequest(kv_host=host, kv_port=port, kv_rank_ports=kv_rank_ports),
                                       timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            raise self._error(e, "Info", timeout) from None
        peer = convert.node_info_from_proto(msg)
        reason = expected.mismatch(peer)
        if reason is not None:
            raise PrefillNodeMismatch(
                f"prefill node {self.address} is incompatible with this decode node: {reason}; "
                f"start both nodes with the same model, dtype, block size and kv_connector")
        self.info = peer
        self.mark_healthy()
        return peer

    async def prefill(self, call: PrefillCall, idle_timeout: float,
                      sent: asyncio.Future | None = None) -> PrefillResult:
        """The call's result. It may take as long as the node keeps making progress (its engine
        runs steps, or this prompt gains computed tokens); `idle_timeout` seconds without any
        ends it with PrefillFailed, and cancelling the call aborts it on the node. `sent` is set once
        the node has the request (its handler began), or the call ended before."""
        self.outstanding += 1
        self.calls += 1
        self.sent_tokens += len(call.prompt_token_ids)
        stream = self.stub.Prefill(convert.prefill_call_to_proto(call), metadata=self.metadata)
        last, deadline = None, time.monotonic() + idle_timeout
        idle = PrefillFailed(grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill node {self.address} made no progress "
                                                                 f"on {call.request_id} within {idle_timeout:g}s")
        try:
            if sent is not None:
                # The node's handler answers with its metadata at once (service.py): the request is there.
                try:
                    await asyncio.wait_for(stream.wait_for_connection(), idle_timeout)
                except TimeoutError:
                    raise idle from None
                sent.set_result(None)
            while True:
                try:
                    update = await asyncio.wait_for(stream.read(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise idle from None
                if update is grpc.aio.EOF:
                    raise PrefillFailed(grpc.StatusCode.INTERNAL,
                                        f"prefill node {self.address} ended {call.request_id} without a result")
                if update.HasField("done"):
                    return convert.prefill_result_from_proto(update.done)
                progress = convert.progress_from_proto(update.progress)
                if made_progress(progress, last):
                    deadline = time.monotonic() + idle_timeout
                last = progress
        except grpc.aio.AioRpcError as e:
            error = self._error(e, f"Prefill of {call.request_id}", idle_timeout)
            # Unreachable, or restarted and forgot our registration: no more work until the
            # health loop has reconnected (and so registered us again).
            if isinstance(error, PrefillNodeUnavailable) or e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self.mark_unhealthy(str(error))
            raise error from None
        finally:
            if sent is not None and not sent.done():
                sent.set_result(None)
            stream.cancel()  # no-op once finished; otherwise the node aborts the prefill
            self.outstanding -= 1

    async def watch(self) -> None:
        """Follow the node's Watch stream into `view` and `load`, watching again after any break (cancel to stop)."""
        while True:
            stream = self.stub.Watch(pb.WatchRequest(), metadata=self.metadata)
            try:
                while True:
                    msg = await asyncio.wait_for(stream.read(), WATCH_SILENCE_S)
                    if msg is grpc.aio.EOF:
                        raise KVEventsError("the stream ended")
                    load, snapshot, events = convert.node_state_from_proto(msg)
                    if snapshot is not None:
                        self.view.snapshot(snapshot.seq, snapshot.block_size, snapshot.hashes)
                    if events is not None:
                        self.view.events(events.seq, events.medium, events.stored, events.removed)
                    self.load, self.sent_tokens = load, 0
            except (grpc.aio.AioRpcError, KVEventsError, TimeoutError) as e:
                reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else (str(e) or type(e).__name__)
                if self.view.live:
                    logger.info("watch of prefill node %s stopped (%s); its cache view is dropped until it "
                                "resumes", self.address, reason)
                self.view.drop(reason)
            finally:
                stream.cancel()
            await asyncio.sleep(WATCH_RETRY_S)

    def pending_tokens(self, prompt_token_ids: list[int], block_hashes: dict[int, LazyBlockHashes]) -> int:
        """The prompt tokens the node would compute before this prompt's first token: its queue, then what
        its prefix cache does not hold of the prompt. `block_hashes`: the prompt's, by block size, filled
        as needed."""
        size = self.view.block_size
        cached = 0
        if size:
            cached = self.view.matched_blocks(hashes_at(block_hashes, prompt_token_ids, size)) * size
        return self.load.queued_prefill_tokens + self.sent_tokens + len(prompt_token_ids) - cached

    def expected_seconds(self, prompt_token_ids: list[int], block_hashes: dict[int, LazyBlockHashes],
                         unmeasured_base: float = 0.0, tokens_per_s: float = 0.0) -> float:
        """How long the node would take to compute the prompt (its pending tokens) at `tokens_per_s`
        (PrefillPool.tokens_per_s), else its own measured throughput, else a cautious default, after a
        step's base: its own, or `unmeasured_base` where it could not measure one (it saw chunks of one
        size only)."""
        per_s = tokens_per_s or self.load.prefill_tokens_per_s or UNMEASURED_TOKENS_PER_S
        tokens = self.pending_tokens(prompt_token_ids, block_hashes)
        return (self.load.step_base_seconds or unmeasured_base) + tokens / per_s

    async def abort(self, request_id: str, kv_dest: tuple[str, int]) -> bool:
        """Ask the node to drop the request we (pipe endpoint `kv_dest`) sent it; False when it
        did not hold it for us or could not be told."""
        request = pb.AbortRequest(request_id=request_id, kv_dest_host=kv_dest[0], kv_dest_port=kv_dest[1])
        try:
            reply = await self.stub.Abort(request, timeout=ABORT_TIMEOUT_S, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            logger.debug("abort of %s on %s failed: %s", request_id, self.address, e.details())
            return False
        return reply.aborted

    async def check_health(self, timeout: float) -> str | None:
        """None when the node's health service says PrefillService is SERVING, else why not; never raises."""
        try:
            reply = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return f"health check failed: {e.code().name}: {e.details()}"
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return f"health check says {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        return None

    def mark_healthy(self) -> None:
        if not self.healthy:
            logger.info("prefill node %s is healthy", self.address)
        self.healthy = True
        self.reason = ""

    def mark_unhealthy(self, reason: str) -> None:
        if self.healthy:
            logger.warning("prefill node %s is unhealthy: %s", self.address, reason)
        self.healthy = False
        self.reason = reason

    async def close(self) -> None:
        await self.channel.close()

    def _error(self, e: grpc.aio.AioRpcError, what: str, timeout: float) -> PrefillClientError:
        code, details = e.code(), e.details()
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return PrefillAuthError(f"prefill node {self.address} refused {what}: {details}; "
                                    "give both nodes the same kv_connector_extra_config.auth_token")
        if code == grpc.StatusCode.UNAVAILABLE:
            return PrefillNodeUnavailable(f"prefill node {self.address} is unreachable ({what}): {details}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return PrefillFailed(code, f"prefill node {self.address} did not answer {what} within {timeout:g}s")
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return PrefillNodeMismatch(f"{self.address} does not serve {SERVICE_NAME} ({what}: {details}); "
                                       "is it a prefill node's --grpc-port?")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return PrefillNodeBusy(code, f"prefill node {self.address} is busy ({what}): {details}")
        return PrefillFailed(code, f"prefill node {self.address} failed {what}: {code.name}: {details}")


class PrefillPool:
    """The decode node's prefill nodes: `pick()` the healthy one that would answer a prompt first."""

    def __init__(self, addresses: list[str], auth_token: str | None, expected: NodeInfo,
                 kv_endpoint: tuple[str, int] | None = None, health_interval: float = 1.0,
                 kv_rank_ports: tuple[int, ...] = ()):
        """kv_endpoint: this decode node's pipe endpoint, registered with every prefill node, and so are its
        worker ranks' on the same host (kv_rank_ports, from rank 1 on)."""
        self.kv_rank_ports = kv_rank_ports
        if not addresses:
            raise ValueError("a prefill pool needs at least one prefill node address (host:port)")
        self.expected = expected  # this node's NodeInfo: every prefill node must match it
        self.kv_endpoint = kv_endpoint
        self.health_interval = health_interval
        self.clients = [PrefillClient(address, auth_token) for address in addresses]
        self.health_task: asyncio.Task | None = None
        self.watch_tasks: list[asyncio.Task] = []

    async def start(self, timeout: float) -> None:
        """Handshake with every node, then watch them. Raises PrefillNodeMismatch or
        PrefillAuthError when a node is misconfigured; unreachable nodes only start unhealthy."""
        results = await asyncio.gather(*(c.connect(self.expected, timeout, self.kv_endpoint, self.kv_rank_ports)
                                         for c in self.clients),
                                       return_exceptions=True)
        refused = [r for r in results if isinstance(r, (PrefillNodeMismatch, PrefillAuthError))]
        if refused:
            await self.close()
            raise refused[0]
        for client, result in zip(self.clients, results):
            if isinstance(result, BaseException):
                client.mark_unhealthy(str(result))
                logger.warning("prefill node %s: %s; retrying it every %gs",
                               client.address, result, self.health_interval)
        self.health_task = asyncio.create_task(self._health_loop(), name="prefill-health")
        self.watch_tasks = [asyncio.create_task(c.watch(), name=f"prefill-watch-{c.address}") for c in self.clients]

    def pick(self, prompt_token_ids: list[int],
             block_hashes: dict[int, LazyBlockHashes] | None = None) -> PrefillClient:
        """The healthy node with the fewest prompt tokens to compute before this prompt's first token
        (PrefillClient.pending_tokens); ties go to the one with fewer calls in flight, then fewer calls
        made, so light traffic alternates. `block_hashes`: the prompt's by block size, filled as needed,
        for the caller to reuse."""
        healthy = [c for c in self.clients if c.healthy]
        if not healthy:
            reasons = "; ".join(f"{c.address}: {c.reason}" for c in self.clients)
            raise PrefillNodeUnavailable(f"no healthy prefill node: {reasons}")
        hashes = {} if block_hashes is None else block_hashes
        return min(healthy, key=lambda c: (c.pending_tokens(prompt_token_ids, hashes), c.outstanding, c.calls))

    def tokens_per_s(self) -> float:
        """The pool's prompt throughput, to estimate a remote prefill by: the fastest any healthy node measured
        (0 before any did), since a node's own figure can be far off (see the module's docstring)."""
        return max((c.load.prefill_tokens_per_s for c in self.clients if c.healthy), default=0.0)

    def pull_hint(self, picked: PrefillClient, prompt_token_ids: list[int],
                  block_hashes: dict[int, LazyBlockHashes]) -> tuple[str, int]:
        """Where the picked node may pull the prompt's prefix from (a Prefill call's pull_from,
        pull_blocks): the healthy node whose device prefix cache holds the most of the prompt's leading
        blocks, by its Watch view, if that is more than the picked node holds; ("", 0) when none does.
        `block_hashes`: the prompt's by block size, as pick() filled them."""
        hashes = hashes_at(block_hashes, prompt_token_ids, self.expected.block_size)
        mine = picked.view.leading_blocks(hashes)
        best, most = None, mine
        for client in self.clients:
            if client is not picked and client.healthy and (held := client.view.leading_blocks(hashes)) > most:
                best, most = client, held
        return (best.address, most) if best is not None else ("", 0)

    async def close(self) -> None:
        for task in self.watch_tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.watch_tasks = []
        if self.health_task is not None:
            self.health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.health_task
            self.health_task = None
        await asyncio.gather(*(c.close() for c in self.clients))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await asyncio.gather(*(self._check(c) for c in self.clients))

    async def _check(self, client: PrefillClient) -> None:
        problem = await client.check_health(timeout=HEALTH_TIMEOUT_S)
        if problem is not None:
            client.mark_unhealthy(problem)
            return
        if client.healthy:
            return
        # Back after a failure: it may have restarted with another model or pipe port.
        try:
            await client.connect(self.expected, timeout=HEALTH_TIMEOUT_S, kv_endpoint=self.kv_endpoint,
                                 kv_rank_ports=self.kv_rank_ports)
        except PrefillClientError as e:
            if str(e) != client.reason:
                logger.warning("prefill node %s answers but is refused: %s", client.address, e)
            client.reason = str(e)
