"""Pipe bandwidth: GB/s per pipe and message size, between two processes.

    python benchmarks/pipe_bandwidth.py [--pipes tcp,torch_dist,ucx] [--sizes 1M,16M,256M]
                                        [--repeats 5] [--json PATH] [--per-message]

Cases: one uint8 tensor per size, and a request's KV as 30 layer tensors of
[2, 1024 tokens, 3 kv heads, 64] bfloat16 (22.5 MiB in all). Baselines in the same
run: `raw_socket` (plain sendall / recv_into of the same bytes over loopback TCP) and,
with 2 CUDA devices, `raw_nccl` (NCCL send/recv); with 2 CUDA devices the pipes move
CUDA tensors from cuda:0 to cuda:1.

Each repeat sends a burst of back-to-back messages and ends when the receiver
acknowledges the last one; GB/s is the median over repeats of burst bytes / burst time
(1 GB = 1e9 bytes). A burst is at least --burst-bytes and 4 to 256 messages. Between GPUs
the default is 4 GiB (15 ms at 16 MiB): a pipe that sends a header ahead of its data pays
about 0.3 ms per burst, once, to start and to acknowledge it (the receiver waits for the
first header before posting its first recv, and it sleeps on the socket until the sender
is far enough ahead), which is 8% of a 1 GiB burst and would hide the per-message rate
the benchmark is for. On the CPU the default is 64 MiB.

A pipe sends from and receives into views of one buffer registered with it once on each side
(`KVPipe.register`), as a decode node receives into its KV cache: nixl then registers nothing and
sends no metadata per message. --per-message uses tensors of their own instead (nixl registers
them per message on both sides, and sends the receiver's metadata per message).
"""

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch

from disagg import pipes
from disagg.pipes import PipeConfig

KV_LAYERS, KV_SHAPE = 30, (2, 1024, 3, 64)
KV_CASE = "kv_30x[2,1024,3,64]bf16"
WARMUP = 1


@dataclass
class Record:
    pipe: str
    case: str
    bytes: int  # one message
    gbps: float  # median over repeats


