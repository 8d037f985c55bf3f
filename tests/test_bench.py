"""`disagg bench serve` and `disagg bench plot` as real processes against a real colocated node."""

import http.server
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from disagg.bench.plot import plot_files
from disagg.bench.serve import READ_BUFFER, SLO, RequestResult, parse_rates, percentile, served_model, summarize
from tests.servers import start_node

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    node = start_node("both", tmp_path_factory.mktemp("bench-node"))
    yield node
    node.kill()


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "disagg.cli", "bench", *args], check=False, capture_output=True,
                          text=True,
                          timeout=timeout, env=env)


@pytest.mark.slow
def test_serve_sweep_json_and_plot(node, tmp_path: Path):
    out_json, out_png = tmp_path / "run.json", tmp_path / "run.png"
    done = bench("serve", "--base-url", node.url, "--qps-sweep", "4,inf", "--num-requests", "3",
                 "--input-len", "8", "--output-len", "4", "--goodput", "ttft:60000", "tpot:60000",
                 "--label", "colocated", "--save-json", str(out_json), "--plot", str(out_png), "--no-progress",
                 "--exact-rate")
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out_json.read_text())
    assert result["label"] == "colocated" and result["model"]
    assert [run["qps"] for run in result["runs"]] == [4.0, "inf"]
    assert [run["arrival_rate"] for run in result["runs"]] == [pytest.approx(4.0), None]  # --exact-rate
    starts = sorted(r["start"] for r in result["runs"][0]["requests"])
    assert 0.45 <= starts[-1] - starts[0] <= 1.5  # 2 gaps of 1/4 s: never early; late only on a loaded host
    for run in result["runs"]:
        assert run["completed"] == 3 and run["failed"] == 0, run.get("errors")
        for key in ("request_throughput", "output_throughput", "goodput", "duration_s",
                    *(f"{s}_{m}_ms" for s in ("mean", "median", "p99") for m in ("ttft", "tpot", "itl", "e2e"))):
            assert run[key] is not None and run[key] >= 0, key
        assert run["goodput"] == pytest.approx(run["request_throughput"])  # SLOs of a minute: all meet them
        assert run["median_ttft_ms"] <= run["median_e2e_ms"]
        assert len(run["requests"]) == 3
        for request in run["requests"]:
            assert request["ok"], request["error"]
            assert 0 < request["ttft"] <= request["e2e"]
            assert request["output_tokens"] == 4  # ignore_eos: the asked length, counted from usage
            assert request["prompt_tokens"] >= 1
            assert request["tpot"] is not None and request["tpot"] >= 0
    assert out_png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_serve_chat_and_plot_of_two_files(node, tmp_path: Path):
    out_json = tmp_path / "chat.json"
    done = bench("serve", "--base-url", node.url, "--endpoint", "chat", "--qps", "inf", "--num-requests", "2",
                 "--input-len", "6", "--output-len", "3", "--save-json", str(out_json), "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    run = json.loads(out_json.read_text())["runs"][0]
    assert run["completed"] == 2 and all(r["output_tokens"] == 3 for r in run["requests"])

    plot = tmp_path / "both.png"  # `disagg bench plot a.json b.json --label ...`, in this process
    plot_files([str(out_json), str(out_json)], plot, ["a", "b"])
    assert plot.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="one per file"):
        plot_files([str(out_json)], plot, ["a", "b"])


def test_unreachable_server_names_the_url():
    with pytest.raises(RuntimeError, match="127.0.0.1:9/v1/models"):
        served_model("http://127.0.0.1:9", None)


def test_metrics_helpers():
    assert parse_rates("inf", "0.5,1, inf") == [0.5, 1.0, float("inf")]
    with pytest.raises(ValueError, match="> 0"):
        parse_rates("0", None)
    with pytest.raises(ValueError, match="METRIC:MS"):
        SLO.parse(["latency:5"])
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5
    fast = RequestResult(ok=True, input_len=8, output_len=3, output_tokens=3, ttft=0.1, e2e=0.3, itl=[0.1, 0.1])
    slow = RequestResult(ok=True, input_len=8, output_len=3, output_tokens=3, ttft=2.0, e2e=2.2, itl=[0.1, 0.1])
    failed = RequestResult(ok=False, input_len=8, output_len=3, error="HTTP 503")
    assert fast.tpot == pytest.approx(0.1)
    summary = summarize([fast, slow, failed], duration=2.0, slo=SLO.parse(["ttft:500"]))
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["goodput"] == pytest.approx(0.5) and summary["goodput_fraction"] == pytest.approx(1 / 3)
    assert summary["median_ttft_ms"] == pytest.approx(1050)
    assert summary["errors"] == ["HTTP 503"]


