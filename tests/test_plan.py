"""`disagg plan`: the simulator on hand-made profiles (fast lane), and `plan profile` + `plan` on the
real embedded model (slow). Its prediction against measured goodput is a benchmark
(benchmarks/plan_cpu_check.py): on a shared machine, timing decides it, not the code."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disagg.plan import load_workload
from disagg.plan.profile import DecodeSample, Link, PrefillSample, Profile, Serving, graph_edges
from disagg.plan.simulate import Layout, Node, Planner, Request, Settings, StepTimes, pick_prefill


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


def test_a_decode_step_follows_the_profiled_staircase():
    """CUDA graphs pad a batch to its bucket, so a step is flat within one and rises past it. Profiled at
    each bucket and the batch after it, the fitted step is each sample, and flat between a bucket's ends."""
    buckets = [1, 2, 4, 8, 9, 16, 18, 32]
    assert graph_edges(buckets) == [1, 2, 3, 4, 5, 8, 9, 10, 16, 17, 18, 19, 32]
    bucket_ms = {1: 4.0, 2: 4.1, 4: 4.2, 8: 4.5, 9: 5.0, 16: 5.1, 18: 6.0, 32: 6.2}
    step_ms = {b: next(ms for size, ms in bucket_ms.items() if size >= b) for b in graph_edges(buckets)}
    profile = synthetic_profile(25.0)
    profile.decode = [DecodeSample(b, 1024, ms / 1e3) for b, ms in step_ms.items()]
    cost = StepTimes.fit(profile)
    for b in range(1, 33):
        want = next(ms for size, ms in bucket_ms.items() if size >= b)
        assert cost.seconds(0, b, b * 1024) * 1e3 == pytest.approx(want, abs=1e-9), b


def test_a_prompt_goes_to_the_prefill_node_with_the_fewest_prompt_tokens_to_compute():
    """As a decode node's pool picks (by pending prompt tokens), not by requests in flight."""
    long, short = Node("prefill", 2048), Node("prefill", 2048)
    long.waiting.append(Request(0.0, 4000, 8))
    short.waiting.extend([Request(0.0, 100, 8), Request(0.0, 100, 8)])  # more requests, fewer tokens
    long.in_flight, short.in_flight = 1, 2
    assert pick_prefill([long, short]) is short
    short.running.append(Request(0.0, 4000, 8, computed=100))  # 3,900 more to compute there
    assert pick_prefill([long, short]) is long


def test_what_serving_adds_counts_against_the_slo():
    settings = Settings(ttft_s=0.5, tpot_s=0.02, num_requests=50, seeds=1)
    profile = synthetic_profile(25.0)
    assert Planner(profile, [(1024, 16)], settings).goodput(Layout(0, 1)) > 0
    profile.serving = Serving(ttft_extra_s=0.6)  # every first token 0.6 s late: the TTFT SLO is never met
    assert Planner(profile, [(1024, 16)], settings).goodput(Layout(0, 1)) == 0.0
    profile.serving = Serving(step_extra_s=0.015)  # a decode step of 25 ms: the TPOT SLO is never met
    assert Planner(profile, [(1024, 16)], settings).goodput(Layout(0, 1)) == 0.0
    # What each further decoding sequence adds (its streamed token): nothing for a request alone, so
    # requests one at a time still meet the SLO, but fewer fit within it together.
    profile.serving = Serving()
    alone = Planner(profile, [(1024, 16)], settings).goodput(Layout(0, 1))
    profile.serving = Serving(step_extra_per_seq_s=0.002)
    assert StepTimes.fit(profile).seconds(0, 1, 1024) == StepTimes.fit(synthetic_profile(25.0)).seconds(0, 1, 1024)
    assert 0 < Planner(profile, [(1024, 16)], settings).goodput(Layout(0, 1)) < alone


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


