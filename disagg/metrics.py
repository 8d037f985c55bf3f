"""Prometheus metrics of a node, served at /metrics."""

from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from disagg.engine.async_engine import AsyncEngine, EngineStats
from disagg.engine.engine import LLMEngine
from disagg.engine.kv_tiers.stats import Latencies, TierStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

REQUESTS = Counter("disagg_requests_total", "Requests finished, by how they ended", ["finish_reason"])
REQUEST_ERRORS = Counter("disagg_request_errors_total", "Requests refused or failed, by HTTP status", ["status"])
TTFT = Histogram("disagg_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS)
ITL = Histogram("disagg_inter_token_latency_seconds", "Time between output tokens", buckets=LATENCY_BUCKETS)
E2E = Histogram("disagg_e2e_request_latency_seconds", "Request latency, end to end", buckets=LATENCY_BUCKETS)
PROMPT_TOKENS = Counter("disagg_prompt_tokens_total", "Prompt tokens received")
GENERATION_TOKENS = Counter("disagg_generation_tokens_total", "Tokens generated")
KV_BYTES = Counter("disagg_kv_transfer_bytes_total", "KV bytes on the pipes, counted as each message (a whole "
                   "prompt's KV, or one layer's) is sent or received", ["direction"])
KV_TRANSFER = Histogram("disagg_kv_transfer_seconds", "Prefill call to KV loaded, on the decode node",
                        buckets=LATENCY_BUCKETS)
# The KV handoff, step by step, so that the split of a disaggregated TTFT comes from /metrics alone.
# Decode node:
REMOTE_PREFILL_CALL = Histogram("disagg_remote_prefill_call_seconds", "Prefill call, sent to answered",
                                buckets=LATENCY_BUCKETS)
KV_LOOKUP_WAIT = Histogram("disagg_kv_lookup_wait_seconds", "Prefill answered to its KV off the pipe",
                           buckets=LATENCY_BUCKETS)
KV_ENTRY_RECEIVE = Histogram("disagg_kv_entry_receive_seconds", "An entry's header received to its last part in "
                             "hand, on the receiver thread (layer-wise: from the first layer group computed)",
                             buckets=LATENCY_BUCKETS)
KV_LOAD = Histogram("disagg_kv_load_seconds", "Received KV into the engine's blocks", buckets=LATENCY_BUCKETS)
FIRST_TOKEN_DELAY = Histogram("disagg_first_token_delay_seconds",
                              "KV in hand to the first token handed out (it does not wait for the load)",
                              buckets=LATENCY_BUCKETS)
# Prefill node:
PREFILL_COMPUTE = Histogram("disagg_prefill_compute_seconds", "A Prefill call's engine time, its queue included",
                            buckets=LATENCY_BUCKETS)
KV_BUFFER_INSERT = Histogram("disagg_kv_buffer_insert_seconds", "Opening a prompt's entry in the lookup buffer "
                             "before its prefill runs: the wait for buffer space", buckets=LATENCY_BUCKETS)
KV_PART_SEND = Histogram("disagg_kv_part_send_seconds", "One KV message (a layer part, or a whole prompt's KV) "
                         "handed to the pipe until sent (a GPU part over NCCL: until its transfer is queued)",
                         buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))
PREFILL_ROUTE = Counter("disagg_prefill_route_total", "Prompts a decode node computed itself (local) or got "
                        "from a prefill node (remote)", ["route"])
REMOTE_PREFILL = Counter("disagg_remote_prefill_total", "Remote prefills, by outcome",
                         ["outcome"])  # ok, recomputed, failed
