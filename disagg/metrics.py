"""Prometheus metrics of a node, served at /metrics: ours as disagg_*, and the same numbers again
under vLLM's names (vllm:*), so that vLLM's dashboards, autoscalers and scrapers read ours."""

from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from disagg.engine.async_engine import AsyncEngine, EngineStats
from disagg.engine.engine import LLMEngine
from disagg.engine.kv_tiers.stats import Latencies, TierStats
from disagg.engine.request_stats import (
    EXTERNAL_KV_TRANSFER,
    LOCAL_CACHE_HIT,
    PROMPT_SOURCES,
    FinishedRequest,
    IterationStats,
)

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
KV_RANK_BYTES = Counter("disagg_kv_rank_received_bytes_total", "KV bytes a decode node's tensor-parallel rank "
                        "received on its own pipe endpoint (rank 0's: every entry its consumer took); a worker "
                        "rank's are counted as it reports them, with each lookup's answer", ["rank"])
KV_RANK_SENT_BYTES = Counter("disagg_kv_rank_sent_bytes_total", "KV bytes a prefill node's tensor-parallel "
                             "rank put into its own entries to decode nodes, as each layer group is put (every "
                             "head where one rank sends them all); a worker rank's are counted as it reports "
                             "them, at the end of each prefill", ["rank"])
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
SEND_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
KV_PART_SEND = Histogram("disagg_kv_part_send_seconds", "One KV message (a layer part, or a whole prompt's KV) "
                         "handed to the pipe until sent (a GPU part over NCCL: until its transfer is queued)",
                         buckets=SEND_BUCKETS)
FIRST_TOKEN_SEND = Histogram("disagg_first_token_send_seconds", "A prompt's first token, sampled and put behind its "
                             "KV, until sent on the pipe (its wait for the sender thread included)",
                             buckets=SEND_BUCKETS)
# Prefix pull between prefill nodes (prefill_node/pull.py): the puller's outcomes and blocks, the holder's blocks sent.
PREFIX_PULLS = Counter("disagg_prefix_pulls_total", "Prefix pulls a prefill node tried on a hint, by outcome: "
                       "pulled, failed (the blocks were computed), not_worth (computing them was estimated "
                       "cheaper)", ["outcome"])
PREFIX_PULLED_BLOCKS = Counter("disagg_prefix_pulled_blocks_total", "Prefix blocks pulled from other prefill "
                               "nodes into this node's prefix cache")
PREFIX_FETCHED_BLOCKS = Counter("disagg_prefix_fetched_blocks_total", "Prefix blocks this node sent to other "
                                "prefill nodes that pulled them (FetchBlocks)")
PREFILL_ROUTE = Counter("disagg_prefill_route_total", "Prompts a decode node computed itself (local) or got "
                        "from a prefill node (remote)", ["route"])
PREFILL_ROUTE_BASIS = Counter("disagg_prefill_route_basis_total", "How a decode node chose where a prompt is "
                              "computed: policy (remote_prefill always or never, or prompt logprobs), fallback "
                              "(local_prefill_max_tokens, before the costs were measured) or measured (the costs)",
                              ["basis"])
REMOTE_PREFILL = Counter("disagg_remote_prefill_total", "Remote prefills, by outcome",
                         ["outcome"])  # ok, recomputed, failed
PREFIX_WAITS = Counter("disagg_arriving_prefix_waits_total", "Prompts a decode node added while their prefix's "
                       "KV was arriving for another request, and that waited for it, by outcome: hit (it "
                       "landed and was reused) or missed (that request ended without it, or the wait's bound "
                       "passed)", ["outcome"])
PREFIX_WAIT_TOKENS = Counter("disagg_arriving_prefix_tokens_total", "Prompt tokens that waiting for an "
                             "arriving prefix found in the prefix cache: not asked of a prefill node again")
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


# vLLM's buckets where its dashboards draw the buckets themselves (heatmaps of request lengths) or
# compare them across servers; latencies keep LATENCY_BUCKETS, finer below 10 ms than vLLM's.
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_PARAMS_N = Histogram("disagg_request_params_n", "The n of each prompt of a finished request (one observation "
                             "for its n choices)", buckets=REQUEST_N_BUCKETS)
