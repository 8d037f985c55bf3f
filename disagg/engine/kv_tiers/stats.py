"""Counters of the KV tiers, kept by the engine and read by the node's /metrics at scrape time
(the engine imports nothing outside disagg/engine, so it cannot hold Prometheus objects)."""

import bisect
from dataclasses import dataclass, field

# Seconds: a block copy takes tens of microseconds to a few milliseconds, a disk read longer.
TIER_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass
class Latencies:
    """A histogram: counts per bucket (the last one is +Inf, not cumulative) and the sum."""
    buckets: tuple[float, ...] = TIER_LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(TIER_LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.total += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass
class TierStats:
    """One tier. A lookup is one block asked for: the hits, and the miss that ends a prefix walk."""
    lookups: int = 0
    hits: int = 0
    offloaded_bytes: int = 0  # into this tier
    loaded_bytes: int = 0  # out of this tier, toward the device
    evictions: int = 0
    rejected: int = 0  # disk: files found corrupt, truncated or foreign at read, and not loaded
    offload_latency: Latencies = field(default_factory=Latencies)
    load_latency: Latencies = field(default_factory=Latencies)
