"""PrefixPuller: a prefill node pulls a prompt's prefix blocks from another prefill node that holds
them, instead of computing them (docs/ARCHITECTURE.md, "Prefix pull").

A Prefill call may carry a hint from the decode node, which follows every prefill node's cache
(Watch): the node at `pull_from` holds the prompt's first `pull_blocks` full blocks. Before the
prompt runs, the puller asks its own prefix cache how many of those it holds, and for the rest, when
pulling is estimated cheaper than computing them, registers this node's pipe endpoint with the peer
(its Info handshake, as a decode node's) and calls FetchBlocks(hashes) on it: the peer sends the KV
of the leading blocks it still holds over its pipe, as one lookup-buffer entry, to this node's
consumer. The entry's token digest must be that of this prompt's tokens for those blocks, so KV of
other tokens is never taken; the engine then caches the blocks under the hashes of those tokens
(engine/prefix_blocks.py), and the prompt's prefill hits them. Any failure (the peer is down,
incompatible, no longer holds them, too slow: PULL_TIMEOUT_S) leaves the blocks to be computed.

"Cheaper": the seconds a pulled block took, measured over this node's pulls (but each node's first,
which pays one-off costs), against a block's prompt tokens at this node's measured prefill
throughput (engine/step_cost.py); until both are measured, a pull is tried.
"""

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import grpc

from disagg import metrics
from disagg.control_plane import NodeInfo
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.block_hash import prompt_block_hashes
from disagg.engine.step_cost import StepCost
from disagg.lookup_buffer import LookupBufferConsumer
from disagg.proto import AUTH_METADATA_KEY, convert, disagg_pb2_grpc
from disagg.proto import disagg_pb2 as pb

logger = logging.getLogger(__name__)

# A pull that takes longer is given up and its blocks computed. Its wait shows no progress to the decode
# node (no step, no token), so it must stay well below the decode node's prefill_timeout (10 s by default).
PULL_TIMEOUT_S = 3.0
MAX_PEERS = 64  # channels to other prefill nodes kept open, least recently used closed first
SMOOTHING = 0.2  # weight of a new pull in the measured seconds per block


class PullFailed(RuntimeError):
    """A pull that brought nothing usable; its blocks are computed."""


@dataclass
class Peer:
    """Another prefill node this node has registered its pipe endpoint with."""
    channel: grpc.aio.Channel
    stub: disagg_pb2_grpc.PrefillServiceStub
    kv_source: tuple[str, int]  # its own pipe endpoint: the source its entries come from