FINISH_REASONS = ("stop", "length", "abort", "error")  # the engine's, which are vLLM's


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class EngineMetrics(Collector):
    """What only the engine knows: its counters (EngineStats, read at each scrape) and each request's
    times and token counts, recorded from the IterationStats its thread hands over (`record`)."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.block_size = engine.block_size
        self.dtype = str(engine.dtype).removeprefix("torch.")
        self.prefix_caching = engine.enable_prefix_caching
        tokens = buckets_1_2_5(engine.max_model_len)

        def histogram(name: str, documentation: str, buckets) -> Histogram:
            return Histogram(name, documentation, buckets=buckets, registry=None)  # collected here

        self.finished = Counter("disagg_engine_finished_requests", "Engine requests finished (one per choice), "
                                "by how they ended", ["finish_reason"], registry=None)
        for reason in FINISH_REASONS:
            self.finished.labels(reason)
        self.prompt_tokens = Counter("disagg_engine_prompt_tokens", "Prompt tokens of the requests that got their "
                                     "first token, by where their KV came from: computed here (local_compute), this "
                                     "engine's prefix cache and KV tiers (local_cache_hit), a prefill node "
                                     "(external_kv_transfer)", ["source"], registry=None)
        for source in PROMPT_SOURCES:
            self.prompt_tokens.labels(source)
        self.step_tokens = histogram("disagg_engine_step_tokens", "Tokens of an engine step, as vLLM counts them: "
                                     "the prompts of the prefills it finished and the tokens it sampled",
                                     STEP_TOKEN_BUCKETS)
        self.queue_time = histogram("disagg_request_queue_time_seconds", "A request's wait for its first blocks",
                                    LATENCY_BUCKETS)
        self.prefill_time = histogram("disagg_request_prefill_time_seconds", "Blocks given to the first token (a "
                                      "remote prefill: the prefill node's work and the KV's way here)",
                                      LATENCY_BUCKETS)
        self.decode_time = histogram("disagg_request_decode_time_seconds", "First token to last", LATENCY_BUCKETS)
        self.inference_time = histogram("disagg_request_inference_time_seconds", "Blocks given to the last token",
                                        LATENCY_BUCKETS)
        self.time_per_output_token = histogram("disagg_request_time_per_output_token_seconds", "A request's decode "
                                               "time over its output tokens after the first", LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("disagg_request_prompt_tokens", "A finished request's prompt tokens",
                                               tokens)
        self.request_computed_tokens = histogram("disagg_request_computed_prompt_tokens", "A finished request's "
                                                 "prompt tokens computed here (neither cached nor received)", tokens)
        self.request_generation_tokens = histogram("disagg_request_generation_tokens", "A finished request's "
                                                   "output tokens", tokens)
        self.request_max_tokens = histogram("disagg_request_max_tokens", "A finished request's max_tokens", tokens)

    def record(self, stats: IterationStats) -> None:
        """On the engine thread, after each turn of its loop that did something."""
        if stats.step_tokens is not None:
            self.step_tokens.observe(stats.step_tokens)
        for source, count in stats.prompt_tokens.items():
            if count:
                self.prompt_tokens.labels(source).inc(count)
        for request in stats.finished:
            self._finished(request)

    def _finished(self, request: FinishedRequest) -> None:
        self.finished.labels(request.finish_reason).inc()
        self.queue_time.observe(request.queue_time)
        self.prefill_time.observe(request.prefill_time)
        self.decode_time.observe(request.decode_time)
        self.inference_time.observe(request.inference_time)
        if request.num_generation_tokens > 1:  # vLLM's: the first token is the prefill's
            self.time_per_output_token.observe(request.decode_time / (request.num_generation_tokens - 1))
        self.request_prompt_tokens.observe(request.num_prompt_tokens)
        self.request_computed_tokens.observe(request.num_computed_prompt_tokens)
        self.request_generation_tokens.observe(request.num_generation_tokens)
        self.request_max_tokens.observe(request.max_tokens)

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        yield CounterMetricFamily("disagg_engine_request_errors", "Requests the engine failed (their sampling or "
                                  "their step's forward raised)", value=stats.num_request_errors)
        yield CounterMetricFamily("disagg_engine_preemptions", "Running requests the engine sent back to the queue "
                                  "for want of blocks (recomputed later)", value=stats.num_preemptions)
        for metric in (self.finished, self.prompt_tokens, self.step_tokens, self.queue_time, self.prefill_time,
                       self.decode_time, self.inference_time, self.time_per_output_token, self.request_prompt_tokens,
                       self.request_computed_tokens, self.request_generation_tokens, self.request_max_tokens):
            yield from metric.collect()

    def vllm_families(self, labels: dict[str, str]) -> Iterator[Metric]:
        """The same numbers under vLLM's names, with its labels (model_name, engine)."""
        stats = self.engine.stats
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels,
                      stats.num_preemptions)
        by_source = {s.labels["source"]: s.value for s in samples(self.prompt_tokens, "_total")}
        cached = by_source[LOCAL_CACHE_HIT]
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, sum(by_source.values()))
        yield renamed("vllm:prompt_tokens_by_source", self.prompt_tokens, labels)
        yield counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).", labels,
                      cached + by_source[EXTERNAL_KV_TRANSFER])
        # vLLM queries the prefix cache for every prompt token of each request it schedules; a hit is a cached one.
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      labels, sum(by_source.values()))
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels,
                      cached)
        yield renamed("vllm:request_success", self.finished, labels, {"finish_reason": "finished_reason"})
        yield renamed("vllm:iteration_tokens_total", self.step_tokens, labels)
        yield renamed("vllm:request_queue_time_seconds", self.queue_time, labels)
        yield renamed("vllm:request_prefill_time_seconds", self.prefill_time, labels)
        yield renamed("vllm:request_decode_time_seconds", self.decode_time, labels)
        yield renamed("vllm:request_inference_time_seconds", self.inference_time, labels)
        yield renamed("vllm:request_time_per_output_token_seconds", self.time_per_output_token, labels)
        yield renamed("vllm:request_prompt_tokens", self.request_prompt_tokens, labels)
        yield renamed("vllm:request_prefill_kv_computed_tokens", self.request_computed_tokens, labels)
        yield renamed("vllm:request_generation_tokens", self.request_generation_tokens, labels)
        yield renamed("vllm:request_params_max_tokens", self.request_max_tokens, labels)
        # A request with n choices is n engine requests of one choice each: the longest choice's
        # output is its own (the API observes the request's n: REQUEST_PARAMS_N).
        yield renamed("vllm:request_max_num_generation_tokens", self.request_generation_tokens, labels)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks",
                                         "engine"])
        info.add_metric([str(self.block_size), self.dtype, str(self.prefix_caching), str(stats.num_blocks),
                         labels["engine"]], 1)
        yield info


