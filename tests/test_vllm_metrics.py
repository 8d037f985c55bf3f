"""vLLM's metric names on every node (issue 25), served from the same numbers as ours.

The dashboard test reads vLLM's published Grafana dashboard, tests/data/vllm_grafana.json: vLLM's
examples/observability/prometheus_grafana/grafana.json at commit 4b5c627c23e6690b8987100d1cbf78e34ac14bf9
of github.com/vllm-project/vllm, unchanged. Every metric its PromQL queries must be served, with the
labels it selects and groups by, and, on a node that served requests, hold data.
"""

import gzip
import json
import re
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from prometheus_client.samples import Sample
from servers import Node, metric_sum

from disagg.engine.async_engine import EngineStats
from disagg.engine.output import RequestOutput
from disagg.engine.request_stats import RequestStats
from disagg.engine.sampling_params import SamplingParams
from disagg.engine.sequence import Sequence, SequenceStatus
from disagg.metrics import EngineMetrics, buckets_1_2_5
from disagg.timeline import timeline

DASHBOARD = Path(__file__).parent / "data" / "vllm_grafana.json"
MODEL = "SmolLM2-135M-Instruct"  # the pair's served name: the embedded model's
# PromQL words that are not metric names (aggregations and functions are told apart by their "(").
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
                   "unless"}


@pytest.fixture(scope="module")
def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    assert len(exprs) == 27  # the file as fetched: 12 panels
    return exprs


def selectors(expr: str) -> list[tuple[str, dict[str, str], set[str]]]:
    """(metric name, the labels its matchers select, the labels the expression groups by) for each
    series the PromQL expression reads."""
    grouping = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
    labels_grouped = {label.strip() for group in grouping.findall(expr) for label in group.split(",") if label.strip()}
    bare = re.sub(r"\[[^\]]*\]", "", grouping.sub(" ", expr))  # no grouping clauses, no range durations
    found = []
    for match in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?", bare):
        name, matchers = match.group(1), match.group(2) or ""
        if name in PROMQL_KEYWORDS or bare[match.end():].lstrip().startswith("("):
            continue  # a keyword, or a function or aggregation
        labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"([^"]*)"', matchers))
        found.append((name, labels, labels_grouped))
    return found


def test_selectors_are_read_out_of_promql():
    expr = ('histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket'
            '{model_name="$model_name"}[$__rate_interval])))')
    assert selectors(expr) == [("vllm:e2e_request_latency_seconds_bucket", {"model_name": "$model_name"}, {"le"})]
    expr = 'rate(a_sum{m="x"}[$__rate_interval])\n/\nrate(a_count[5m])'
    assert [(n, labels) for n, labels, _ in selectors(expr)] == [("a_sum", {"m": "x"}), ("a_count", {})]


def missing_from(samples: list[Sample], exprs: list[str], with_data: bool) -> list[str]:
    """What the dashboard's expressions read that the samples lack (with_data: or hold no data in)."""
    missing = []
    for expr in exprs:
        for name, labels, grouping in selectors(expr):
            wanted = {k: MODEL if v == "$model_name" else v for k, v in labels.items()}
            series = [s for s in samples if s.name == name and wanted.items() <= s.labels.items()]
            if not series:
                missing.append(f"{name}{wanted}")
            elif not all(grouping <= s.labels.keys() for s in series):
                missing.append(f"{name} without the labels {sorted(grouping)}")
            elif with_data and not name.startswith(("vllm:num_requests_", "vllm:kv_cache_usage")) \
                    and not any(s.value > 0 for s in series):
                missing.append(f"{name} (no data)")
    return missing