KV_BLOCKS_USED = Gauge("disagg_kv_blocks_used", "KV cache blocks in use")
KV_BLOCKS_TOTAL = Gauge("disagg_kv_blocks_total", "KV cache blocks in all")
BUFFER_ENTRIES = Gauge("disagg_lookup_buffer_entries", "Entries held in the lookup buffer")
BUFFER_BYTES = Gauge("disagg_lookup_buffer_bytes", "Bytes held in the lookup buffer")
REQUESTS_RUNNING = Gauge("disagg_num_requests_running", "Requests in the engine's running batch")
REQUESTS_WAITING = Gauge("disagg_num_requests_waiting", "Requests waiting for blocks, their turn, or their KV")
KV_CACHE_USAGE = Gauge("disagg_kv_cache_usage", "Fraction of the KV cache blocks in use (0 to 1)")


def engine_gauges(stats: EngineStats) -> None:
    """The engine's gauges as of its last step (set at each scrape)."""
    KV_BLOCKS_TOTAL.set(stats.num_blocks)
    KV_BLOCKS_USED.set(stats.num_blocks - stats.num_free_blocks)
    KV_CACHE_USAGE.set((stats.num_blocks - stats.num_free_blocks) / max(1, stats.num_blocks))
    REQUESTS_RUNNING.set(stats.num_running)
    REQUESTS_WAITING.set(stats.num_waiting)


class EngineErrors(Collector):
    """Requests the engine failed, counted by the engine thread (EngineStats) and read at each scrape."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("disagg_engine_request_errors", "Requests the engine failed (their sampling or "
                                  "their step's forward raised)", value=self.engine.stats.num_request_errors)


def register_engine(engine: AsyncEngine) -> None:
    _register_once("engine_errors", lambda: EngineErrors(engine))


def kv_sent(nbytes: int, seconds: float) -> None:
    """A prefill node's producer sent one KV message."""
    KV_BYTES.labels("sent").inc(nbytes)
    KV_PART_SEND.observe(seconds)


# vLLM's names for the same series (counters without _total), so that dashboards, autoscalers and
# `vllm bench` scrapers built for vLLM read ours; each also gets vLLM's model_name label.
VLLM_NAMES = {
    "vllm:num_requests_running": REQUESTS_RUNNING,
    "vllm:num_requests_waiting": REQUESTS_WAITING,
    "vllm:kv_cache_usage_perc": KV_CACHE_USAGE,  # a fraction despite the name, as in vLLM
    "vllm:time_to_first_token_seconds": TTFT,
    "vllm:inter_token_latency_seconds": ITL,
    "vllm:e2e_request_latency_seconds": E2E,
    "vllm:prompt_tokens": PROMPT_TOKENS,
    "vllm:generation_tokens": GENERATION_TOKENS,
}


class VLLMNames(Collector):
    """Our metrics again under vLLM's names, read at each scrape: nothing is counted twice."""

    def __init__(self, model_name: str):
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for name, source in VLLM_NAMES.items():
            for family in source.collect():
                renamed = Metric(name, family.documentation, family.type)
                for s in family.samples:
                    renamed.add_sample(name + s.name.removeprefix(family.name),
                                       {**s.labels, "model_name": self.model_name}, s.value, s.timestamp, s.exemplar)
                yield renamed


def register_vllm_names(model_name: str) -> None:
    """Serve the vLLM names too (once per process)."""
    _register_once("vllm_names", lambda: VLLMNames(model_name))


