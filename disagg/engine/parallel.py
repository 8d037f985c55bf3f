"""TPGroup: one rank's place in a tensor-parallel group, and the collectives the sharded model runs.

The ranks of an engine are one driver (rank 0, the engine's own process) and `size - 1` worker
processes (tp_workers.py). They meet at a TCPStore the driver hosts on 127.0.0.1 and form their own
process group (gloo on the CPU, NCCL on CUDA), not torch.distributed's global one, so that an engine
sets no state in the process it lives in. A group of size 1 runs no collective at all: TP=1 is the
single-device engine, bit for bit.
"""

import datetime

import torch
import torch.distributed as dist

# A step's collectives wait this long for the other ranks; a rank that dies breaks them at once
# (gloo and NCCL see its connections close), so this bounds only a rank that hangs alive.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# Workers join right after they start (imports only), before they load their shards.
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=2)


class TPGroup:
    def __init__(self, rank: int, size: int, device: torch.device, pg=None):
        self.rank = rank
        self.size = size
        self.device = device  # this rank's
        self.pg = pg  # None when size == 1

    @classmethod
    def single(cls, device: torch.device) -> "TPGroup":
        return cls(0, 1, device)

    @staticmethod
    def host_store(size: int) -> dist.TCPStore:
        """The driver's rendezvous store, on a free loopback port (`store.port`) the workers are told."""
        return dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                             timeout=RENDEZVOUS_TIMEOUT)

    @classmethod
    def join(cls, rank: int, size: int, device: torch.device, store: dist.TCPStore | None = None,
             port: int | None = None) -> "TPGroup":
        """Form the group: the driver passes its store, a worker the store's port."""
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = COLLECTIVE_TIMEOUT
            pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            pg = dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)
        return cls(rank, size, device, pg)

    def split(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of n things cut into `size` contiguous parts as even as they go."""
        return n * self.rank // self.size, n * (self.rank + 1) // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (row-parallel products' partial sums)."""
        if self.size > 1:
            self.pg.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (all of the same shape), in rank order."""
        if self.size == 1:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x.contiguous()]).wait()
        return parts

    def send(self, x: torch.Tensor, rank: int) -> None:
        self.pg.send([x.contiguous()], rank, 0).wait()

    def recv(self, x: torch.Tensor, rank: int) -> None:
        self.pg.recv([x], rank, 0).wait()

    def min(self, value: int) -> int:
        """The smallest of the ranks' values (the KV blocks every rank has room for)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], options).wait()
        return int(t.item())