class PrefixPuller:
    def __init__(self, engine: AsyncEngine, consumer: LookupBufferConsumer, kv_endpoint: tuple[str, int],
                 info: NodeInfo, auth_token: str | None, cost: StepCost):
        self.engine = engine
        self.consumer = consumer  # listens on this node's pipe endpoint
        self.kv_endpoint = kv_endpoint  # where peers send to: kv_ip, and the port the consumer bound
        self.info = info
        self.metadata = ((AUTH_METADATA_KEY, auth_token),) if auth_token else ()
        self.cost = cost  # this node's prefill steps
        self.peers: OrderedDict[str, Peer] = OrderedDict()  # by gRPC address
        self.seconds_per_block: float | None = None  # measured over pulls

    def worth(self) -> bool:
        """Whether a pulled block is estimated cheaper than one computed here."""
        per_s = self.cost.tokens_per_second()
        if not per_s or self.seconds_per_block is None:
            return True
        return self.seconds_per_block < self.info.block_size / per_s

    async def pull(self, prompt_token_ids: list[int], address: str, blocks: int) -> int:
        """Bring the prompt's first `blocks` full blocks that this node's prefix cache lacks from the
        prefill node at `address` into it. Returns how many blocks were put in; never raises (but
        CancelledError): what is not pulled is computed."""
        hashes = prompt_block_hashes(prompt_token_ids, self.info.block_size)[:blocks]
        held = await self.engine.held_prefix_blocks(prompt_token_ids, len(hashes))
        if held == len(hashes):
            return 0
        if not self.worth():
            metrics.PREFIX_PULLS.labels("not_worth").inc()
            return 0
        known = address in self.peers  # else this pull pays the handshake and the pipe's connection too
        start = time.perf_counter()
        try:
            pulled = await asyncio.wait_for(self._fetch(prompt_token_ids, address, held, hashes[held:]), PULL_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001  any failure: the blocks are computed
            metrics.PREFIX_PULLS.labels("failed").inc()
            logger.warning("pull of %d prefix blocks from %s failed (%s); computing them",
                           len(hashes) - held, address, str(e) or type(e).__name__)
            await self._forget(address)  # registered again, on a fresh channel, next time
            return 0
        per_block = (time.perf_counter() - start) / max(1, pulled)
        if known:  # a first pull from a node also pays the handshake and the pipe's connection: not measured
            self.seconds_per_block = per_block if self.seconds_per_block is None else (
                (1 - SMOOTHING) * self.seconds_per_block + SMOOTHING * per_block)
        metrics.PREFIX_PULLS.labels("pulled").inc()
        metrics.PREFIX_PULLED_BLOCKS.inc(pulled)
        return pulled

    async def _fetch(self, prompt_token_ids: list[int], address: str, held: int, hashes: list[int]) -> int:
        """Pull the blocks after the `held` leading ones, by their hashes; how many were put in."""
        peer = await self._peer(address)
        size = self.info.block_size
        pull_id = f"pull-{uuid.uuid4().hex}"
        host, port = self.kv_endpoint
        done = False
        try:
            try:
                reply = await peer.stub.FetchBlocks(
                    pb.FetchBlocksRequest(request_id=pull_id, hashes=hashes, kv_dest_host=host, kv_dest_port=port),
                    timeout=PULL_TIMEOUT_S, metadata=self.metadata)
            except grpc.aio.AioRpcError as e:
                raise PullFailed(f"FetchBlocks: {e.code().name}: {e.details()}") from None
            count = reply.num_blocks
            if not 0 < count <= len(hashes):
                raise PullFailed(f"it holds {count} of the {len(hashes)} blocks asked for")
            tokens = prompt_token_ids[held * size:(held + count) * size]
            # DigestMismatch unless the KV is of exactly these tokens.
            entry = await self.consumer.drop_select_async(pull_id, tokens, PULL_TIMEOUT_S, peer.kv_source)
            done = True
        finally:
            if not done:
                self.consumer.discard(pull_id)  # a late arrival is dropped
        kv = entry.kv_tensors[0]
        expected = (self.info.num_layers, 2, len(tokens), self.info.num_kv_heads, self.info.head_dim)
        if len(entry.kv_tensors) != 1 or tuple(kv.shape) != expected:
            raise PullFailed(f"KV of shape {tuple(kv.shape)}, expected {expected}")
        return await self.engine.insert_prefix_blocks(prompt_token_ids, held, kv)

    async def _peer(self, address: str) -> Peer:
        """The peer at `address`, its Info handshake done: our pipe endpoint registered with it, and its
        model, dtype and KV layout checked against ours."""
        peer = self.peers.get(address)
        if peer is not None:
            self.peers.move_to_end(address)
            return peer
        channel = grpc.aio.insecure_channel(address)
        stub = disagg_pb2_grpc.PrefillServiceStub(channel)
        try:
            msg = await stub.Info(pb.InfoRequest(kv_host=self.kv_endpoint[0], kv_port=self.kv_endpoint[1]),
                                  timeout=PULL_TIMEOUT_S, metadata=self.metadata)
            info = convert.node_info_from_proto(msg)
            reason = self.info.mismatch(info)
            if reason is not None:
                raise PullFailed(f"the peer is incompatible: {reason}")
        except BaseException as e:
            await channel.close()
            if isinstance(e, grpc.aio.AioRpcError):
                raise PullFailed(f"Info: {e.code().name}: {e.details()}") from None
            raise
        self.peers[address] = peer = Peer(channel, stub, (info.kv_ip, info.kv_port))
        if len(self.peers) > MAX_PEERS:
            _, oldest = self.peers.popitem(last=False)
            await oldest.channel.close()
        return peer

    async def _forget(self, address: str) -> None:
        peer = self.peers.pop(address, None)
        if peer is not None:
            with contextlib.suppress(Exception):
                await peer.channel.close()

    async def close(self) -> None:
        for address in list(self.peers):
            await self._forget(address)
        self.consumer.close()
