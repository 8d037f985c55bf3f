"""KVArrival: where a waiting sequence's KV can come from instead of being computed here.

Two sources implement it: the KV tiers (a prefix found in host memory or on disk, copied into
the sequence's blocks) and remote prefill (a decode node's prompt KV and first token, computed by
a prefill node). The scheduler consults them when it gives a waiting sequence its blocks
(`start`), keeps a sequence whose KV is still on its way in the waiting queue with status
WAITING_FOR_KV (holding its blocks, counted in max_num_seqs), and lets it run once no source has
it `pending`. The engine `poll`s them before each schedule (docs/ARCHITECTURE.md, "Arriving KV").
"""

from abc import ABC, abstractmethod

from disagg.engine.sequence import Sequence


class KVArrival(ABC):
    def blocked(self, seq: Sequence) -> bool:
        """The sequence should not get blocks yet (its prefix is arriving for another request)."""
        return False

    @abstractmethod
    def start(self, seq: Sequence) -> None:
        """The sequence just got its blocks (seq.num_cached_tokens: its device prefix-cache hits,
        then those of the sources before this one): start bringing what this source holds of the
        KV after them."""

    @abstractmethod
    def pending(self, seq: Sequence) -> bool:
        """Some of the sequence's KV from this source has not arrived in its blocks yet."""

    @abstractmethod
    def poll(self) -> None:
        """Take in what arrived (on the engine thread, before each schedule)."""