def test_request_building(tmp_path: Path):
    import argparse
    import random

    from disagg.bench import add_serve_args
    from disagg.bench.serve import build_requests, request_body

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": [5, 6, 7], "max_tokens": 2}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    args = parser.parse_args(["--prompts-file", str(prompts), "--num-requests", "3", "--output-len", "9"])
    specs = build_requests(args, random.Random(0))
    assert [(s.prompt, s.output_len) for s in specs] == [([5, 6, 7], 2), (None, 9), ([5, 6, 7], 2)]
    assert specs[1].messages == [{"role": "user", "content": "hi"}]
    body = request_body(specs[0], args, "m")
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}

    args = parser.parse_args(["--prompt-kind", "token-ids", "--vocab-size", "2000", "--input-len", "10",
                              "--len-dist", "uniform", "--num-requests", "20"])
    specs = build_requests(args, random.Random(0))
    assert all(5 <= len(s.prompt) <= 15 and max(s.prompt) < 2000 for s in specs)
    assert len({len(s.prompt) for s in specs}) > 1

    args = parser.parse_args(["--prompt-kind", "token-ids", "--input-len", "100", "--output-len", "50",
                              "--len-dist", "lognormal", "--len-range", "0.6", "--num-requests", "400"])
    specs = build_requests(args, random.Random(0))
    lens = sorted(len(s.prompt) for s in specs)
    assert 80 <= lens[200] <= 120 and lens[-1] <= 400 and lens[0] >= 1  # median near 100, capped at 4x
    assert lens[360] > 150  # a long tail
    args = parser.parse_args(["--endpoint", "chat", "--prompt-kind", "token-ids"])
    with pytest.raises(ValueError, match="completions"):
        build_requests(args, random.Random(0))


def test_shared_prefix_conversations():
    import argparse
    import random

    from disagg.bench import add_serve_args
    from disagg.bench.serve import build_conversations

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--workload", "shared-prefix", "--num-prefixes", "3", "--prefix-len", "20",
                              "--turns", "2", "--num-requests", "11", "--input-len", "5", "--prompt-kind", "token-ids"])
    conversations = build_conversations(args, random.Random(0))
    assert [len(turns) for turns in conversations].count(2) == 5 and sum(map(len, conversations)) == 11
    prefixes = {tuple(turns[0].prompt[:20]) for turns in conversations}
    assert len(prefixes) == 3  # six conversations over three prefixes
    for turns in conversations:
        assert [t.input_len for t in turns] == [25, 30][:len(turns)]
        if len(turns) == 2:
            assert turns[1].prompt[:25] == turns[0].prompt  # a turn extends the one before
    chat = parser.parse_args(["--workload", "shared-prefix", "--endpoint", "chat", "--num-requests", "2"])
    turns = build_conversations(chat, random.Random(0))[0]
    assert len(turns[0].messages[0]["content"].split()) == 256 + 128
    with pytest.raises(ValueError, match="--turns"):
        build_conversations(parser.parse_args(["--workload", "shared-prefix", "--turns", "0"]), random.Random(0))


