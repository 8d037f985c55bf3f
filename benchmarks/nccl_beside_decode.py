"""What an NCCL receive waiting on a decode node's GPU costs the decode steps beside it, by the
communicator's CTA cap (`max_ctas`), and what the cap costs the transfer (two GPUs).

A served 1P1D decode node's trace showed NCCL kernels beside 65% of its decode steps under load, and
those steps 0.3-0.4 ms (6%) slower at 9-12 sequences: a KV part's receive is queued as its header
arrives, and waits on the GPU, holding its CTAs' SMs, until the prefill node's layers have computed
it. Here the decode step is a chain of bfloat16 GEMMs of the 8B shape (32 layers: qkv, o, gate_up,
down) at M = 8 and 16 rows; GPU 1 times it alone, then beside a 512 MiB receive that GPU 0 answers only
after the timing, for each cap; then the cap's bandwidth for 512 MiB sent and received.

    python benchmarks/nccl_beside_decode.py --json out.json
"""

import argparse
import json
import os
import statistics
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, QKV, INTER, LAYERS = 4096, 6144, 14336, 32
MESSAGE = 512 << 20
ROWS = (8, 16)  # the decode batch's rows: 8 and 16 are two of the engine's CUDA-graph buckets
STEPS, REPEATS = 20, 5


def nccl_group(store: dist.Store, rank: int, cap: int | None) -> dist.ProcessGroup:
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)  # as the torch_dist pipe's
    if cap is not None:
        options.config.max_ctas = cap
    return dist.ProcessGroupNCCL(dist.PrefixStore(f"nccl-{cap}", store), rank, 2, options)


def decode_steps(weights: list[torch.Tensor], x: torch.Tensor) -> float:
    """ms per step, over STEPS steps."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(STEPS):
        for w in weights:
            torch.mm(x[:, :w.shape[1]], w.t())
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / STEPS


def worker(rank: int, port: int, caps: list, out: dict) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=120))
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, 2, timeout=timedelta(seconds=120))
    buf = torch.empty(MESSAGE, dtype=torch.uint8, device="cuda")
    weights: list[torch.Tensor] = []
    xs: dict[int, torch.Tensor] = {}
    if rank == 1:
        shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.01 for _ in range(LAYERS)
                   for n, k in shapes]
        xs = {m: torch.randn(m, INTER, dtype=torch.bfloat16, device="cuda") for m in ROWS}
        for x in xs.values():
            decode_steps(weights, x)  # warm-up
    results = {}
    for cap in caps:
        pg = nccl_group(store, rank, cap)
        times = []
        for _ in range(REPEATS + 1):  # the first: warm-up (forms the communicator)
            torch.cuda.synchronize()
            gloo.barrier().wait()
            t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t[0].record()
            (pg.send([buf], 1, 0) if rank == 0 else pg.recv([buf], 0, 0)).wait()
            t[1].record()
            t[1].synchronize()
            times.append(t[0].elapsed_time(t[1]))
        row = {"gbps": round(MESSAGE / (statistics.median(times[1:]) / 1e3) / 1e9, 1)}
        for m in ROWS:
            if rank == 0:
                gloo.barrier().wait()
                gloo.barrier().wait()  # the receiver's timing is done
                pg.send([buf], 1, 0).wait()
                continue
            alone = statistics.median(decode_steps(weights, xs[m]) for _ in range(REPEATS))
            gloo.barrier().wait()
            work = pg.recv([buf], 0, 0)  # the sender answers after the timing: it waits, spinning
            beside = statistics.median(decode_steps(weights, xs[m]) for _ in range(REPEATS))
            gloo.barrier().wait()
            work.wait()
            row[f"m{m}"] = {"alone_ms": round(alone, 3), "beside_recv_ms": round(beside, 3),
                            "slowdown": round(beside / alone - 1, 4)}
        torch.cuda.synchronize()
        results[str(cap)] = row
        if rank == 1:
            print(f"max_ctas {cap}: {row}", flush=True)
    if rank == 1:
        out["results"] = results
    gloo.barrier().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caps", default="none,16,8,4,2", help="max_ctas values; none: NCCL's default")
    ap.add_argument("--json")
    args = ap.parse_args()
    caps = [None if c == "none" else int(c) for c in args.caps.split(",")]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(29517, caps, out), nprocs=2)
        result = {"device": torch.cuda.get_device_name(0), "message_bytes": MESSAGE, **dict(out)}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
