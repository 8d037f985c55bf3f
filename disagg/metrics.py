"""Prometheus metrics of a node, served at /metrics."""

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

REQUESTS = Counter("disagg_requests_total", "Requests finished, by how they ended", ["finish_reason"])
REQUEST_ERRORS = Counter("disagg_request_errors_total", "Requests refused or failed, by HTTP status", ["status"])
ENGINE_REQUEST_ERRORS = Counter("disagg_engine_request_errors_total",
                                "Requests the engine failed (their sampling or their step's forward raised)")
TTFT = Histogram("disagg_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS)
ITL = Histogram("disagg_inter_token_latency_seconds", "Time between output tokens", buckets=LATENCY_BUCKETS)
E2E = Histogram("disagg_e2e_request_latency_seconds", "Request latency, end to end", buckets=LATENCY_BUCKETS)
PROMPT_TOKENS = Counter("disagg_prompt_tokens_total", "Prompt tokens received")
GENERATION_TOKENS = Counter("disagg_generation_tokens_total", "Tokens generated")
KV_BYTES = Counter("disagg_kv_transfer_bytes_total", "KV bytes moved between nodes", ["direction"])
KV_TRANSFER = Histogram("disagg_kv_transfer_seconds", "Prefill call to KV loaded, on the decode node",
                        buckets=LATENCY_BUCKETS)
REMOTE_PREFILL = Counter("disagg_remote_prefill_total", "Remote prefills, by outcome",
                         ["outcome"])  # ok, recomputed, failed
KV_BLOCKS_USED = Gauge("disagg_kv_blocks_used", "KV cache blocks in use")
KV_BLOCKS_TOTAL = Gauge("disagg_kv_blocks_total", "KV cache blocks in all")
BUFFER_ENTRIES = Gauge("disagg_lookup_buffer_entries", "Entries held in the lookup buffer")
BUFFER_BYTES = Gauge("disagg_lookup_buffer_bytes", "Bytes held in the lookup buffer")