class KVTiers(Collector):
    """The engine's KV tiers (device pool, host, disk: docs/ARCHITECTURE.md, "Engine (as built)"),
    read from its counters at each scrape. The engine thread keeps them; a scrape reads numbers and
    list lengths only, so it never waits for a step."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        bm, offload = self.engine.block_manager, self.engine.offload
        in_flight = offload.blocks_in_flight() if offload else 0
        tiers: dict[str, tuple[TierStats, int, int, int]] = {  # stats, blocks total, used, in flight
            "device": (bm.stats, bm.num_blocks, bm.num_blocks - bm.num_free_blocks, in_flight)}
        if offload is not None:
            tiers["host"] = (offload.host.stats, offload.host.num_blocks, offload.host.num_used, in_flight)
            if offload.disk is not None:
                disk = offload.disk
                tiers["disk"] = (disk.stats, disk.max_files, len(disk.files), disk.num_in_flight)
        families = {
            "blocks_total": GaugeMetricFamily("disagg_kv_tier_blocks_total", "KV blocks a tier holds at most",
                                              labels=["tier"]),
            "blocks_used": GaugeMetricFamily("disagg_kv_tier_blocks_used", "KV blocks held in a tier", labels=["tier"]),
            "in_flight": GaugeMetricFamily("disagg_kv_tier_blocks_in_flight", "KV blocks being copied into or out "
                                           "of a tier (disk: files being written, read or deleted)", labels=["tier"]),
            "lookups": CounterMetricFamily("disagg_kv_tier_lookups", "Blocks looked up in a tier (the hits and "
                                           "the miss that ends a prefix)", labels=["tier"]),
            "hits": CounterMetricFamily("disagg_kv_tier_hits", "Blocks found in a tier", labels=["tier"]),
            "offloaded": CounterMetricFamily("disagg_kv_tier_offloaded_bytes", "KV bytes copied into a tier",
                                             labels=["tier"]),
            "loaded": CounterMetricFamily("disagg_kv_tier_loaded_bytes", "KV bytes copied out of a tier toward "
                                          "the device", labels=["tier"]),
            "evictions": CounterMetricFamily("disagg_kv_tier_evictions", "Blocks a tier dropped for room",
                                             labels=["tier"]),
            "rejected": CounterMetricFamily("disagg_kv_tier_rejected_files", "Disk files found corrupt, truncated "
                                            "or foreign when read, and not loaded", labels=["tier"]),
            "offload_seconds": HistogramMetricFamily("disagg_kv_tier_offload_seconds", "Blocks copied into a tier "
                                                     "together (host: one batch of copies; disk: one file)",
                                                     labels=["tier"]),
            "load_seconds": HistogramMetricFamily("disagg_kv_tier_load_seconds", "Blocks copied out of a tier "
                                                  "together (host: one batch of copies; disk: one file)",
                                                  labels=["tier"]),
        }
        for tier, (stats, total, used, flying) in tiers.items():
            families["blocks_total"].add_metric([tier], total)
            families["blocks_used"].add_metric([tier], used)
            families["in_flight"].add_metric([tier], flying)
            for name in ("lookups", "hits", "evictions", "rejected"):
                families[name].add_metric([tier], getattr(stats, name))
            families["offloaded"].add_metric([tier], stats.offloaded_bytes)
            families["loaded"].add_metric([tier], stats.loaded_bytes)
            if tier != "device":
                families["offload_seconds"].add_metric([tier], *histogram(stats.offload_latency))
                families["load_seconds"].add_metric([tier], *histogram(stats.load_latency))
        yield from families.values()
        allocation = HistogramMetricFamily("disagg_kv_block_allocation_seconds",
                                           "Blocks for one admitted request taken from the device pool")
        allocation.add_metric([], *histogram(bm.allocation_latency))
        yield allocation


def histogram(latencies: Latencies) -> tuple[list[tuple[str, float]], float]:
    """Prometheus buckets (cumulative, ending with +Inf) and the sum."""
    counts, total = list(latencies.counts), 0
    buckets = []
    for le, count in zip((*map(str, latencies.buckets), "+Inf"), counts):
        total += count
        buckets.append((le, total))
    return buckets, latencies.total


def register_kv_tiers(engine: LLMEngine) -> None:
    """Serve the engine's KV tier metrics (once per process: one engine per node)."""
    _register_once("kv_tiers", lambda: KVTiers(engine))


_registered: set[str] = set()  # collectors registered in this process: registering one twice raises


def _register_once(name: str, make: Callable[[], Collector]) -> None:
    if name not in _registered:
        _registered.add(name)
        REGISTRY.register(make())
