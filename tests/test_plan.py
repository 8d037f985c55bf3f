"""`disagg plan`: the simulator on hand-made profiles (fast lane), and on the real embedded model
against measured goodput (slow: `plan profile`, a colocated node and the shared 1P1D pair)."""

import json
import os
import subprocess
import sys
from argparse import ArgumentParser
from pathlib import Path

import pytest

from disagg.bench import add_serve_args
from disagg.bench.serve import run_benchmark
from disagg.plan import load_workload
from disagg.plan.profile import DecodeSample, Link, PrefillSample, Profile, Serving
from disagg.plan.simulate import Layout, Planner, Settings
from tests.servers import start_node


def synthetic_profile(link_gbps: float) -> Profile:
    """A GPU-like node: prefill 0.1 ms a token (+5 ms), decode 10 ms + 0.2 ms a sequence."""
    return Profile(model="synthetic", device="GPU", dtype="bfloat16", kv_bytes_per_token=128 * 1024, threads=1,
                   prefill=[PrefillSample(n, 0.005 + 1e-4 * n) for n in (512, 2048, 8192)],
                   decode=[DecodeSample(b, c, 0.010 + 2e-4 * b) for b in (1, 16, 64) for c in (1024, 4096)],
                   link=Link("synthetic", 1e-3, link_gbps * 1e9))


def test_profile_round_trips_through_json():
    profile = synthetic_profile(25.0)
    assert Profile.from_json(profile.to_json()) == profile
    with pytest.raises(ValueError, match="not a profile"):
        Profile.from_json('{"model": "x"}')


def test_simulated_layouts_follow_the_workload_and_the_link():
    settings = Settings(ttft_s=1.0, tpot_s=0.02, num_requests=100, seeds=1, prefill_batched_tokens=8192)
    # Prefill-heavy (4k prompts, short answers): more prefill nodes serve more.
    heavy = Planner(synthetic_profile(25.0), [(4096, 32)], settings)
    assert heavy.goodput(Layout(3, 1)) > 1.5 * heavy.goodput(Layout(1, 3))
    # A link too slow for a prompt's KV (512 MiB at 0.1 GB/s: 5 s) loses every disaggregated layout.
    slow = Planner(synthetic_profile(0.1), [(4096, 32)], settings)
    assert slow.goodput(Layout(3, 1)) == 0.0 and slow.goodput(Layout(0, 4)) > 0


def test_what_serving_adds_counts_against_the_slo():
    settings = Settings(ttft_s=0.5, tpot_s=0.02, num_requests=50, seeds=1)
    profile = synthetic_profile(25.0)
    assert Planner(profile, [(1024, 16)], settings).goodput(Layout(0, 1)) > 0
    profile.serving = Serving(ttft_extra_s=0.6)  # every first token 0.6 s late: the TTFT SLO is never met
    assert Planner(profile, [(1024, 16)], settings).goodput(Layout(0, 1)) == 0.0
    profile.serving = Serving(step_extra_s=0.015)  # a decode step of 25 ms: the TPOT SLO is never met
    assert Planner(profile, [(1024, 16)], settings).goodput(Layout(0, 1)) == 0.0


def test_workload_from_a_bench_result_or_json_lines(tmp_path: Path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"runs": [{"requests": [
        {"input_len": 100, "output_len": 8, "prompt_tokens": 103, "output_tokens": 8},
        {"input_len": 50, "output_len": 4, "prompt_tokens": None, "output_tokens": 0}]}]}))
    assert load_workload(str(bench)) == [(103, 8), (50, 4)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"input_len": 7, "output_len": 3}\n\n{"input_len": 9, "output_len": 1}\n')
    assert load_workload(str(trace)) == [(7, 3), (9, 1)]
    trace.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match="neither a `disagg bench serve` result"):
        load_workload(str(trace))


# The slow test's workload: prefill-heavy (the per-token streaming a served node adds to a decode
# step, which the offline profile does not see, matters least), and enough requests that a burst
# of them cannot meet the SLO that a steady rate misses.
INPUT_LEN, OUTPUT_LEN, NUM_REQUESTS = 64, 4, 20
BELOW, ABOVE = 0.8, 1.34  # measured goodput within 25% of predicted P: >= 90% at 0.8 P, < 90% at 1.34 P