def test_plan_ends_with_the_disagg_up_line_that_runs_its_recommendation(tmp_path: Path, capsys):
    """`disagg plan` on a synthetic profile: the ranked table, `recommended:`, then `run it:` with the
    recommended layout's flags of `disagg up` (MODEL: the profile does not say which); --json has its words."""
    from disagg import cli

    profile = tmp_path / "profile.json"
    profile.write_text(synthetic_profile(25.0).to_json())
    plan_json = tmp_path / "plan.json"
    cli.main(["plan", "--profile", str(profile), "--gpus", "2", "--input-len", "4096", "--output-len", "32",
              "--ttft-slo-ms", "1000", "--tpot-slo-ms", "20", "--num-requests", "40", "--seeds", "1",
              "--json", str(plan_json)])
    lines = capsys.readouterr().out.splitlines()
    plan = json.loads(plan_json.read_text())
    best = plan["layouts"][0]
    assert lines[-2].startswith(f"recommended: {plan['recommended']}")
    flags = (["--num-prefill", str(best["prefill_nodes"]), "--num-decode", str(best["decode_nodes"])]
             if best["prefill_nodes"] else ["--colocated", str(best["decode_nodes"])])
    assert plan["up_command"] == ["disagg", "up", "MODEL", *flags]
    assert lines[-1] == "run it: " + " ".join(plan["up_command"])


def test_a_profile_of_one_decode_context_far_from_the_workloads_says_so(tmp_path: Path, capsys):
    """Decode steps timed at one context cannot tell the tokens held from the batch: for a workload whose
    sequences hold far fewer (chat on a profile made for 4k prompts) the plan says its TPOT is extrapolated
    and which contexts to profile; profiled at two contexts, or near the workload's, it says nothing."""
    from disagg import cli

    def plan(profile: Profile, input_len: int) -> list[str]:
        path = tmp_path / "profile.json"
        path.write_text(profile.to_json())
        cli.main(["plan", "--profile", str(path), "--gpus", "2", "--input-len", str(input_len), "--output-len", "512",
                  "--ttft-slo-ms", "1000", "--tpot-slo-ms", "20", "--num-requests", "20", "--seeds", "1"])
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]

    both = synthetic_profile(25.0)
    one = Profile(**vars(both) | {"decode": [s for s in both.decode if s.context == 4096]})
    assert plan(one, 1024) == ["note: the profile timed decode steps at 4096 tokens held only, this workload's "
                               "sequences hold about 1280: its TPOT is extrapolated; profile with --decode-context "
                               "1280,4096 for one that follows the context"]
    assert plan(one, 3800) == [] and plan(both, 1024) == []


def test_the_up_command_names_the_profiled_model_its_device_its_pipe_and_the_batching_simulated():
    from disagg.plan import up_command

    profile, gpu = synthetic_profile(25.0), Settings(ttft_s=1.0, tpot_s=0.02, prefill_batched_tokens=8192)
    assert up_command(profile, Layout(0, 4), gpu) == ["disagg", "up", "MODEL", "--colocated", "4"]
    profile.model_source, profile.device, profile.link.connector = "", "cpu", "tcp"
    cpu = Settings(ttft_s=1.0, tpot_s=0.02)  # serve's batching on the CPU: nothing to say
    assert up_command(profile, Layout(1, 3), cpu) == ["disagg", "up", "--num-prefill", "1", "--num-decode", "3",
                                                      "--device", "cpu"]
    profile.model_source, profile.device, profile.link.connector = "/models/llama 8b", "NVIDIA H200", "nixl"
    profile.async_scheduling = True
    tuned = Settings(ttft_s=1.0, tpot_s=0.02, max_num_seqs=32, batched_tokens=4096, prefill_batched_tokens=16384)
    assert up_command(profile, Layout(2, 2), tuned) == [
        "disagg", "up", "/models/llama 8b", "--num-prefill", "2", "--num-decode", "2", "--kv-connector", "nixl",
        "--async-scheduling", "--max-num-seqs", "32", "--max-num-batched-tokens", "4096",
        "--prefill-max-num-batched-tokens", "16384"]
    assert up_command(profile, Layout(0, 4), tuned)[-4:] == ["--max-num-seqs", "32", "--max-num-batched-tokens", "4096"]