def ask(node: Node) -> None:
    """A couple of requests: a completion and a streamed chat, of 4 output tokens each."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "ignore_eos": True}
    assert httpx.post(f"{node.url}/v1/completions", json=body, timeout=120).status_code == 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 4,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{node.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.read().endswith(b"data: [DONE]\n\n")


def test_every_metric_of_vllms_dashboard_is_served_on_both_nodes(pair_1p1d, dashboard_exprs):
    prefill, decode = pair_1p1d
    ask(decode)
    assert missing_from(decode.samples(), dashboard_exprs, with_data=True) == []
    # The prefill node has no OpenAI API (no TTFT or end-to-end latency of its own), but it serves
    # every name, and the engine's numbers hold data: it computed the prompts.
    prefill_samples = prefill.samples()
    assert missing_from(prefill_samples, dashboard_exprs, with_data=False) == []
    assert metric_sum(prefill_samples, "vllm:request_prompt_tokens_count") > 0
    assert metric_sum(prefill_samples, "vllm:request_queue_time_seconds_count") > 0


def test_vllm_names_count_what_ours_count_on_a_1p1d_pair(pair_1p1d):
    prefill, decode = pair_1p1d
    before = {"prefill": prefill.samples(), "decode": decode.samples()}
    ask(decode)
    after = {"prefill": prefill.samples(), "decode": decode.samples()}

    def delta(node: str, name: str, **labels: str) -> float:
        return metric_sum(after[node], name, **labels) - metric_sum(before[node], name, **labels)

    labels = {"model_name": MODEL, "engine": "0"}
    for node, samples in after.items():
        # Each vLLM name reads the number one of ours holds.
        by_source = {s.labels["source"]: s.value for s in samples if s.name == "disagg_engine_prompt_tokens_total"}
        assert metric_sum(samples, "vllm:prompt_tokens_total", **labels) == sum(by_source.values()), node
        assert metric_sum(samples, "vllm:prefix_cache_hits_total", **labels) == by_source["local_cache_hit"], node
        for reason in ("stop", "length", "abort", "error"):
            assert metric_sum(samples, "vllm:request_success_total", finished_reason=reason, **labels) == metric_sum(
                samples, "disagg_engine_finished_requests_total", finish_reason=reason), (node, reason)
        assert metric_sum(samples, "vllm:request_queue_time_seconds_count", **labels) == metric_sum(
            samples, "disagg_request_queue_time_seconds_count"), node
        assert metric_sum(samples, "vllm:num_preemptions_total", **labels) == metric_sum(
            samples, "disagg_engine_preemptions_total"), node
        assert metric_sum(samples, "vllm:generation_tokens_total", **labels) == metric_sum(
            samples, "disagg_generation_tokens_total"), node

    # Both requests crossed (remote_prefill "always"): the decode node received their prompts' KV
    # and the prefill node computed them, one output token each.
    assert delta("decode", "vllm:request_success_total", **labels) == 2
    assert delta("prefill", "vllm:request_success_total", **labels) == 2
    assert delta("decode", "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
    assert delta("decode", "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    assert delta("decode", "vllm:prompt_tokens_total") == delta("prefill", "vllm:prompt_tokens_total")
    assert delta("prefill", "vllm:request_generation_tokens_bucket", le="1.0") == 2
    assert delta("prefill", "vllm:request_params_max_tokens_bucket", le="1.0") == 2
    assert delta("decode", "vllm:request_generation_tokens_sum") == 8
    assert delta("decode", "vllm:iteration_tokens_total_count") > 0
    assert metric_sum(after["decode"], "vllm:cache_config_info", engine="0", enable_prefix_caching="True") == 1


def test_request_params_n_observes_each_prompts_n(pair_1p1d):
    """vLLM's: one observation of n per prompt of a finished request, not one per choice."""
    decode = pair_1p1d[1]
    before = decode.samples()
    body = {"model": MODEL, "prompt": ["Hi", "Bye"], "n": 3, "max_tokens": 2, "temperature": 1.0, "seed": 0}
    assert httpx.post(f"{decode.url}/v1/completions", json=body, timeout=120).status_code == 200
    after = decode.samples()

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    labels = {"model_name": MODEL, "engine": "0"}
    assert (delta("vllm:request_params_n_count", **labels), delta("vllm:request_params_n_sum", **labels)) == (2, 6)
    assert delta("vllm:request_params_n_bucket", le="2.0", **labels) == 0
    assert delta("vllm:request_params_n_bucket", le="5.0", **labels) == 2
    assert delta("disagg_request_params_n_sum") == 6


