"""LayerSender: a prefill rank's KV of one request, put into the producer entries it sends.

Each layer group's KV goes into the rank's open entries (one per decode rank, each with the heads it
takes) as soon as those layers have run (docs/ARCHITECTURE.md, "Layer-wise send"), and the prompt's
first token, once sampled, behind the KV of the first (to the decode node's rank 0). The driver's runs
in the node's process; under tensor parallelism each worker rank's runs in its own (rank_send.py).
"""

import dataclasses
from collections.abc import Callable

import torch

from disagg.engine.sequence import TokenLogprob
from disagg.lookup_buffer import FirstToken, LookupBufferProducer


@dataclasses.dataclass(frozen=True)
class RankEntry:
    """One producer entry of a request's KV: to one decode rank, with KV heads [first, end) (None: every
    head, to a decode node that takes them all on one endpoint), sent by prefill rank `rank`."""
    entry_id: str
    dest: tuple[str, int]
    heads: tuple[int, int] | None
    rank: int = 0


def worker_ranks(entries: list[RankEntry]) -> list[int]:
    """The worker ranks (1 on) that send some of these entries, in order."""
    return sorted({entry.rank for entry in entries if entry.rank > 0})


class LayerSender:
    """A KVExport's put for one request on one rank: each layer group's KV into the producer's open
    entries, copied to pinned host memory on a stream of its own unless the buffer is on the GPU. Runs
    on the engine thread and never waits for the GPU."""

    def __init__(self, producer: LookupBufferProducer, entries: list[RankEntry], num_layers: int,
                 copy_stream: torch.cuda.Stream | None, first_head: int = 0,
                 on_put: Callable[[int], None] = lambda nbytes: None):
        """first_head: the first KV head of the KV a put gets (a rank's own heads start at its first);
        on_put(nbytes) counts the KV bytes each put hands to the producer."""
        self.producer = producer
        self.entries = entries
        self.num_layers = num_layers
        self.copy_stream = copy_stream  # None: the KV stays where the engine computed it
        self.first_head = first_head
        self.on_put = on_put
        self.tokens_put = 0  # of every layer, to every entry

    def put(self, first: int, end: int, kv: torch.Tensor) -> None:
        ready = None
        if kv.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(kv.device))  # after these layers' KV (gathered or a rank's own)
        sent = True
        for entry in self.entries:
            part, part_ready = kv, ready
            if entry.heads is not None:  # a rank's heads, copied below: the pipe sends contiguous tensors
                part = kv[:, :, :, entry.heads[0] - self.first_head:entry.heads[1] - self.first_head]
            if kv.is_cuda and self.copy_stream is not None:
                host = torch.empty(part.shape, dtype=kv.dtype, pin_memory=True)
                with torch.cuda.stream(self.copy_stream):
                    self.copy_stream.wait_event(ready)
                    host.copy_(part, non_blocking=True)
                    kv.record_stream(self.copy_stream)  # its memory is not reused before the copy ends
                    part_ready = torch.cuda.Event()
                    part_ready.record()
                part = host
            elif entry.heads is not None:
                part = part.contiguous()
                if kv.is_cuda:
                    part_ready = torch.cuda.Event()
                    part_ready.record(torch.cuda.current_stream(kv.device))
            put = self.producer.put(entry.entry_id, first, end, part, part_ready)  # False: aborted
            if put:
                self.on_put(part.nbytes)
            sent = put and sent
        if sent and end == self.num_layers:
            self.tokens_put += kv.shape[2]

    def first_token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        """The driver's KVExport.first_token: the token behind the KV of the first entry, which was opened
        to carry it."""
        top = [] if logprob is None else list(logprob.top)
        self.producer.put_first_token(self.entries[0].entry_id,
                                      FirstToken(token_id, None if logprob is None else logprob.logprob, top))
