"""PrefillNode: computes prompts and pushes their KV to the decode node that asked.

A Prefill call opens the prompt's entry in the LookupBuffer producer (reserving its room),
addressed to the caller's pipe endpoint (or one per decode rank, and under tensor parallelism here
one per prefill rank that holds some of that rank's heads, opened in that rank's own producer:
rank_send.py), and runs the prompt through the engine for exactly
one token (prefix-cache hits skip what is cached). During each step that computes a chunk of
the prompt, each layer group's KV goes to the producer as soon as those layers have run, so it
crosses the pipe while later layers and chunks compute (docs/ARCHITECTURE.md, "Layer-wise
send"); the first token follows the KV on the pipe, and the call answers with the costs. The engine
never waits on the network.
"""

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict

import torch

from disagg import metrics
from disagg.control_plane import NodeInfo, NodeLoad, PrefillCall, PrefillProgress, PrefillResult, plan_entries
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.sequence import KVExport
from disagg.engine.step_cost import StepCost
from disagg.lookup_buffer import LookupBufferProducer
from disagg.prefill_node.layer_sender import LayerSender, RankEntry, worker_ranks
from disagg.prefill_node.pull import PrefixPuller
from disagg.prefill_node.rank_send import RankSenders
from disagg.timeline import mark

logger = logging.getLogger(__name__)

MAX_REGISTERED_DESTINATIONS = 1024  # decode nodes' pipe endpoints remembered
MAX_DESTINATIONS_PER_PEER = 16  # of those, registered from one address (a decode node needs one, a few over restarts)
# A registration seen (its Info, or a Prefill naming it) this recently, or with a Prefill in flight, is live: never
# dropped to make room for another, so a flood of Info calls cannot unregister the decode nodes at work.
REGISTRATION_LIVE_S = 300.0
# A layer-wise entry goes in about this many groups of layers, and the last layer alone: each part costs
# the decode node's receiver thread a wait and some Python, slow beside its busy engine and event loop
# (docs/ARCHITECTURE.md, "Threads and the GIL"), while only the last part's transfer waits for the
# prompt's last layer.
LAYER_PARTS = 8
MAX_RANK_ENTRIES = 4096  # requests whose entries to a decode node's ranks are remembered, for their Abort


@dataclasses.dataclass
class Registration:
    """A decode node's pipe endpoint, as its Info handshake registered it."""
    peer: str  # the address its first Info came from; it counts against that address's share
    seen: float  # time.monotonic() of its last Info, or of a Prefill naming it