def test_start_and_stop_profile_trace_each_node_of_a_pair(pair_1p1d):
    """vLLM's /start_profile and /stop_profile (the pair runs with --profiler-config): a trace of each
    node's engine steps for the requests between the two calls, and of every thread's marks, which
    line the last request's way up across both nodes in the order it went (disagg/timeline.py); a
    second start or a stop with no start is refused."""
    prefill, decode = pair_1p1d
    for node in pair_1p1d:
        assert httpx.post(f"{node.url}/stop_profile", timeout=30).status_code == 409
        assert httpx.post(f"{node.url}/start_profile", timeout=30).status_code == 200
        refused = httpx.post(f"{node.url}/start_profile", timeout=30)
        assert refused.status_code == 409 and "running already" in refused.json()["error"]["message"]
    body = {"model": MODEL, "prompt": "The profiler sees", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{decode.url}/v1/completions", json=body, timeout=120).status_code == 200
    streamed = httpx.post(f"{decode.url}/v1/completions", json=body | {"prompt": "And then it sees", "stream": True},
                          timeout=120)
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text
    traces = {}
    for node in pair_1p1d:
        stopped = httpx.post(f"{node.url}/stop_profile", timeout=120)
        assert stopped.status_code == 200, stopped.text
        traces[node.role] = stopped.json()["trace"]
        with gzip.open(stopped.json()["trace"]) as f:
            names = {event.get("name") for event in json.load(f)["traceEvents"]}
        # The model's forward ran on each node while the profiler ran: its matrix products are in the trace,
        # within steps named by their batch (the prefill node's computes the prompt, the decode node's decode).
        assert names & {"aten::mm", "aten::addmm", "aten::linear"}, f"{node.role}: {sorted(names)[:40]}"
        steps = [name for name in names if name and name.startswith("disagg_step ")]
        if node is prefill:
            assert any(re.fullmatch(r"disagg_step seqs=1 prompt_tokens=[1-9]\d* context=\d+", s) for s in steps), steps
        else:
            assert any(re.fullmatch(r"disagg_step seqs=1 prompt_tokens=0 context=[1-9]\d*", s) for s in steps), steps
    rows = timeline(traces[prefill.role], traces[decode.role])
    order = ["disagg.api.request", "disagg.decode.generate", "disagg.decode.prefill_call", "disagg.prefill.call",
             "disagg.prefill.entries_opened", "step start", "disagg.producer.first_token_put",
             "disagg.consumer.first_token", "disagg.consumer.stored", "disagg.decode.kv_in_hand",
             "disagg.api.first_event"]
    seen = [r["what"].split(" (")[0] for r in rows]
    assert [what for what in seen if what in order] == order, seen  # each once, on the host's one clock
    # A prompt shorter than a block (nothing of it can be cached here) is called for before its blocks are
    # reserved here, and is in hand after.
    assert seen.index("disagg.decode.prefill_call") < seen.index("disagg.decode.routed") < \
        seen.index("disagg.decode.kv_in_hand"), seen
    where = {r["what"].split(" (")[0]: (r["node"], r["thread"]) for r in rows}
    # The marks of every thread: the API's event loop, the consumer's receiver, the prefill node's engine.
    assert where["disagg.consumer.first_token"] != where["disagg.api.request"]
    assert where["disagg.producer.first_token_put"] == where["step start"] != where["disagg.prefill.call"]
    assert rows[0]["what"] == "disagg.api.request" and rows[0]["ms"] == 0 < rows[-1]["ms"] < 60_000


def test_request_stats_times_and_prompt_sources():
    """The engine thread's record of two requests: one computed here from a partly cached prompt,
    one whose KV came from a prefill node and that was aborted after its first token."""
    stats = RequestStats()
    local = Sequence("local", list(range(40)), SamplingParams(max_tokens=2))
    remote = Sequence("remote", list(range(30)), SamplingParams(max_tokens=8))
    waiting = Sequence("waiting", list(range(10)), SamplingParams())
    for seq in (local, remote, waiting):
        stats.added(seq, now=0.0)
    remote.status = SequenceStatus.WAITING_FOR_KV  # its blocks at once, at add
    stats.check_scheduled(now=0.5)
    local.status = SequenceStatus.RUNNING
    stats.check_scheduled(now=1.0)

    def output(seq: Sequence, token: int, finished: bool) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt_token_ids, [token], "", [token], "", finished,
                             "length" if finished else None, num_cached_tokens=16)

    stats.output(output(local, 7, finished=False), now=2.0)  # its prompt's step
    stats.stepped()
    assert stats.take().step_tokens == 41  # as vLLM counts a step: the prompt it finished, the token it sampled
    stats.remote_first_token("remote", at=2.5, kv_start=16)
    local.token_ids += [7, 8]
    stats.output(output(local, 8, finished=True), now=3.0)
    stats.stepped()
    remote.token_ids.append(5)
    stats.finished("remote", "abort", now=4.0)
    turn = stats.take()
    assert turn.step_tokens == 1
    assert turn.prompt_tokens == {"local_compute": 0, "local_cache_hit": 16, "external_kv_transfer": 14}
    (done_local, done_remote) = turn.finished
    assert (done_local.finish_reason, done_local.num_prompt_tokens, done_local.num_computed_prompt_tokens,
            done_local.num_generation_tokens, done_local.max_tokens) == ("length", 40, 24, 2, 2)
    assert (done_local.queue_time, done_local.prefill_time, done_local.decode_time,
            done_local.inference_time) == (1.0, 1.0, 1.0, 2.0)
    assert (done_remote.finish_reason, done_remote.num_computed_prompt_tokens, done_remote.queue_time,
            done_remote.prefill_time, done_remote.decode_time) == ("abort", 0, 0.5, 2.0, 0.0)
    assert stats.take() is None  # nothing since
    stats.finished("waiting", "abort", now=5.0)  # never got blocks: all of it was queue
    (done_waiting,) = stats.take().finished
    assert (done_waiting.queue_time, done_waiting.prefill_time, done_waiting.num_generation_tokens) == (5.0, 0.0, 0)