def samples(metric: Counter | Histogram, suffix: str) -> list[Sample]:
    """A metric's samples of one kind (`_total`, `_count`, ...)."""
    return [s for family in metric.collect() for s in family.samples if s.name.endswith(suffix)]


def counter(name: str, documentation: str, labels: dict[str, str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def renamed(name: str, source: Collector, labels: dict[str, str], label_names: dict[str, str] | None = None) -> Metric:
    """`source`'s one family as `name`, its samples given `labels` too and their label names
    renamed by `label_names`."""
    (family,) = source.collect()
    metric = Metric(name, family.documentation, family.type)
    for s in family.samples:
        own = {(label_names or {}).get(k, k): v for k, v in s.labels.items()}
        metric.add_sample(name + s.name.removeprefix(family.name), {**own, **labels}, s.value, s.timestamp,
                          s.exemplar)
    return metric


def register_engine(engine: AsyncEngine) -> None:
    """Serve the engine's own numbers (once per process: one engine per node)."""
    metrics = _register_once("engine", lambda: EngineMetrics(engine))
    engine.stat_loggers.append(metrics.record)


def kv_sent(nbytes: int, seconds: float) -> None:
    """A prefill node's producer sent one KV message."""
    KV_BYTES.labels("sent").inc(nbytes)
    KV_PART_SEND.observe(seconds)


# vLLM's names for the series the API and the node keep (counters without _total); the engine's
# own are EngineMetrics.vllm_families.
VLLM_NAMES = {
    "vllm:num_requests_running": REQUESTS_RUNNING,
    "vllm:num_requests_waiting": REQUESTS_WAITING,
    "vllm:kv_cache_usage_perc": KV_CACHE_USAGE,  # a fraction despite the name, as in vLLM
    "vllm:gpu_cache_usage_perc": KV_CACHE_USAGE,  # its name before vLLM 0.9, which older dashboards query
    "vllm:time_to_first_token_seconds": TTFT,
    "vllm:inter_token_latency_seconds": ITL,
    "vllm:time_per_output_token_seconds": ITL,  # its older name, still in older dashboards
    "vllm:e2e_request_latency_seconds": E2E,
    "vllm:generation_tokens": GENERATION_TOKENS,
    "vllm:request_params_n": REQUEST_PARAMS_N,
}
VLLM_ENGINE_INDEX = "0"  # vLLM's `engine` label: the engine core's index, one per node here


class VLLMNames(Collector):
    """Our metrics again under vLLM's names, with its labels, read at each scrape: nothing is counted twice."""

    def __init__(self, model_name: str):
        self.labels = {"model_name": model_name, "engine": VLLM_ENGINE_INDEX}

    def collect(self) -> Iterator[Metric]:
        for name, source in VLLM_NAMES.items():
            yield renamed(name, source, self.labels)
        engine = _registered.get("engine")
        if engine is not None:
            yield from engine.vllm_families(self.labels)
        sleep = GaugeMetricFamily("vllm:engine_sleep_state", "Engine sleep state; awake = 0 means engine is "
                                  "sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep "
                                  "level 1; discard_all = 1 means sleep level 2.", labels=[*self.labels, "sleep_state"])
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):  # it never sleeps
            sleep.add_metric([*self.labels.values(), state], value)
        yield sleep


def register_vllm_names(model_name: str) -> None:
    """Serve the vLLM names too (once per process), labelled with the served model name."""
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


_registered: dict[str, Collector] = {}  # collectors registered in this process (registering one twice raises)


def _register_once(name: str, make: Callable[[], Collector]) -> Collector:
    if name not in _registered:
        _registered[name] = make()
        REGISTRY.register(_registered[name])
    return _registered[name]