class PrefillNode:
    def __init__(self, engine: AsyncEngine, producer: LookupBufferProducer, info: NodeInfo,
                 kv_buffer_device: str = "cpu", layerwise: bool = True, layerwise_min_tokens: int = 0,
                 ranks: RankSenders | None = None):
        """ranks: under tensor parallelism, the worker ranks' own senders: each rank sends the decode
        ranks its own KV heads."""
        self.engine = engine
        self.producer = producer
        self.info = info
        self.ranks = ranks
        # Each of our ranks' KV heads: which rank sends which heads to a decode node's ranks (plan_entries).
        self.kv_rank_heads = info.heads_by_rank
        self.kv_buffer_device = kv_buffer_device
        self.layerwise = layerwise  # else a prompt's KV goes as one message once all layers have run
        self.layerwise_min_tokens = layerwise_min_tokens  # a prompt with fewer tokens to send goes whole
        self.copy_stream: torch.cuda.Stream | None = None  # KV to host memory, off the engine's stream
        self.callers: dict[str, PrefillCall] = {}  # request id -> the call computing it
        # Request id -> its entries to a decode node's ranks, until aborted or pushed out by newer ones.
        self.rank_entries: OrderedDict[str, list[RankEntry]] = OrderedDict()
        self.senders: dict[str, LayerSender] = {}  # request id -> where its KV goes, as it is computed
        # Pipe endpoints decode nodes registered at their Info handshake, least recently seen first: the
        # only places KV goes, so a caller cannot make this node connect anywhere it likes.
        self.destinations: OrderedDict[tuple[str, int], Registration] = OrderedDict()
        self.cost = StepCost()  # what a prompt token costs this node: its throughput, a step's expected time
        engine.stat_loggers.append(self.cost.record)
        self.puller: PrefixPuller | None = None  # pulls hinted prefixes from other prefill nodes (pull.py)

    async def prefill(self, call: PrefillCall) -> PrefillResult:
        start = time.perf_counter()
        pulled = 0  # prefix blocks pulled from call.pull_from into our prefix cache, which the prefill then hits
        if self.puller is not None and call.pull_from and call.pull_blocks:
            pulled = await self.puller.pull(call.prompt_token_ids, call.pull_from, call.pull_blocks)
        # Only the first token is sampled here; stop rules and lengths are the decode node's.
        params = dataclasses.replace(call.params, max_tokens=1, min_tokens=min(call.params.min_tokens, 1), stop=[])
        if params.structured is not None:  # compiled here, off the engine thread, which then finds it cached
            await self.engine.compile_grammar(params.structured)
        export, sender, workers, nbytes = await self._open_entries(call)
        opened = time.perf_counter()
        mark("disagg.prefill.entries_opened")
        metrics.KV_BUFFER_INSERT.observe(opened - start)
        final = None
        self.callers[call.request_id] = call
        self.senders[call.request_id] = sender
        try:
            async for out in self.engine.generate(call.request_id, call.prompt_token_ids, params, kv_export=export):
                final = out
            mark("disagg.prefill.engine_done")
            tokens = len(call.prompt_token_ids) - call.skip_tokens
            if sender.tokens_put != tokens:
                raise RuntimeError(
                    f"prefill of {call.request_id} ended without its KV ({final and final.finish_reason})")
            if workers:
                for rank, put in (await self.ranks.finish(call.request_id, workers)).items():
                    if put != tokens:
                        raise RuntimeError(f"prefill of {call.request_id} ended without tensor-parallel rank "
                                           f"{rank}'s KV ({put} of {tokens} tokens put)")
        except BaseException:
            for entry in sender.entries:  # on the wire already, the decode node is told it is cancelled
                self.producer.abort(entry.entry_id)
            if workers:
                await asyncio.shield(self.ranks.abort(call.request_id, workers))
            raise
        finally:
            self.callers.pop(call.request_id, None)
            self.senders.pop(call.request_id, None)
        seconds = time.perf_counter() - start
        metrics.PREFILL_COMPUTE.observe(time.perf_counter() - opened)
        logger.info("prefill %s: %d prompt tokens (%d cached%s), %.1f KiB KV to %s:%d in %.3fs",
                    call.request_id, len(call.prompt_token_ids), final.num_cached_tokens,
                    f", {pulled * self.info.block_size} of them pulled from {call.pull_from}" if pulled else "",
                    nbytes / 1024, *call.kv_dest, seconds)
        return PrefillResult(
            num_cached_tokens=final.num_cached_tokens,
            kv_bytes=nbytes,
            prefill_seconds=seconds,
        )

    def rank_entries_of(self, call: PrefillCall) -> list[RankEntry]:
        """Where the call's KV goes: one entry of every head to kv_dest (sent by rank 0, gathered from
        every rank), or one per decode rank and prefill rank of ours whose heads overlap, with those
        heads, sent by that rank. Raises ValueError for heads outside the model's."""
        if not call.kv_ranks:
            return [RankEntry(call.request_id, call.kv_dest, None)]
        heads = self.info.num_kv_heads
        for rank in call.kv_ranks:
            if not 0 <= rank.heads[0] < rank.heads[1] <= heads:
                raise ValueError(f"decode rank heads {list(rank.heads)} are not a run of this model's {heads} KV heads")
        return [RankEntry(e.entry_id, call.kv_ranks[e.decode_rank].dest, e.heads, e.prefill_rank)
                for e in plan_entries(call.request_id, [rank.heads for rank in call.kv_ranks], self.kv_rank_heads)]

    async def _open_entries(self, call: PrefillCall) -> tuple[KVExport, LayerSender, list[int], int]:
        """The producers' entries for the prompt's KV from call.skip_tokens on (the decode node holds
        the rest), their room reserved before the prefill runs (ours, and each worker rank's in its
        own), the export that fills them, our sender, the worker ranks that send some and the bytes."""
        engine = self.engine
        num_layers = engine.model_config.num_hidden_layers
        per_head = engine.kv_bytes_per_token_layer // self.info.num_kv_heads
        tokens = len(call.prompt_token_ids) - call.skip_tokens
        layerwise = self.layerwise and tokens >= self.layerwise_min_tokens
        layers = layer_groups(num_layers) if layerwise else [(0, num_layers)]
        entries, opened = self.rank_entries_of(call), []
        sizes = [num_layers * per_head * (end - first) * tokens
                 for first, end in (entry.heads or (0, self.info.num_kv_heads) for entry in entries)]
        workers = worker_ranks(entries)
        try:
            for entry, size in zip(entries, sizes):
                # The first, to the decode node's rank 0 (plan_entries' order), carries the first token.
                if entry.rank == 0:
                    await self._open_entry(entry, call.prompt_token_ids, layers, tokens, size, not opened)
                    opened.append(entry)
            if workers:
                await self.ranks.open(call.request_id, entries, sizes, call.prompt_token_ids, layers, tokens)
        except BaseException:
            for entry in opened:
                self.producer.abort(entry.entry_id)
            raise
        if call.kv_ranks:
            self.rank_entries[call.request_id] = entries
            while len(self.rank_entries) > MAX_RANK_ENTRIES:
                self.rank_entries.popitem(last=False)
        if engine.device.type == "cuda" and self.kv_buffer_device == "cpu" and self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(engine.device)
        copy_stream = self.copy_stream if self.kv_buffer_device == "cpu" else None
        # Where our ranks send their own heads, rank 0's put gets only its own (no gather); else every head.
        own_heads = bool(call.kv_ranks) and len(self.kv_rank_heads) > 1
        sender = LayerSender(self.producer, opened, num_layers, copy_stream,
                             self.kv_rank_heads[0][0] if own_heads else 0, metrics.KV_RANK_SENT_BYTES.labels("0").inc)
        export = KVExport(call.skip_tokens, layers, sender.put, at_end=not layerwise, own_heads=own_heads,
                          first_token=sender.first_token)
        return export, sender, workers, sum(sizes)

    async def _open_entry(self, entry: RankEntry, token_ids: list[int], layers: list[tuple[int, int]], tokens: int,
                          nbytes: int, first_token: bool) -> None:
        """One entry opened in the producer, its room reserved; with first_token, to carry the prompt's first token."""
        args = (entry.entry_id, token_ids, layers, tokens, nbytes, entry.dest)
        # At once when there is room: no thread hop.
        if not self.producer.open(*args, wait=False, first_token=first_token):
            # Full: wait (bounded) for buffer space off the event loop, and shielded, so that a call
            # cancelled meanwhile (its decode node gave up) aborts the entry once it is open.
            opening = asyncio.ensure_future(asyncio.to_thread(self.producer.open, *args, first_token=first_token))
            try:
                await asyncio.shield(opening)
            except asyncio.CancelledError:
                opening.add_done_callback(lambda task: self._abort_opened(task, entry.entry_id))
                raise

    def _abort_opened(self, opening: asyncio.Future, request_id: str) -> None:
        if not opening.cancelled() and opening.exception() is None:
            self.producer.abort(request_id)

    async def fetch_blocks(self, request_id: str, hashes: list[int], dest: tuple[str, int]) -> tuple[int, int]:
        """Another prefill node's pull: send the KV of the leading blocks our prefix cache holds under
        `hashes` to its pipe endpoint `dest`, as one entry. Returns (blocks, bytes) sent; (0, 0) when
        none is held. Raises BufferFullError when the producer has no room for it."""
        tokens, kv = await self.engine.export_prefix_blocks(hashes)
        if kv is None:
            return 0, 0
        # insert waits (bounded) for buffer space: off the event loop.
        await asyncio.to_thread(self.producer.insert, request_id, tokens, [kv], None, dest)
        blocks = len(tokens) // self.info.block_size
        metrics.PREFIX_FETCHED_BLOCKS.inc(blocks)
        return blocks, kv.nbytes

    def register(self, dest: tuple[str, int], peer: str) -> bool:
        """Remember a decode node's pipe endpoint, registered from address `peer`. Each address registers
        at most MAX_DESTINATIONS_PER_PEER, all of them MAX_REGISTERED_DESTINATIONS: past either, the least
        recently seen registration that is not live (of that address, or of any) makes room, and if all
        are live, False: not registered."""
        now = time.monotonic()
        if dest in self.destinations:  # seen again; still its first registrant's
            self.destinations[dest].seen = now
            self.destinations.move_to_end(dest)
            return True
        mine = [d for d, r in self.destinations.items() if r.peer == peer]
        if len(mine) >= MAX_DESTINATIONS_PER_PEER:
            candidates = mine
        elif len(self.destinations) >= MAX_REGISTERED_DESTINATIONS:
            candidates = list(self.destinations)
        else:
            candidates = None
        if candidates is not None:
            in_flight = {call.kv_dest for call in self.callers.values()}
            in_flight |= {rank.dest for call in self.callers.values() for rank in call.kv_ranks}
            victim = next((d for d in candidates
                           if d not in in_flight and now - self.destinations[d].seen >= REGISTRATION_LIVE_S), None)
            if victim is None:
                return False
            del self.destinations[victim]
        self.destinations[dest] = Registration(peer, now)
        return True

    def is_registered(self, dest: tuple[str, int]) -> bool:
        """Whether KV may go to `dest`; a registered one counts as seen now (a Prefill names it)."""
        registration = self.destinations.get(dest)
        if registration is None:
            return False
        registration.seen = time.monotonic()
        self.destinations.move_to_end(dest)
        return True

    def progress(self, request_id: str) -> PrefillProgress:
        """A heartbeat: the engine's steps and the prompt tokens whose KV was handed out (each
        chunk's once its last layer has run; both only grow), and the step running now, if any, with
        how long it should take: a chunk that takes longer than the caller's no-progress limit (a
        long one on a CPU) is progress while it is within that."""
        sender = self.senders.get(request_id)
        step = self.engine.running_step()
        seconds, expected = 0.0, 0.0
        if step is not None:
            seconds, prompt_tokens = step
            expected = self.cost.step_seconds(prompt_tokens) or 0.0
        return PrefillProgress(self.engine.stats.num_steps, sender.tokens_put if sender else 0, seconds, expected)

    def load(self) -> NodeLoad:
        """What a decode node weighs this node by (its Watch stream)."""
        stats = self.engine.stats
        return NodeLoad(stats.num_running, stats.num_waiting, stats.queued_prompt_tokens,
                        self.cost.tokens_per_second(), self.cost.base_seconds())

    async def abort(self, request_id: str, caller: tuple[str, int]) -> bool:
        """Drop a request, only for the decode node (by its pipe endpoint) that asked for it."""
        call = self.callers.get(request_id)
        in_engine = call is not None and call.kv_dest == caller and await self.engine.abort(request_id)
        entries = self.rank_entries.get(request_id) or [RankEntry(request_id, caller, None)]
        if entries[0].dest != caller:
            return in_engine
        self.rank_entries.pop(request_id, None)
        in_buffer = [self.producer.abort(entry.entry_id, entry.dest) for entry in entries if entry.rank == 0]
        workers = worker_ranks(entries)
        in_workers = bool(workers) and await self.ranks.abort(request_id, workers)
        return in_engine or any(in_buffer) or in_workers


def layer_groups(num_layers: int) -> list[tuple[int, int]]:
    """[first, end) groups of a layer-wise entry: LAYER_PARTS alike, the last layer on its own."""
    step = -(-(num_layers - 1) // LAYER_PARTS) if num_layers > 1 else 1
    groups = [(first, min(first + step, num_layers - 1)) for first in range(0, num_layers - 1, step)]
    return groups + [(num_layers - 1, num_layers)]
