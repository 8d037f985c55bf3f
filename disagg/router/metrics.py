"""The router's Prometheus metrics, at its /metrics: ours as disagg_router_*, and the same numbers
again under the names vLLM's router (github.com/vllm-project/router) gives them, vllm_router_*, so
that what was built to watch it reads ours. The router's own registry: it serves only its own
metrics, never an engine's (it runs none)."""

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

REGISTRY = CollectorRegistry()
# vLLM's router's buckets for every *_duration_seconds histogram: a streamed answer takes minutes.
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0, 45.0, 60.0,
                    90.0, 120.0, 180.0, 240.0)

# Per decode node.
REQUESTS = Counter("disagg_router_requests_total", "Requests sent to each decode node (a retry sends one again)",
                   ["decode_node"], registry=REGISTRY)
UPSTREAM_ERRORS = Counter("disagg_router_upstream_errors_total",
                          "Requests a decode node could not take or broke off", ["decode_node"], registry=REGISTRY)
OUTSTANDING = Gauge("disagg_router_outstanding_requests", "Requests in flight on each decode node",
                    ["decode_node"], registry=REGISTRY)
HEALTHY = Gauge("disagg_router_decode_node_healthy", "1 while the decode node passes its health checks",
                ["decode_node"], registry=REGISTRY)
MATCHED_BLOCKS = Counter("disagg_router_matched_blocks_total", "Prompt KV blocks the decode node held when "
                         "cache_aware routing sent it the request (from its KV events)", ["decode_node"],
                         registry=REGISTRY)
# Per route: the path a client called, one of those the router passes on.
RECEIVED = Counter("disagg_router_received_requests_total", "Requests the router received, by route", ["route"],
                   registry=REGISTRY)
DURATION = Histogram("disagg_router_request_duration_seconds", "A request through the router, received to the "
                     "last byte of its answer", ["route"], buckets=DURATION_BUCKETS, registry=REGISTRY)
RETRIES = Counter("disagg_router_retries_total", "Requests sent to another decode node, the one before unreachable "
                  "or down before it answered", ["route"], registry=REGISTRY)
ERRORS = Counter("disagg_router_request_errors_total", "Requests that got no answer from a decode node: none could "
                 "take them (no_healthy_node, answered 503) or the one answering broke off (upstream)",
                 ["route", "error_type"], registry=REGISTRY)


def worker(decode_node: str) -> str:
    """vLLM's router labels a worker with its URL."""
    return f"http://{decode_node}"


class VLLMRouterNames(Collector):
    """Our metrics again under vLLM's router's names and labels (`worker` for `decode_node`), read
    at each scrape: nothing is counted twice."""

    NAMES = {  # theirs: ours
        "vllm_router_requests": RECEIVED,
        "vllm_router_request_duration_seconds": DURATION,
        "vllm_router_request_errors": ERRORS,
        "vllm_router_retries": RETRIES,
        "vllm_router_processed_requests": REQUESTS,
        "vllm_router_running_requests": OUTSTANDING,
        "vllm_router_worker_load": OUTSTANDING,  # the load its least-load policies compare: requests in flight
        "vllm_router_worker_health": HEALTHY,
    }

    def collect(self) -> Iterator[Metric]:
        for name, source in self.NAMES.items():
            (family,) = source.collect()
            metric = Metric(name, family.documentation, family.type)
            for s in family.samples:
                labels = {("worker" if k == "decode_node" else k): (worker(v) if k == "decode_node" else v)
                          for k, v in s.labels.items()}
                metric.add_sample(name + s.name.removeprefix(family.name), labels, s.value, s.timestamp, s.exemplar)
            yield metric
        (health,) = HEALTHY.collect()
        yield GaugeMetricFamily("vllm_router_active_workers", "Number of currently active workers",
                                value=sum(s.value for s in health.samples))


REGISTRY.register(VLLMRouterNames())