# The slow test's workload: prefill-heavy, a few requests (benchmarks/plan_cpu_check.py measures
# the prediction against bench serve; timing on a shared machine is no test).
INPUT_LEN, OUTPUT_LEN, NUM_REQUESTS = 64, 4, 20


def disagg(*args: str, timeout: float = 120) -> str:
    done = subprocess.run([sys.executable, "-m", "disagg.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def predict(tmp_path: Path, serving: bool = True) -> tuple[dict[str, float], list[str]]:
    """`disagg plan profile` on this machine now, then `disagg plan` for 1 and 2 GPUs: each layout's
    predicted goodput, and the SLO (from the profile: this machine's speed now, shared as it is).
    serving: the profile also measures what a served node adds (it starts one)."""
    profile = tmp_path / "profile.json"
    # 128 MiB of KV (the engine's and the served node's) holds this grid many times over; the CPU default is 512.
    out = disagg("plan", "profile", "--device", "cpu", "--out", str(profile), "--prefill-tokens", "16,64,256",
                 "--decode-batch", "1,4", "--decode-context", "32,96", "--kv-cache-memory", "128MiB",
                 *([] if serving else ["--no-serving"]))
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
        assert out.splitlines()[-2].startswith(f"recommended: {names[0]}"), out
        # The embedded model, `disagg up`'s default, on the CPU where it was profiled.
        assert out.splitlines()[-1].startswith("run it: disagg up --") and out.endswith("--device cpu\n"), out
        predicted |= {row["layout"]: row["goodput"] for row in layouts}
    return predicted, [f"ttft:{ttft_ms:.1f}", f"tpot:{tpot_ms:.1f}"]


@pytest.mark.slow
def test_plan_profile_then_plan_on_the_embedded_model(tmp_path: Path):
    """`disagg plan profile` writes this machine's profile; `disagg plan` on it ranks the layouts of 1
    and 2 GPUs and recommends the first, each with a goodput the simulation found."""
    predicted, _ = predict(tmp_path, serving=False)  # the serving part starts a node: the benchmark's
    assert all(0 < rate < 100 for rate in predicted.values()), predicted


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_is_timed_with_the_whole_batch_running(tiny_llama_dir, async_scheduling: bool):
    """Prompts that take several steps to start (budget < batch x context) keep decoding meanwhile:
    none may finish before the timed steps, which must each decode the whole batch."""
    import random

    from disagg.engine.config import EngineConfig
    from disagg.engine.engine import LLMEngine
    from disagg.plan.profile import DECODE_REPEATS, decode_tokens, time_decode

    # The budget fits one whole prompt a step, and less once sequences run (each takes a token of it):
    # 63 steps to start them all, the first decoding in each.
    batch, context, budget = 32, 96, 96
    engine = LLMEngine(EngineConfig(
        model=str(tiny_llama_dir()), device="cpu", dtype="float32", enable_prefix_caching=False,
        max_num_seqs=batch, max_num_batched_tokens=budget,
        max_model_len=context + decode_tokens(batch, context, budget), kv_cache_memory=128 << 20,
        async_scheduling=async_scheduling))
    running = []
    step = engine.step
    engine.step = lambda: (running.append(len(engine.scheduler.running)), step())[1]
    samples = time_decode(engine, [batch], [context], random.Random(0))
    assert [(s.batch, s.context) for s in samples] == [(batch, context)] and samples[0].seconds > 0
    assert running[-DECODE_REPEATS:] == [batch] * DECODE_REPEATS, running
    assert not engine.has_unfinished_requests()  # aborted once timed
