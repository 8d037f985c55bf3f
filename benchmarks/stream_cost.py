"""What a streamed token costs the node's event loop: CPU time of its main thread per token sent.

    python benchmarks/stream_cost.py [--streams 16] [--tokens 64] [--repeats 3] [--json PATH]

A decode node's event loop (HTTP, the API's formatting, the SSE writes) and its engine thread share
one GIL: every microsecond the loop spends on a token is one the engine thread may wait for before
its next step (the H200 pair's decode node held the GIL in its event loop in 47% of py-spy's
samples at 4 req/s; BENCHMARKS.md, "The event loop's cost per streamed token"). One colocated CPU
node (the embedded model) serves --streams concurrent streamed requests of --tokens tokens
(completions, then chat); the main thread's on-CPU time (/proc schedstat) over each batch of
requests, divided by the tokens streamed, is the cost. Medians of --repeats.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from servers import start_node  # noqa: E402


def thread_cpu_ns(pid: int, tid: int) -> int:
    return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])


def stream(url: str, path: str, body: dict) -> int:
    tokens = 0
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


def run_batch(url: str, pid: int, path: str, body: dict, streams: int) -> dict:
    before = thread_cpu_ns(pid, pid)
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(lambda _: stream(url, path, body), range(streams)))
    wall = time.perf_counter() - start
    main_ns = thread_cpu_ns(pid, pid) - before
    return {"tokens": tokens, "wall_s": wall, "main_thread_us_per_token": main_ns / 1e3 / tokens,
            "main_thread_busy": main_ns / 1e9 / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    common = {"max_tokens": args.tokens, "ignore_eos": True, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}
    kinds = {"completions": ("/v1/completions", common | {"prompt": "Once upon a time"}),
             "chat": ("/v1/chat/completions", common | {"messages": [{"role": "user", "content": "Tell a story."}]})}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        node = start_node("both", Path(tmp), extra_args=["--max-num-seqs", str(args.streams)])
        try:
            stream(node.url, *kinds["completions"])  # warm-up
            for kind, (path, body) in kinds.items():
                runs = [run_batch(node.url, node.proc.pid, path, body, args.streams) for _ in range(args.repeats)]
                results[kind] = {"runs": runs} | {
                    key: statistics.median(r[key] for r in runs)
                    for key in ("main_thread_us_per_token", "main_thread_busy")}
                print(f"{kind}: {results[kind]['main_thread_us_per_token']:.0f} us of the event loop's thread per "
                      f"streamed token ({results[kind]['main_thread_busy']:.0%} busy)", flush=True)
        finally:
            node.kill()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    out = {"commit": commit.strip(), "streams": args.streams, "tokens": args.tokens, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