@dataclass
class Case:
    name: str
    shapes: list[tuple[int, ...]]
    dtype: torch.dtype
    burst_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(torch.Size(s).numel() for s in self.shapes) * self.dtype.itemsize

    @property
    def burst(self) -> int:
        return max(4, min(256, self.burst_bytes // self.nbytes))

    def tensors(self, device: torch.device) -> list[torch.Tensor]:
        return [torch.ones(s, dtype=self.dtype, device=device) for s in self.shapes]


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return (
        int(text[:-1]) * units[text[-1].upper()]
        if text[-1].upper() in units
        else int(text)
    )


def cases(sizes: list[int], burst_bytes: int) -> list[Case]:
    out = [
        Case(f"{s >> 20}MiB" if s >= 1 << 20 else f"{s}B", [(s,)], torch.uint8, burst_bytes)
        for s in sizes
    ]
    return out + [Case(KV_CASE, [KV_SHAPE] * KV_LAYERS, torch.bfloat16, burst_bytes)]


def devices() -> tuple[torch.device, torch.device]:
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return torch.device("cuda", 0), torch.device("cuda", 1)
    return torch.device("cpu"), torch.device("cpu")


# ---- the sender process -------------------------------------------------------------


def sender(
    pipe_name: str,
    address: tuple[str, int],
    case_list: list[Case],
    repeats: int,
    per_message: bool,
    results: mp.Queue,
) -> None:
    device = devices()[0]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if pipe_name == "raw_socket":
        link = RawSocket(socket.create_connection(address))
    elif pipe_name == "raw_nccl":
        link = RawNccl(address, rank=0, device=device)
    else:
        link = pipes.connect(pipe_name, PipeConfig(timeout=120), *address)
    for case, tensors in zip(case_list, buffers(link, case_list, device, per_message)):
        times = []
        for _ in range(WARMUP + repeats):
            start = time.perf_counter()
            for _ in range(case.burst):
                link.send(tensors)
            link.recv()  # the receiver's ack of the burst
            times.append(time.perf_counter() - start)
        gbps = statistics.median(
            case.burst * case.nbytes / t / 1e9 for t in times[WARMUP:]
        )
        results.put(asdict(Record(pipe_name, case.name, case.nbytes, gbps)))
    link.close()


# ---- the receiver (this process) ----------------------------------------------------


def buffers(link, case_list: list[Case], device: torch.device, per_message: bool) -> list[list[torch.Tensor]]:
    """Where each case is sent from or received into: for a pipe, views of one buffer registered with
    it once (a KV cache's blocks), unless per_message; for a baseline, tensors of their own."""
    if per_message or not isinstance(link, pipes.KVPipe):
        return [case.tensors(device) for case in case_list]
    buffer = torch.ones(max(case.nbytes for case in case_list), dtype=torch.uint8, device=device)
    link.register(buffer)
    out = []
    for case in case_list:
        flat = buffer[:case.nbytes].view(case.dtype).split([torch.Size(s).numel() for s in case.shapes])
        out.append([chunk.view(s) for chunk, s in zip(flat, case.shapes)])
    return out


def receive(link, case_list: list[Case], repeats: int, device: torch.device, per_message: bool) -> None:
    for case, out in zip(case_list, buffers(link, case_list, device, per_message)):
        for _ in range(WARMUP + repeats):
            for _ in range(case.burst):
                link.recv(out=out)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            link.send(None)


def run_pipe(pipe_name: str, case_list: list[Case], repeats: int, per_message: bool) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    device = devices()[1]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if pipe_name == "raw_socket":
        server = socket.create_server(("127.0.0.1", 0))
        address = server.getsockname()[:2]
    elif pipe_name == "raw_nccl":
        server = socket.create_server(
            ("127.0.0.1", 0)
        )  # only to reserve a port for the store
        address = server.getsockname()[:2]
        server.close()
    else:
        server = pipes.listen(pipe_name, PipeConfig(kv_port=0, timeout=120))
        address = server.address
    proc = ctx.Process(
        target=sender, args=(pipe_name, address, case_list, repeats, per_message, results)
    )
    proc.start()
    if pipe_name == "raw_socket":
        link = RawSocket(server.accept()[0])
    elif pipe_name == "raw_nccl":
        link = RawNccl(address, rank=1, device=device)
    else:
        link = server.accept(timeout=120)
    receive(link, case_list, repeats, device, per_message)
    records = [results.get(timeout=120) for _ in case_list]
    proc.join(timeout=60)
    link.close()
    if pipe_name != "raw_nccl":
        server.close()
    return records


# ---- baselines ----------------------------------------------------------------------


class RawSocket:
    """The floor a tcp pipe is measured against: bytes only, no header, no checks."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    def send(self, tensors: list[torch.Tensor] | None) -> None:
        for t in tensors or []:
            self.sock.sendall(memoryview(t.cpu().reshape(-1).view(torch.uint8).numpy()))
        if tensors is None:
            self.sock.sendall(b"\0")

    def recv(self, out: list[torch.Tensor] | None = None) -> None:
        if out is None:
            self.sock.recv(1)
            return
        for t in out:
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            got = 0
            while got < len(view):
                got += self.sock.recv_into(view[got:])

    def close(self) -> None:
        self.sock.close()


class RawNccl:
    """NCCL send/recv of the same tensors on a private 2-rank group, the GPU floor."""

    def __init__(self, address: tuple[str, int], rank: int, device: torch.device):
        import torch.distributed as dist

        store = dist.TCPStore(
            address[0],
            address[1],
            2,
            is_master=rank == 1,
            timeout=timedelta(seconds=120),
        )
        self.group = dist.ProcessGroupNCCL(store, rank, 2)
        self.peer, self.device = 1 - rank, device
        self.ack = torch.zeros(1, device=device)

    def send(self, tensors: list[torch.Tensor] | None) -> None:
        for t in tensors if tensors is not None else [self.ack]:
            self.group.send([t], self.peer, 0).wait()

    def recv(self, out: list[torch.Tensor] | None = None) -> None:
        for t in out if out is not None else [self.ack]:
            self.group.recv([t], self.peer, 0).wait()
        if out is None:  # the ack: the sender's clock stops once it has really arrived
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.group.abort()  # as the torch_dist pipe does; no watchdog errors at exit


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--pipes",
        default=",".join(pipes.PIPES),
        help="comma-separated pipes to measure",
    )
    p.add_argument("--sizes", default="1M,16M,256M", help="single-tensor message sizes")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--burst-bytes",
        help="least bytes per timed burst (default 4G between GPUs, 64M on the CPU)",
    )
    p.add_argument("--json", help="write the records here")
    p.add_argument("--per-message", action="store_true",
                   help="send and receive tensors of their own, not views of a buffer registered once")
    args = p.parse_args()

    on_gpu = devices()[0].type == "cuda"
    burst_bytes = parse_size(args.burst_bytes or ("4G" if on_gpu else "64M"))
    case_list = cases([parse_size(s) for s in args.sizes.split(",")], burst_bytes)
    names = ["raw_nccl" if on_gpu else "raw_socket", *args.pipes.split(",")]
    records = []
    for name in names:
        try:
            records += run_pipe(name, case_list, args.repeats, args.per_message)
        except ImportError as e:
            print(f"skipping {name}: {e}")
    print(f"{'pipe':<12} {'case':<26} {'bytes':>11} {'GB/s':>8}")
    for r in records:
        print(f"{r['pipe']:<12} {r['case']:<26} {r['bytes']:>11} {r['gbps']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [
                    {
                        "pipe": r["pipe"],
                        "bytes": r["bytes"],
                        "gbps": r["gbps"],
                        "case": r["case"],
                    }
                    for r in records
                ],
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