@pytest.mark.slow
def test_serve_shared_prefix_reports_the_prefix_cache_hit_rate(node, tmp_path: Path):
    """Two conversations of two turns on two prefixes: each second turn finds its first turn's full
    blocks in the node's prefix cache, which is what the node's /metrics counts."""
    out_json = tmp_path / "shared.json"
    done = bench("serve", "--base-url", node.url, "--workload", "shared-prefix", "--num-prefixes", "2",
                 "--prefix-len", "64", "--turns", "2", "--num-requests", "4", "--input-len", "8", "--output-len", "2",
                 "--prompt-kind", "token-ids", "--vocab-size", "49152", "--metrics-url", f"{node.url}/metrics",
                 "--save-json", str(out_json), "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    run = json.loads(out_json.read_text())["runs"][0]
    assert run["completed"] == 4
    assert sorted(r["prompt_tokens"] for r in run["requests"]) == [72, 72, 80, 80]
    # Turn 2 (80 tokens) hits turn 1's 4 full 16-token blocks; turn 1 hits nothing.
    cache = run["prefix_cache"]
    assert (cache["hits"], cache["queries"]) == (2 * 64, 2 * (72 + 80))
    assert cache["hit_rate"] == pytest.approx(128 / 304) and cache["without_counters"] == []
    assert "prefix cache hit rate 0.421 (128/304 prompt tokens)" in done.stdout


def test_arrivals_take_vllms_flags_and_keep_their_mean_rate():
    """vLLM's bench flags parse into ours; gaps keep the mean rate at every burstiness, and a lower
    burstiness bunches them (more spread); an infinite rate sends everything at once."""
    import argparse
    import random
    import statistics

    from disagg.bench import add_serve_args
    from disagg.bench.serve import arrival_offsets

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--request-rate", "4", "--num-prompts", "7", "--random-input-len", "64",
                              "--random-output-len", "8", "--burstiness", "0.5"])
    assert (args.qps, args.num_requests, args.input_len, args.output_len, args.burstiness) == ("4", 7, 64, 8, 0.5)
    spread = {}
    for burstiness in (0.25, 1.0, 4.0):
        offsets = arrival_offsets(4001, 4.0, burstiness, random.Random(0))
        gaps = [b - a for a, b in zip(offsets, offsets[1:])]
        assert offsets[0] == 0 and min(gaps) >= 0
        assert 0.23 < statistics.mean(gaps) < 0.27, (burstiness, statistics.mean(gaps))  # 1 / 4 req/s
        spread[burstiness] = statistics.stdev(gaps) / statistics.mean(gaps)
    assert spread[0.25] > 1.5 > spread[1.0] > 0.8 > 0.6 > spread[4.0]  # gamma: cv = 1 / sqrt(shape)
    assert arrival_offsets(3, float("inf"), 1.0, random.Random(0)) == [0.0, 0.0, 0.0]
    # --exact-rate: the same arrivals scaled to span (n - 1) / rate, whatever the draw.
    drawn, exact = (arrival_offsets(41, 4.0, 1.0, random.Random(7), exact) for exact in (False, True))
    assert exact[-1] == pytest.approx(10.0) and drawn[-1] != pytest.approx(10.0)
    assert [b / exact[-1] for b in exact] == pytest.approx([a / drawn[-1] for a in drawn])
    from disagg.bench.serve import run_benchmark

    with pytest.raises(ValueError, match="--burstiness must be > 0"):  # refused before anything is sent
        run_benchmark(parser.parse_args(["--burstiness", "0", "--base-url", "http://127.0.0.1:9"]))


class BreakingServer(http.server.ThreadingHTTPServer):
    """A server that fails each completion in its own way, in turn: a 400, a stream cut off after one
    event, an error event, a stream that sends an event and then nothing for longer than the client's
    --timeout, an event line longer than the client reads (2 x READ_BUFFER)."""

    WAYS = ("refused", "cut", "error event", "silent", "too long")

    def __init__(self):
        self.count = itertools.count()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                way = server.WAYS[next(server.count) % len(server.WAYS)]
                if way == "refused":
                    body = json.dumps({"error": {"message": "prompt too long", "type": "BadRequestError"}}).encode()
                    self.send_response(400)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                event = {"choices": [{"index": 0, "text": " a" * (READ_BUFFER if way == "too long" else 1)}]}
                if way == "error event":
                    event = {"error": {"message": "the engine failed"}}
                data = f"data: {json.dumps(event)}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                if way == "silent":
                    time.sleep(4)
                self.close_connection = True  # cut: no last chunk

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.daemon_threads = True
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_failed_requests_are_counted_with_their_reasons(tmp_path: Path):
    """A refused request, a stream cut off, an error event, a stalled stream and an event too long to
    read: each is a failed request with its reason, the run goes on to its end, and the command exits
    2 having written it."""
    server = BreakingServer()
    out_json = tmp_path / "failed.json"
    try:
        done = bench("serve", "--base-url", f"http://127.0.0.1:{server.server_address[1]}", "--model", "m",
                     "--qps", "inf", "--max-concurrency", "1", "--num-requests", "5", "--input-len", "4",
                     "--output-len", "8", "--timeout", "1", "--save-json", str(out_json), "--no-progress")
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 2 and "5 request(s) failed" in done.stderr, done.stdout + done.stderr
    run = json.loads(out_json.read_text())["runs"][0]  # written all the same
    assert (run["completed"], run["failed"]) == (0, 5)
    refused, cut, error_event, silent, too_long = (r["error"] for r in run["requests"])
    assert refused.startswith("HTTP 400: ") and "prompt too long" in refused
    assert "ClientPayloadError" in cut, cut
    assert error_event.startswith("stream error: ") and "the engine failed" in error_event
    assert "Timeout" in silent, silent
    assert "LineTooLong" in too_long, too_long
