"""The all-reduce of a TP=2 decode step, on two GPUs: NCCL against the engine's TPGroup.all_reduce
(PyTorch's symmetric-memory one-shot all-reduce up to ONE_SHOT_MAX_BYTES: peer-to-peer loads over
NVLink, no multicast), each inside a CUDA graph as the decode steps capture them.

One process a GPU, each forming its group with TPGroup.join, as the engine's ranks do. Sizes: a decode step's hidden
states at batch 1, 8, 32, 128 and 256 of the 8B shape (4,096 bf16 values a token: 8 KiB to 2 MiB), and a 4,096-token
prefill's (32 MiB). Per size and kind: µs per all-reduce (a graph of 64 replayed 20 times, median of 5), and whether
the sum is right. Above ONE_SHOT_MAX_BYTES also PyTorch's two-shot all-reduce over symmetric memory (`two_shot`:
a copy into the symmetric buffer, then a reduce-scatter and an all-gather by NVLink loads).

    python benchmarks/allreduce_h200x2.py --json out.json
"""

import argparse
import json
import statistics

import torch
import torch.multiprocessing as mp

from disagg.engine.parallel import ONE_SHOT_MAX_BYTES, TPGroup

HIDDEN = 4096
GRAPH_OPS = 64


def time_in_graph(op, x: torch.Tensor) -> float:
    """µs per op: GRAPH_OPS ops captured in one graph, replayed 20 times, median of 5."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            op(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_OPS):
            op(x)
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / (20 * GRAPH_OPS))
    return statistics.median(samples)


def worker(rank: int, size: int, port: int, sizes: list[int], queue) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = TPGroup.host_store(size) if rank == 0 else None
    if rank == 0:
        queue.put(store.port)
    tp = TPGroup.join(rank, size, device, store=store, port=None if rank == 0 else port)

    def nccl(x: torch.Tensor) -> torch.Tensor:
        tp.pg.allreduce([x]).wait()
        return x

    kinds = {"nccl": nccl, "engine": tp.all_reduce}  # engine: one-shot up to ONE_SHOT_MAX_BYTES
    result: dict = {"one_shot_set_up": tp.one_shot is not None}
    large = [numel for numel in sizes if numel * 2 > ONE_SHOT_MAX_BYTES]
    if large and tp.one_shot is not None:  # PyTorch's two-shot all-reduce, for a prefill's larger messages
        import torch.distributed._symmetric_memory as symm_mem

        group_name = tp.one_shot[1]
        buffer = symm_mem.empty(max(large), dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buffer, group_name)

        def two_shot(x: torch.Tensor) -> torch.Tensor:
            part = buffer[:x.numel()]
            part.copy_(x)
            return torch.ops.symm_mem.two_shot_all_reduce_out(part, "sum", group_name, x)

        kinds["two_shot"] = two_shot
    for numel in sizes:
        for name, op in kinds.items():
            if name == "two_shot" and numel not in large:
                continue
            key = f"{name}/{numel * 2 // 1024}KiB"
            x = torch.full((numel,), float(rank + 1), dtype=torch.bfloat16, device=device)
            ok = bool((op(x.clone()) == sum(range(1, size + 1))).all())
            result[key] = {"us": round(time_in_graph(op, x), 2), "correct": ok}
            torch.cuda.synchronize()
    if rank == 0:
        queue.put(result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,32,128,256,4096")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sizes = [int(t) * HIDDEN for t in args.tokens.split(",")]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(0, 2, None, sizes, queue))]
    procs[0].start()
    try:
        port = queue.get(timeout=60)  # rank 0's store
        procs.append(ctx.Process(target=worker, args=(1, 2, port, sizes, queue)))
        procs[1].start()
        result = queue.get(timeout=240)  # a rank stuck in a collective is killed below
    finally:
        for p in procs:
            p.join(10)
            p.kill()
    result["torch"] = torch.__version__
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
