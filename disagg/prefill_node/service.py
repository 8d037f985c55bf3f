"""The gRPC face of a prefill node: PrefillService (proto/disagg.proto), the standard health
service, and the shared-secret check. The servicer only converts messages and maps errors to
status codes; what a call does is PrefillNode's business.
"""

import asyncio
import contextlib
import hmac
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from disagg.engine.kv_events import KVEventsLagged
from disagg.engine.sampling_params import MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_TOKEN_IDS
from disagg.lookup_buffer import BufferFullError
from disagg.prefill_node.node import PrefillNode
from disagg.proto import AUTH_METADATA_KEY, SERVICE_NAME, convert, disagg_pb2_grpc
from disagg.proto import disagg_pb2 as pb
from disagg.timeline import mark

logger = logging.getLogger(__name__)

# How often a Prefill call reports progress; a decode node's prefill_timeout should be a few times this.
PROGRESS_INTERVAL_S = 0.5
WATCH_INTERVAL_S = 0.5  # how often a Watch stream reports the node's load (and cache changes, if any)
MAX_ABORTABLE = 4096  # recent Prefill calls remembered with the connection they came on, for their Abort
AUTH_ERROR = "wrong or missing node auth token (kv_connector_extra_config.auth_token)"
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"


def max_request_bytes(max_model_len: int) -> int:
    """The largest Prefill request a decode node sends: a prompt of max_model_len token ids (each at most
    a 10-byte varint), a grammar of MAX_GRAMMAR_CHARS characters (4 bytes each in UTF-8), the logit bias
    and stop token ids at their limits, and room for the rest. A larger message is refused as its
    length arrives, before it is read, authenticated or not."""
    logit_bias = MAX_LOGIT_BIAS_ENTRIES * 24  # a map entry: tags, lengths, a varint key, a double
    return 10 * max_model_len + 4 * MAX_GRAMMAR_CHARS + logit_bias + 10 * MAX_STOP_TOKEN_IDS + 64 * 1024


