"""What a step's grammar masks add to its time on CPU, and what a costly grammar with a large n does
to another request's token gaps (issue 24), inside the engine (the embedded model, float32).

- steps: `--rows` requests decoding together, with no grammar (the forward alone), with a JSON
  schema each, and with a costly regex each (`(a{1000}){4}`, ~4 ms a mask, under the 5 ms past
  which a row may be failed): the median decode step.
- victim: a plain greedy request beside `--hostile` requests of `(a{1000}){20}` (~20 ms a mask, the
  costliest kind llguidance's limits let compile; the issue's `(a{1000}){300}` is refused at
  compile, and is tried first to show it): the victim's token gaps (one step each), and how many
  hostile requests were failed "grammar too expensive".

Only the engine's public API is used, so the same script measures any tree: run it with
PYTHONPATH at the tree to measure, and a --label for it; results are merged by label into --out.

    PYTHONPATH=. python benchmarks/grammar_overlap.py --label after [--rows 8] [--steps 20] [--hostile 64] [--threads 1]
"""

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from disagg.engine.llm import LLM
from disagg.engine.sampling_params import SamplingParamError, SamplingParams, StructuredOutputSpec

SCHEMA = {"type": "object", "additionalProperties": False, "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer"},
    "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    "email": {"type": "string", "pattern": "[a-z]{1,20}@[a-z]{1,20}\\.(com|org|net)"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["name", "age", "city", "email", "tags"]}
COSTLY = StructuredOutputSpec("regex", "(a{1000}){4}")
HOSTILE = StructuredOutputSpec("regex", "(a{1000}){20}")
ISSUE_HOSTILE = StructuredOutputSpec("regex", "(a{1000}){300}")
PROMPT = "Write the record of a person as JSON:"
VICTIM_PROMPT = "The capital of France is"


class MaskWaits:
    """Times each call of the sampler's StructuredOutput.mask: what the batch waits for its masks after
    the forward (the masks' whole time where they are computed there), and after it the masks' own
    time that step (the sum of each row's, as StructuredOutput measured them)."""

    def __init__(self, llm: LLM):
        self.structured = llm.engine.sampler.structured
        self.mask, self.seconds, self.work = self.structured.mask, [], []
        self.structured.mask = self

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self.mask(*args)
        finally:
            self.seconds.append(time.perf_counter() - start)
            self.work.append(sum(self.structured.mask_seconds.values()))


def step_times(llm: LLM, rows: int, steps: int, spec: StructuredOutputSpec | None) -> list[float]:
    """Seconds of each decode step of `rows` requests with this grammar (the prompts' step left out)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True, structured=spec)
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(rows)]
    for request_id in ids:
        engine.add_request(request_id, PROMPT, params)
    engine.step()  # the prompts
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        errors = [out.error for out in outputs if out.error]
        assert not errors, errors
    return times[:steps]


def victim_gaps(llm: LLM, waits: MaskWaits, hostile: int, tokens: int) -> dict:
    """The victim's token gaps beside `hostile` requests of HOSTILE, the part of each that the sampler
    waited for the masks after the forward, and what happened to the hostile requests."""
    engine = llm.engine
    waits.seconds = []
    try:
        engine.validate([1], SamplingParams(structured=ISSUE_HOSTILE))
        issue_grammar = "compiled"
    except SamplingParamError as e:
        issue_grammar = f"refused at compile: {e}"
    engine.add_request("victim", VICTIM_PROMPT, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    for i in range(hostile):
        engine.add_request(f"hostile-{i}", "a", SamplingParams(temperature=0.0, max_tokens=tokens, structured=HOSTILE))
    gaps, last, errors = [], time.perf_counter(), []
    while "victim" in engine.requests:
        outputs = engine.step()
        now = time.perf_counter()
        if any(out.request_id == "victim" for out in outputs):
            gaps.append(now - last)
            last = now
        errors += [out.error for out in outputs if out.error]
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    too_expensive = sum("grammar too expensive" in e for e in errors)
    return {"issue_grammar": issue_grammar, "gaps_s": gaps, "first_gap_s": gaps[0],
            "max_gap_after_first_s": max(gaps[1:]), "median_gap_s": statistics.median(gaps),
            "mask_waits_s": waits.seconds, "median_mask_wait_s": statistics.median(waits.seconds),
            "max_mask_wait_s": max(waits.seconds),
            "hostile_failed_too_expensive": too_expensive, "hostile_failed_otherwise": len(errors) - too_expensive}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hostile", type=int, default=64)
    parser.add_argument("--victim-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch's CPU threads (1: as the test suite runs)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "grammar_overlap_cpu.json")
    args = parser.parse_args()
    sys.setswitchinterval(0.0005)  # as `disagg serve` sets it
    logging.getLogger("disagg.engine.engine").setLevel(logging.CRITICAL)  # each failed hostile request's traceback
    torch.set_num_threads(args.threads)
    llm = LLM(device="cpu", dtype="float32", max_num_seqs=max(args.rows, args.hostile + 1))
    step_times(llm, args.rows, 2, StructuredOutputSpec("json", json.dumps(SCHEMA)))  # warm: compiles, first steps
    waits = MaskWaits(llm)
    result = {"rows": args.rows, "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg()[0],
              "steps_ms": {}, "mask_waits_ms": {}, "mask_work_ms": {}}
    for name, spec in [("no grammar", None), ("json schema", StructuredOutputSpec("json", json.dumps(SCHEMA))),
                       ("(a{1000}){4}", COSTLY)]:
        waits.seconds, waits.work = [], []
        times = step_times(llm, args.rows, args.steps, spec)
        result["steps_ms"][name] = round(statistics.median(times) * 1000, 1)
        result["mask_waits_ms"][name] = round(statistics.median(waits.seconds[1:1 + len(times)]) * 1000, 2)
        result["mask_work_ms"][name] = round(statistics.median(waits.work[1:1 + len(times)]) * 1000, 2)
        print(f"{args.label}: {args.rows} rows, {name}: median decode step {result['steps_ms'][name]} ms; the masks "
              f"take {result['mask_work_ms'][name]} ms, the sampler waits {result['mask_waits_ms'][name]} ms for "
              "them (and applies them) after the forward", flush=True)
    victim = victim_gaps(llm, waits, args.hostile, args.victim_tokens)
    result["victim"] = victim
    print(f"{args.label}: victim beside {args.hostile} x {HOSTILE.value}: first gap {victim['first_gap_s']:.2f} s, "
          f"max later gap {victim['max_gap_after_first_s']:.3f} s, median {victim['median_gap_s']:.3f} s, of which "
          f"the masks after the forward median {victim['median_mask_wait_s']:.3f} s, max "
          f"{victim['max_mask_wait_s']:.3f} s; "
          f"{victim['hostile_failed_too_expensive']} hostile failed 'grammar too expensive', "
          f"{victim['hostile_failed_otherwise']} otherwise; the issue's {ISSUE_HOSTILE.value}: "
          f"{victim['issue_grammar'][:60]}", flush=True)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results.setdefault(args.label, []).append(result)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