def disagg(*args: str, timeout: float = 120) -> str:
    done = subprocess.run([sys.executable, "-m", "disagg.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def attainment(url: str, rate: float, slo: list[str], seed: int) -> float:
    parser = ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--base-url", url, "--no-progress"])
    args.qps, args.num_requests, args.input_len, args.output_len = str(rate), NUM_REQUESTS, INPUT_LEN, OUTPUT_LEN
    args.prompt_kind, args.vocab_size, args.goodput, args.seed = "token-ids", 49152, slo, seed
    run = run_benchmark(args)["runs"][0]
    assert run["failed"] == 0, run.get("errors")
    return run["goodput_fraction"]


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    node = start_node("both", tmp_path_factory.mktemp("plan-colocated"), extra_args=["--max-model-len", "512"])
    yield node
    node.kill()


def predict(tmp_path: Path) -> tuple[dict[str, float], list[str]]:
    """`disagg plan profile` on this machine now, then `disagg plan` for 1 and 2 GPUs: each layout's
    predicted goodput, and the SLO (from the profile: this machine's speed now, shared as it is)."""
    profile = tmp_path / "profile.json"
    out = disagg("plan", "profile", "--device", "cpu", "--out", str(profile), "--prefill-tokens", "16,64,256",
                 "--decode-batch", "1,4", "--decode-context", "32,96")
    assert "wrote" in out
    loaded = Profile.load(str(profile))
    assert loaded.device == "cpu" and loaded.link.connector == "tcp" and loaded.link.bytes_per_s > 0
    # Generous: TTFT <= 4x the prompt's prefill, TPOT <= 5x a decode step at batch 1 (a prompt computed
    # between two decode steps does not break it alone), so that the goodput is where the node saturates.
    ttft_ms = 4e3 * next(s.seconds for s in loaded.prefill if s.tokens == INPUT_LEN)
    tpot_ms = 5e3 * min(s.seconds for s in loaded.decode if s.batch == 1)
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"input_len": INPUT_LEN, "output_len": OUTPUT_LEN}) + "\n" for _ in range(3)))
    predicted = {}
    for gpus in (1, 2):
        plan_json = tmp_path / f"plan-{gpus}.json"
        out = disagg("plan", "--profile", str(profile), "--gpus", str(gpus), "--workload", str(trace),
                     "--ttft-slo-ms", f"{ttft_ms:.1f}", "--tpot-slo-ms", f"{tpot_ms:.1f}",
                     "--num-requests", str(NUM_REQUESTS), "--json", str(plan_json))
        layouts = json.loads(plan_json.read_text())["layouts"]
        names = [row["layout"] for row in layouts]
        assert sorted(names) == (["colocated x1"] if gpus == 1 else ["1P1D", "colocated x2"])
        assert [row["goodput"] for row in layouts] == sorted((row["goodput"] for row in layouts), reverse=True)
        for name in names:
            assert name in out
        assert out.splitlines()[-1].startswith(f"recommended: {names[0]}"), out
        predicted |= {row["layout"]: row["goodput"] for row in layouts}
    return predicted, [f"ttft:{ttft_ms:.1f}", f"tpot:{tpot_ms:.1f}"]


@pytest.mark.slow
def test_plan_predicts_the_measured_goodput_of_1p1d_and_colocated(tmp_path: Path, pair_1p1d, colocated):
    """Predicted goodput P within 25% of the measured: >= 90% of the requests within the SLO at 0.8 P,
    fewer at 1.34 P, for the shared 1P1D pair and a colocated node. Other work on this machine changes
    its speed between the profile and the measurement, so a system that misses is tried once more,
    from a new profile."""
    urls = {"1P1D": pair_1p1d[1].url, "colocated x1": colocated.url}
    passed, tries = set(), []
    for attempt in range(2):
        predicted, slo = predict(tmp_path)
        for name in [n for n in urls if n not in passed]:
            rate = predicted[name]
            assert 0 < rate < 100, predicted
            below = attainment(urls[name], BELOW * rate, slo, 1 + 2 * attempt)
            above = attainment(urls[name], ABOVE * rate, slo, 2 + 2 * attempt)
            tries.append((name, slo, rate, below, above))
            print(f"{name}: SLO {slo}, predicted {rate:.2f} req/s, attainment {below:.0%} at {BELOW}x, "
                  f"{above:.0%} at {ABOVE}x")
            if below >= 0.9 and above < 0.9:
                passed.add(name)
        if passed == set(urls):
            return
    pytest.fail(f"predicted goodput not within 25% of the measured, twice: {tries}")