def peer_address(peer: str) -> str:
    """The address in a gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000"); others whole."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0].strip("[]")
    return peer


class PrefillServicer(disagg_pb2_grpc.PrefillServiceServicer):
    def __init__(self, node: PrefillNode):
        self.node = node
        # Request id -> the gRPC connection (peer string, with its port) its Prefill came on: every node
        # holds the same token, so only that connection may abort it, whatever kv_dest an Abort names.
        self.connections: OrderedDict[str, str] = OrderedDict()
        self.stopping = False  # set as the server stops: Watch streams end, so the stop needs no grace for them

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.NodeInfo:
        peer = peer_address(context.peer())
        for port in [request.kv_port, *request.kv_rank_ports] if request.kv_host else []:
            if not self.node.register((request.kv_host, port), peer):
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"cannot register {request.kv_host}:{port}: every decode node registration "
                                    "from this address, or of all, is in use; retry later")
        return convert.node_info_to_proto(self.node.info)

    async def Prefill(self, request: pb.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.PrefillUpdate]:
        """Progress every PROGRESS_INTERVAL_S while the prompt waits or runs, then the result.
        A caller that cancels (its client went away, or it saw no progress) closes this
        generator, which cancels the prefill and so aborts it in the engine."""
        mark("disagg.prefill.call")
        # At once, not with the first update: the caller learns that the call is here (PrefillClient.prefill's `sent`).
        await context.send_initial_metadata(())
        try:
            call = convert.prefill_call_from_proto(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prefill of {request.request_id} refused: {e}")
        for dest in [call.kv_dest] + [rank.dest for rank in call.kv_ranks[1:]]:
            if not self.node.is_registered(dest):
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"prefill of {request.request_id} refused: kv_dest {dest[0]}:{dest[1]} "
                                    "is not a registered decode node; its Info handshake registers it")
        self.connections[call.request_id] = context.peer()
        self.connections.move_to_end(call.request_id)
        if len(self.connections) > MAX_ABORTABLE:
            self.connections.popitem(last=False)
        task = asyncio.create_task(self.node.prefill(call))
        try:
            while not (await asyncio.wait({task}, timeout=PROGRESS_INTERVAL_S))[0]:
                yield convert.progress_to_proto(self.node.progress(call.request_id))
            result = task.result()
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prefill of {request.request_id} refused: {e}")
        except BufferFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"prefill of {request.request_id} refused: {e}")
        except Exception as e:
            logger.exception("prefill of %s failed", request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"prefill of {request.request_id} failed on the prefill node: {type(e).__name__}: {e}")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        mark("disagg.prefill.answer")
        yield pb.PrefillUpdate(done=convert.prefill_result_to_proto(result))

    async def Watch(self, request: pb.WatchRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.NodeState]:
        """The prefix cache's snapshot, then its changes and the node's load every WATCH_INTERVAL_S,
        until the caller goes away or falls behind (then it watches again, from a new snapshot)."""
        subscription = await self.node.engine.subscribe_kv_events()
        try:
            yield convert.node_state_to_proto(self.node.load(), snapshot=subscription.snapshot)
            while not self.stopping:
                batch = await subscription.next(WATCH_INTERVAL_S)
                yield convert.node_state_to_proto(self.node.load(), events=batch)
        except KVEventsLagged as e:
            logger.warning("a Watch stream was cut off: %s; it will watch again", e)
        finally:
            subscription.close()

    async def FetchBlocks(self, request: pb.FetchBlocksRequest,
                          context: grpc.aio.ServicerContext) -> pb.FetchBlocksReply:
        """Another prefill node pulls prefix blocks (prefill_node/pull.py): their KV goes to its pipe
        endpoint, which its Info handshake registered, as a decode node's."""
        dest = (request.kv_dest_host, request.kv_dest_port)
        if not self.node.is_registered(dest):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"FetchBlocks {request.request_id} refused: kv_dest {dest[0]}:{dest[1]} is not "
                                "registered; its Info handshake registers it")
        try:
            blocks, nbytes = await self.node.fetch_blocks(request.request_id, list(request.hashes), dest)
        except (ValueError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"FetchBlocks {request.request_id} refused: {e}")
        except BufferFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"FetchBlocks {request.request_id} refused: {e}")
        except Exception as e:
            logger.exception("FetchBlocks %s failed", request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"FetchBlocks {request.request_id} failed: "
                                                          f"{type(e).__name__}: {e}")
        return pb.FetchBlocksReply(num_blocks=blocks, kv_bytes=nbytes)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortReply:
        if self.connections.get(request.request_id) != context.peer():
            return pb.AbortReply(aborted=False)  # not a request this connection asked for
        try:
            aborted = await self.node.abort(request.request_id, (request.kv_dest_host, request.kv_dest_port))
        except Exception as e:
            logger.exception("abort of %s failed", request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"abort of {request.request_id} failed on the prefill node: {type(e).__name__}: {e}")
        return pb.AbortReply(aborted=aborted)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks unless its metadata carries the shared secret."""

    def __init__(self, token: str):
        self.token = token.encode()
        self.deny = grpc.unary_unary_rpc_method_handler(self._deny)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        # Health checks stay open so load balancers and probes need no secret.
        if details.method.startswith(HEALTH_METHOD_PREFIX):
            return await continuation(details)
        sent = dict(details.invocation_metadata or ()).get(AUTH_METADATA_KEY, "")
        if hmac.compare_digest(sent.encode(), self.token):
            return await continuation(details)
        return self.deny

    @staticmethod
    async def _deny(request: bytes, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, AUTH_ERROR)


class PrefillGrpcServer:
    """A started gRPC server; `stop` turns its health to NOT_SERVING before closing it."""

    def __init__(self, server: grpc.aio.Server, servicer: PrefillServicer, health_servicer: health.aio.HealthServicer,
                 port: int):
        self.server = server
        self.servicer = servicer
        self.health = health_servicer
        self.port = port  # the bound port (the one asked for, or the one picked for port 0)

    async def stop(self, grace: float | None = None) -> None:
        await self.health.enter_graceful_shutdown()
        self.servicer.stopping = True
        await self.server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_grpc_server(node: PrefillNode, host: str, port: int, auth_token: str | None) -> PrefillGrpcServer:
    """Serve PrefillService and grpc.health.v1 on host:port (port 0: any free port)."""
    interceptors = [AuthInterceptor(auth_token)] if auth_token else []
    # gRPC sets SO_REUSEPORT by default, which lets a second server bind a port another one serves.
    options = [("grpc.so_reuseport", 0),
               ("grpc.max_receive_message_length", max_request_bytes(node.engine.max_model_len))]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    servicer = PrefillServicer(node)
    disagg_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpc has logged the OS error; say what to do about it
        raise OSError(f"cannot serve gRPC on {host}:{port}: the port is in use or {host} is not an address "
                      "of this machine; free it or pick another --grpc-port") from None
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    logger.info("gRPC PrefillService on %s:%d (auth %s)", host, bound, "on" if auth_token else "off")
    return PrefillGrpcServer(server, servicer, health_servicer, bound)
