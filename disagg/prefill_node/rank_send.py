"""A prefill node's tensor-parallel ranks sending their own KV heads (docs/ARCHITECTURE.md, "Tensor
parallelism").

Each worker rank runs a lookup-buffer producer of its own in its process (`serve_rank`, the engine's
`rank_service`). For a prompt whose KV goes to a decode node's ranks, the driver (rank 0, where the
prefill node runs) opens each worker's entries (`plan_entries`: the heads it sends each decode rank)
before the engine computes the prompt; during each step that computes it, each rank puts its own KV
heads of each layer group into its entries (the ExportPut serve_rank returns; KVExport.own_heads), so
no rank's KV passes through another process. Once the prompt is computed the driver asks each worker
how many tokens it put (Finish: a worker's puts of a step come before the step's last collective, so
before the driver's step ends), and undoes a failed request on every worker (Abort).
"""

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagg import metrics
from disagg.config import KVTransferConfig
from disagg.lookup_buffer import BufferFullError, LookupBufferProducer
from disagg.pipes.base import PipeConfig
from disagg.prefill_node.layer_sender import LayerSender, RankEntry
from disagg.rank_calls import QUICK_CALL_S, Call, RankCallFailed, RankCalls, answer_calls

logger = logging.getLogger(__name__)


@dataclass
class Open:
    """Open these entries of the request (their room reserved, as the driver's own are), of the KV of
    `tokens` tokens in layer groups `layers`; the rank's own KV heads begin at `first_head`."""
    request_id: str
    entries: list[RankEntry]
    sizes: list[int]  # each entry's bytes
    token_ids: list[int]
    layers: list[tuple[int, int]]
    tokens: int
    first_head: int


@dataclass
class Finish:
    """The request is computed: how many of its tokens the rank put into every entry (it forgets it)."""
    request_id: str


@dataclass
class Abort:
    """Abort the request's entries (those still being opened, once they are)."""
    request_id: str


@dataclass
class Reply:
    number: int
    put_bytes: int  # KV bytes the rank has put into its entries, in all so far
    sent_bytes: int  # KV bytes its producer has sent, in all so far
    error: str | None = None
    tokens_put: int = 0  # Finish
    full: bool = False  # Open: the rank's buffer stayed full for insert_timeout (BufferFullError)
    aborted: bool = False  # Abort: an entry was still held


def rank_service_for(kv: KVTransferConfig) -> Callable:
    """The engine's rank_service for a prefill node with these pipe settings (picklable: it goes to each
    worker's process)."""
    return functools.partial(serve_rank, kv.kv_connector, kv.pipe_config(), int(kv.kv_buffer_size),
                             kv.extra("buffer_ttl"), kv.extra("insert_timeout"), kv.kv_buffer_device)


def serve_rank(pipe_name: str, config: PipeConfig, kv_buffer_size: int, ttl: float, insert_timeout: float,
               kv_buffer_device: str, rank: int, kv_cache, channel) -> Callable[[str, int, int, torch.Tensor], None]:
    """The engine's rank_service on a worker rank (bound to the node's pipe settings with partial): a
    producer of its own (named by the node's pipe endpoint, as the driver's is: it listens on nothing,
    and as large), one thread answering the driver's calls, and the put the rank's exports call."""
    sent = [0]

    def count(nbytes: int, seconds: float) -> None:
        sent[0] += nbytes

    # Named as the driver's producer is (the decode node knows one name per prefill node): a connection of
    # this one that breaks fails the lookups of the driver's entries in flight too; one it closes idle says bye.
    producer = LookupBufferProducer(pipe_name, config, kv_buffer_size, ttl, insert_timeout, on_sent=count)
    copy_stream = None
    if kv_cache.kv.is_cuda and kv_buffer_device == "cpu":
        copy_stream = torch.cuda.Stream(kv_cache.kv.device)
    sender = RankSender(producer, kv_cache.kv.shape[0], copy_stream, channel, sent)
    threading.Thread(target=sender.serve, name=f"kv-send-rank{rank}", daemon=True).start()
    logger.info("tensor-parallel rank %d sends its own KV heads", rank)
    return sender.put


