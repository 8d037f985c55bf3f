"""What `disagg router` and one benchmark client add to a first token at the token rate of four nodes.

    python benchmarks/router_hop.py --tokenizer-dir DIR --json out.json

One colocated node of gpu_e2e.py's random-weight 8B shape on one GPU (bfloat16, --async-scheduling) streams
as many tokens a second as four chat nodes do at 7.5 req/s (short prompts, so that its prefill stays small):
the same requests go to the node directly and through `disagg router` (cache aware, as xpyd_h200x4.py
starts it), at a quarter of that rate and at the whole. Each run keeps the client's TTFT and TPOT, the
node's own API TTFT (its request to its first token, `engine_means`), and the CPU the client and the
router used a second: the client's TTFT less the node's is what the hop and the client add."""

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_disagg_vs_colocated import NodeSpec, System, start_node, stop, wait_ready, warm_up
from gpu_e2e import SHAPES, write_model
from handoff_h200x2 import WORKLOADS, engine_means, engine_sums, node_kwargs, serve_once, start_router
from xpyd_h200x4 import DRY_WORKLOADS

# Chat's answers (lognormal around 512 tokens), prompts an eighth of chat's.
WORKLOADS["stream"] = dict(input_len=128, output_len=512, len_dist="lognormal", len_range=0.6)


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer-dir", required=True, help="a tokenizer.json's directory")
    ap.add_argument("--rates", default="1.875,7.5")
    ap.add_argument("--num-requests", default="120,300", help="a run's requests, one number for each rate")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--work", default="/tmp/router_hop")
    ap.add_argument("--json", required=True)
    ap.add_argument("--dry-run", action="store_true", help="on the CPU: the tiny shape, short prompts, few requests")
    args = ap.parse_args()
    args.async_scheduling, args.max_num_batched_tokens = True, None  # what node_kwargs and serve_once read
    args.kv_cache_memory, args.max_model_len, args.connector, args.kv_buffer_device = "24GiB", 8192, "tcp", "cuda"
    args.device, args.dtype, shape, spec = "cuda", "bfloat16", "8b", NodeSpec(device="cuda", threads=4)
    if args.dry_run:
        WORKLOADS["stream"] = DRY_WORKLOADS["chat"]
        args.device, args.dtype, shape, spec = "cpu", "float32", "tiny", NodeSpec(threads=1)
        args.kv_cache_memory, args.max_model_len, args.rates, args.num_requests = "256MiB", 1024, "2", "6"
    args.vocab = SHAPES[shape]["vocab_size"]
    model = write_model(shape, Path(args.work) / f"llama-{shape}", Path(args.tokenizer_dir), args.device)
    log_dir = Path(args.work) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    kwargs = node_kwargs(args, model, "whole")
    node = start_node("both", log_dir, spec, model=kwargs["model"], dtype=kwargs["dtype"], extra=kwargs["extra"])
    router = None
    result = {"args": vars(args), "runs": {}}
    try:
        wait_ready(node)
        system = System("colocated", node, [node])
        router, router_url = start_router(log_dir, [system], model)
        warm_up(system, args.vocab)
        counts = [int(n) for n in args.num_requests.split(",")]
        for i, (rate, count) in enumerate(zip(args.rates.split(","), counts)):
            serve_once(router_url, args, "stream", rate, 8, 99, [])  # loaded batches of its shape
            for path, url in (("direct", node.url), ("router", router_url)):
                before, router_cpu, start = engine_sums([node]), cpu_seconds(router.pid), time.perf_counter()
                run = serve_once(url, args, "stream", rate, count, args.seed + i, [])
                run["node"] = engine_means(before, engine_sums([node]))
                run["router_cpu"] = round((cpu_seconds(router.pid) - router_cpu) / (time.perf_counter() - start), 3)
                run.pop("per_request")
                result["runs"][f"{path}@{rate}"] = run
                print(f"{path:6s} {rate:>6s} req/s: TTFT p50/p99 {run['median_ttft_ms']:.1f}/"
                      f"{run['p99_ttft_ms']:.1f} ms (mean {run['mean_ttft_ms']:.1f}; the node's own "
                      f"{run['node']['ttft_ms']:.1f}), TPOT p50 "
                      f"{run['median_tpot_ms']:.2f} ms, ITL p99 {run['p99_itl_ms']:.1f} ms, "
                      f"{run['output_throughput']:.0f} tokens/s; CPU a second: client {run['client_cpu']}, "
                      f"router {run['router_cpu']}", flush=True)
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=20)
        stop([node])
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