def test_engine_metrics_serve_vllms_names_from_the_same_numbers():
    engine = SimpleNamespace(block_size=16, dtype=torch.bfloat16, max_model_len=1000, enable_prefix_caching=True,
                             stat_loggers=[], stats=EngineStats(num_blocks=64, num_free_blocks=60, num_preemptions=3))
    metrics = EngineMetrics(engine)
    stats = RequestStats()
    seq = Sequence("a", list(range(40)), SamplingParams(max_tokens=20))
    stats.added(seq, now=0.0)
    seq.status = SequenceStatus.RUNNING
    stats.check_scheduled(now=0.1)
    stats.output(RequestOutput("a", seq.prompt_token_ids, [1], "", [1], "", True, "stop", num_cached_tokens=32),
                 now=0.3)
    stats.stepped()
    metrics.record(stats.take())

    ours = [s for family in metrics.collect() for s in family.samples]
    labels = {"model_name": "m", "engine": "0"}
    theirs = [s for family in metrics.vllm_families(labels) for s in family.samples]
    assert metric_sum(theirs, "vllm:prompt_tokens_total") == metric_sum(ours, "disagg_engine_prompt_tokens_total") == 40
    assert metric_sum(theirs, "vllm:prefix_cache_hits_total") == 32
    assert metric_sum(theirs, "vllm:prompt_tokens_cached_total") == 32
    assert metric_sum(theirs, "vllm:request_success_total", finished_reason="stop", **labels) == 1
    assert metric_sum(theirs, "vllm:iteration_tokens_total_sum") == 41
    assert metric_sum(ours, "disagg_engine_step_tokens_sum") == 41
    assert metric_sum(theirs, "vllm:request_prefill_kv_computed_tokens_sum") == 8
    assert metric_sum(theirs, "vllm:num_preemptions_total") == metric_sum(ours, "disagg_engine_preemptions_total") == 3
    # vLLM's token buckets: 1, 2, 5, ... up to max_model_len; its step buckets as they are.
    assert buckets_1_2_5(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    le = [s.labels["le"] for s in theirs if s.name == "vllm:request_prompt_tokens_bucket"]
    assert le == [*(f"{float(b)}" for b in buckets_1_2_5(1000)), "+Inf"]
    assert [s.labels["le"] for s in theirs if s.name == "vllm:iteration_tokens_total_bucket"][:3] == ["1.0", "8.0",
                                                                                                      "16.0"]
