"""The fixed cost of a colocated first token on the CPU: what a streamed one-token completion of a
512-token prompt (token ids) waits for beyond the engine's own prefill.

    python benchmarks/ttft_fixed_cpu.py --versions head=.,base=OLD_TREE --repeats 60 --json out.json

One colocated `disagg serve` node per code version (`PYTHONPATH` naming its tree, the embedded model,
one torch thread), all up at once, their requests taken in turn (the order alternating) by one
keep-alive httpx client, so that the versions compare side by side on a shared machine. Per request,
from the node's own histograms read around it (kv_handoff.py's split): *engine* = queue + prefill
time (request added -> first token sampled), *fixed* = the client's TTFT - engine, of it *api* = the
API's TTFT - engine (the hop into the engine thread and back) and *http* = the rest (the client's
send, uvicorn, parsing and validation, the SSE write and its read). Medians of the per-request values.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_disagg_vs_colocated import EMBEDDED_VOCAB
from kv_handoff import COLOCATED_TIMES, deltas, scrape, ttft_of

from disagg.launch import wait_healthy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from servers import free_port  # noqa: E402


def start(label: str, tree: str, log_dir: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "disagg.cli", "serve", "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
            "--kv-cache-memory", str(128 * 2**20), *extra]
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve()), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, stdout=(log_dir / f"{label}.log").open("w"), stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def one(url: str, prompt: list[int]) -> dict[str, float]:
    before = scrape(url, COLOCATED_TIMES)
    ttft = ttft_of(url, prompt)
    time.sleep(0.05)  # the histograms are observed as the request finishes, just after its event
    d = deltas(before, scrape(url, COLOCATED_TIMES))
    engine = d["request_queue_time"] + d["request_prefill_time"]
    return {"ttft": ttft, "engine": engine, "fixed": ttft - engine, "api": d["time_to_first_token"] - engine,
            "http": ttft - d["time_to_first_token"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", default="head=.", help="LABEL=TREE[,LABEL=TREE...]")
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--serve-args", default="", help="more `disagg serve` flags, space-separated")
    ap.add_argument("--json")
    args = ap.parse_args()
    versions = dict(v.split("=", 1) for v in args.versions.split(","))
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        started = {label: start(label, tree, log_dir, args.serve_args.split()) for label, tree in versions.items()}
        procs = {label: p for label, (p, _) in started.items()}
        urls = {label: u for label, (_, u) in started.items()}
        try:
            for label, url in urls.items():
                wait_healthy(url, procs[label], 300)  # a node that exits says why in its log in log_dir
            labels = list(urls)
            for _ in range(3):  # warm-up
                for label in labels:
                    one(urls[label], [rng.randrange(1000, EMBEDDED_VOCAB) for _ in range(args.prompt_len)])
            samples: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
            for i in range(args.repeats):
                for label in (labels if i % 2 == 0 else labels[::-1]):
                    # Fresh random ids: no prefix-cache hits.
                    prompt = [rng.randrange(1000, EMBEDDED_VOCAB) for _ in range(args.prompt_len)]
                    samples[label].append(one(urls[label], prompt))
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                proc.wait(timeout=60)
    result = {"versions": versions, "prompt_len": args.prompt_len, "repeats": args.repeats, "medians_ms": {},
              "samples": samples}
    for label, rows in samples.items():
        med = {key: statistics.median(r[key] for r in rows) * 1e3 for key in rows[0]}
        result["medians_ms"][label] = med
        print(f"{label}: TTFT {med['ttft']:.2f} ms, engine {med['engine']:.2f}, fixed {med['fixed']:.2f} "
              f"(api {med['api']:.2f}, http {med['http']:.2f})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