class RankSender:
    """A worker's side: the driver's calls onto its producer, and the rank's puts into its entries."""

    def __init__(self, producer: LookupBufferProducer, num_layers: int, copy_stream: torch.cuda.Stream | None,
                 channel, sent: list[int]):
        self.producer = producer
        self.num_layers = num_layers
        self.copy_stream = copy_stream
        self.channel = channel
        self.sent = sent  # [bytes], counted by the producer's sender threads
        self.put_bytes = 0  # on the rank's step thread
        self.senders: dict[str, LayerSender] = {}  # request id -> its open entries
        self.opening: set[str] = set()  # requests whose entries are being opened
        self.cancelled: set[str] = set()  # of those, aborted meanwhile: aborted once opened
        self.lock = threading.Lock()  # the three above
        self.reply_lock = threading.Lock()  # one reply at a time on the channel

    def put(self, request_id: str, first: int, end: int, kv: torch.Tensor) -> None:
        """The rank's KV heads of layers [first, end) of a request's prompt tokens (ExportPut)."""
        with self.lock:
            sender = self.senders.get(request_id)
        if sender is None:  # aborted
            return
        try:
            sender.put(first, end, kv)
        except Exception:
            for entry in sender.entries:  # its decode ranks hear at once; Finish tells the driver
                self.producer.abort(entry.entry_id)
            raise

    def _count(self, nbytes: int) -> None:
        self.put_bytes += nbytes

    def serve(self) -> None:
        answer_calls(self.channel, self._handle, self._failed, self.producer.close)

    def _failed(self, call: Call, e: Exception) -> None:
        self._reply(call.number, error=f"{type(e).__name__}: {e}")

    def _handle(self, call: Call) -> None:
        message = call.message
        if isinstance(message, Open):
            with self.lock:
                self.opening.add(message.request_id)
            try:
                threading.Thread(target=self._open, args=(call.number, message), daemon=True).start()
            except BaseException:
                with self.lock:
                    self.opening.discard(message.request_id)
                raise
        elif isinstance(message, Finish):
            with self.lock:
                sender = self.senders.pop(message.request_id, None)
            self._reply(call.number, tokens_put=sender.tokens_put if sender else 0)
        else:
            with self.lock:
                sender = self.senders.pop(message.request_id, None)
                opening = message.request_id in self.opening
                if opening:  # aborted by _open once they are open
                    self.cancelled.add(message.request_id)
            aborted = [self.producer.abort(e.entry_id, e.dest) for e in sender.entries] if sender else []
            self._reply(call.number, aborted=any(aborted) or opening)

    def _open(self, number: int, message: Open) -> None:
        """Opens the entries, waiting (bounded by insert_timeout) for room; on a thread of its own."""
        opened: list[RankEntry] = []
        error, full = None, False
        try:
            for entry, size in zip(message.entries, message.sizes):
                self.producer.open(entry.entry_id, message.token_ids, message.layers, message.tokens, size, entry.dest)
                opened.append(entry)
        except Exception as e:  # noqa: BLE001  why the entries cannot be opened goes to the driver
            error, full = f"{type(e).__name__}: {e}", isinstance(e, BufferFullError)
        with self.lock:
            self.opening.discard(message.request_id)
            cancelled = message.request_id in self.cancelled
            self.cancelled.discard(message.request_id)
            if error is None and not cancelled:
                self.senders[message.request_id] = LayerSender(self.producer, opened, self.num_layers,
                                                               self.copy_stream, message.first_head, self._count)
        if error is not None or cancelled:
            for entry in opened:
                self.producer.abort(entry.entry_id, entry.dest)
        self._reply(number, error=error or ("aborted while opening" if cancelled else None), full=full)

    def _reply(self, number: int, **fields) -> None:
        with self.reply_lock:
            try:
                self.channel.send(Reply(number, self.put_bytes, self.sent[0], **fields))
            except OSError:  # the driver is gone
                pass


class RankSenders:
    """The driver's side: each worker rank's sender, by the channel the engine opened to it."""

    def __init__(self, channels: list, kv_heads: list[tuple[int, int]], insert_timeout: float):
        """channels: rank r's at index r - 1; kv_heads: every rank's [first, end), rank 0's first;
        insert_timeout: how long a worker waits for room for one entry (its producer's)."""
        self.kv_heads = kv_heads
        self.insert_timeout = insert_timeout
        self.put = [0] * len(channels)  # bytes each worker reported, counted into the metrics
        self.sent = [0] * len(channels)
        self.calls = RankCalls(channels, self._count)
        self.calls.start()

    async def open(self, request_id: str, entries: list[RankEntry], sizes: list[int], token_ids: list[int],
                   layers: list[tuple[int, int]], tokens: int) -> None:
        """Each worker opens its entries (those with its rank) of the request; on failure none stays open.
        Raises BufferFullError where a worker's buffer stayed full, as the driver's own open does."""
        by_rank: dict[int, tuple[list[RankEntry], list[int]]] = {}
        for entry, size in zip(entries, sizes):
            if entry.rank > 0:
                mine = by_rank.setdefault(entry.rank, ([], []))
                mine[0].append(entry)
                mine[1].append(size)
        most = max((len(mine) for mine, _ in by_rank.values()), default=0)
        try:
            await self.calls.each({rank: Open(request_id, mine, mine_sizes, token_ids, layers, tokens,
                                              self.kv_heads[rank][0])
                                   for rank, (mine, mine_sizes) in by_rank.items()},
                                  most * self.insert_timeout + QUICK_CALL_S)
        except BaseException as e:
            await asyncio.shield(self.abort(request_id, list(by_rank)))
            if isinstance(e, RankCallFailed) and e.reply.full:
                raise BufferFullError(str(e)) from None
            raise

    async def finish(self, request_id: str, ranks: list[int]) -> dict[int, int]:
        """Each of these workers' tokens of the request put into every entry of its own, by rank."""
        replies = await self.calls.each({rank: Finish(request_id) for rank in ranks}, QUICK_CALL_S)
        return {rank: reply.tokens_put for rank, reply in replies.items()}

    async def abort(self, request_id: str, ranks: list[int]) -> bool:
        """These workers abort the request's entries; True if one still held one. A rank gone holds none."""
        replies = await asyncio.gather(*(self.calls.call(rank, Abort(request_id), QUICK_CALL_S) for rank in ranks),
                                       return_exceptions=True)
        return any(isinstance(reply, Reply) and reply.aborted for reply in replies)

    def _count(self, rank: int, reply: Reply) -> None:
        put, self.put[rank - 1] = reply.put_bytes - self.put[rank - 1], reply.put_bytes
        sent, self.sent[rank - 1] = reply.sent_bytes - self.sent[rank - 1], reply.sent_bytes
        metrics.KV_RANK_SENT_BYTES.labels(str(rank)).inc(put)
        metrics.KV_BYTES.labels("sent").inc(sent)  # a worker's producer's, as of its last reply
