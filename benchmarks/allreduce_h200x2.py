"""The all-reduces of a TP=2 engine, on two GPUs: NCCL against the engine's TPGroup.all_reduce (PyTorch's
symmetric-memory one-shot all-reduce up to ONE_SHOT_MAX_BYTES: peer-to-peer loads over NVLink, no
multicast) and, for larger parts, the engine's sum of a prefill's row-parallel product (PyTorch's two-shot
all-reduce, in place in the symmetric buffer the product was written into: `two_shot_in_place`). Up to
ONE_SHOT_MAX_BYTES also what follows a decode step's product, the sum with the residual add and RMSNorm:
the engine's one kernel reading the parts in their slots (`sum_norm`, TPGroup.sum_add_norm) against the
one-shot all-reduce and the norm's kernel after it (`one_shot_then_norm`).

One process a GPU, each forming its group with TPGroup.join, as the engine's ranks do. Sizes: a decode step's hidden
states at batch 1, 8, 32, 128 and 256 of the 8B shape (4,096 bf16 values a token: 8 KiB to 2 MiB), and a 4,096-token
prefill's (32 MiB). Per size and kind: µs per all-reduce, in a CUDA graph as the decode steps capture them (a graph
of 64 replayed 20 times, median of 5) and launched one by one as a prefill's are (`eager_us`), and whether the sum is
right. Above ONE_SHOT_MAX_BYTES also the alternatives to the in-place two-shot: `two_shot` (a copy into the buffer
first, as an all-reduce of a tensor of its own needs) and `one_shot_large` (each rank reads every rank's whole part).

    python benchmarks/allreduce_h200x2.py --json out.json
"""

import argparse
import json
import statistics

import torch
import torch.multiprocessing as mp

from disagg.engine.parallel import ONE_SHOT_MAX_BYTES, TPGroup, symmetric_bytes

HIDDEN = 4096
GRAPH_OPS = 64


def median_us(run, ops: int) -> float:
    """µs per op of run(), which queues `ops` ops: median of 5 timings on the GPU's clock."""
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / ops)
    return statistics.median(samples)


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

    def replay() -> None:
        for _ in range(20):
            graph.replay()

    return median_us(replay, 20 * GRAPH_OPS)


def time_eager(op, x: torch.Tensor) -> float:
    """µs per op launched one by one, as a prefill's all-reduces are: GRAPH_OPS ops, median of 5."""
    for _ in range(3):
        op(x)

    def launch() -> None:
        for _ in range(GRAPH_OPS):
            op(x)

    return median_us(launch, GRAPH_OPS)


def worker(rank: int, size: int, port: int, sizes: list[int], queue) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = TPGroup.host_store(size) if rank == 0 else None
    if rank == 0:
        queue.put(store.port)
    tp = TPGroup.join(rank, size, device, store=store, port=None if rank == 0 else port,
                      symmetric_bytes=symmetric_bytes(max(sizes) // HIDDEN, HIDDEN, torch.bfloat16))

    def nccl(x: torch.Tensor) -> torch.Tensor:
        tp.pg.allreduce([x]).wait()
        return x

    kinds = {"nccl": nccl, "engine": tp.all_reduce}  # engine: one-shot up to ONE_SHOT_MAX_BYTES
    result: dict = {"symmetric_set_up": tp.symmetric is not None}
    large = [numel for numel in sizes if numel * 2 > ONE_SHOT_MAX_BYTES]
    if large and tp.symmetric is not None:  # a prefill's larger parts, in the engine's symmetric buffer
        buffer, group_name = tp.symmetric.buffer.view(torch.bfloat16), tp.symmetric.name

        def two_shot(x: torch.Tensor) -> torch.Tensor:
            part = buffer[:x.numel()]
            part.copy_(x)
            return torch.ops.symm_mem.two_shot_all_reduce_out(part, "sum", group_name, x)

        def two_shot_in_place(x: torch.Tensor) -> torch.Tensor:  # x already in the symmetric buffer
            part = buffer[:x.numel()]
            torch.ops.symm_mem.two_shot_all_reduce_(part, "sum", group_name)
            return part

        def one_shot_large(x: torch.Tensor) -> torch.Tensor:
            part = buffer[:x.numel()]
            return torch.ops.symm_mem.one_shot_all_reduce_out(part, "sum", group_name, x)

        kinds["two_shot"] = two_shot
        kinds["two_shot_in_place"] = two_shot_in_place
        kinds["one_shot_large"] = one_shot_large
    for numel in sizes:
        for name, op in kinds.items():
            if name in ("two_shot", "two_shot_in_place", "one_shot_large") and numel not in large:
                continue
            key = f"{name}/{numel * 2 // 1024}KiB"
            x = torch.full((numel,), float(rank + 1), dtype=torch.bfloat16, device=device)
            if name in ("two_shot_in_place", "one_shot_large"):
                buffer[:numel].copy_(x)
            ok = bool((op(x.clone()) == sum(range(1, size + 1))).all())
            result[key] = {"us": round(time_in_graph(op, x), 2), "eager_us": round(time_eager(op, x), 2), "correct": ok}
            torch.cuda.synchronize()
    if tp.symmetric is not None:
        result |= sum_norm_kinds(tp, [n for n in sizes if n * 2 <= ONE_SHOT_MAX_BYTES
                                      and n // HIDDEN <= tp.symmetric.max_rows], size)
        result["sum_norm_max_rows"] = tp.symmetric.max_rows
    if rank == 0:
        queue.put(result)


def sum_norm_kinds(tp: TPGroup, sizes: list[int], size: int) -> dict:
    """A decode step's sum of a row-parallel product with the residual add and RMSNorm: the fused kernel
    on parts already in their slots (as the product writes them), by turns as the engine takes them,
    against the one-shot all-reduce of the part and the norm's kernel."""
    from disagg.engine.layers import fused_ops
    from disagg.engine.models.llama import RMSNorm

    norm = RMSNorm(HIDDEN, 1e-5).to(tp.device, torch.bfloat16)
    norm.fused_ops = fused_ops
    symmetric, result = tp.symmetric, {}
    for numel in sizes:
        rows = numel // HIDDEN
        residual = torch.zeros(rows, HIDDEN, dtype=torch.bfloat16, device=tp.device)
        slots = [symmetric.buffer[symmetric.region + slot * ONE_SHOT_MAX_BYTES:][:numel * 2].view(torch.bfloat16)
                 .view(rows, HIDDEN) for slot in (0, 1)]
        for part in slots:
            part.fill_(tp.rank + 1)

        def sum_norm(x: torch.Tensor, slots=slots, residual=residual) -> torch.Tensor:
            tp.slot = 1 - tp.slot
            return tp.sum_add_norm(slots[tp.slot], residual, norm)[0]

        def one_shot_then_norm(x: torch.Tensor, residual=residual) -> torch.Tensor:
            return norm(tp.all_reduce(x), residual)[0]

        expected = norm(torch.full_like(residual, sum(range(1, size + 1))), torch.zeros_like(residual))[0]
        for name, op in (("sum_norm", sum_norm), ("one_shot_then_norm", one_shot_then_norm)):
            x = torch.full((rows, HIDDEN), float(tp.rank + 1), dtype=torch.bfloat16, device=tp.device)
            residual.zero_()
            ok = bool(torch.equal(op(x.clone()), expected)) and bool((residual == sum(range(1, size + 1))).all())
            result[f"{name}/{numel * 2 // 1024}KiB"] = {"us": round(time_in_graph(op, x), 2),
                                                        "eager_us": round(time_eager(op, x), 2), "correct": ok}
            torch.cuda.synchronize()
    return result


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
