"""TPGroup: one rank's place in a tensor-parallel group, and the collectives the sharded model runs.

The ranks of an engine are one driver (rank 0, the engine's own process) and `size - 1` worker
processes (tp_workers.py). They meet at a TCPStore the driver hosts on 127.0.0.1 and form their own
process group (gloo on the CPU, NCCL on CUDA), not torch.distributed's global one, so that an engine
sets no state in the process it lives in (on CUDA but the name symmetric memory finds its group by,
released with it). A group of size 1 runs no collective at all: TP=1 is the single-device engine,
bit for bit.

On CUDA, an all-reduce of up to ONE_SHOT_MAX_BYTES (a decode step's hidden states) is PyTorch's
symmetric-memory one-shot all-reduce: in one kernel, each rank copies its part into a buffer every
rank can read over NVLink and sums all of them itself; measured in CUDA graphs on two H200s
(benchmarks/allreduce_h200x2.py, a copy and then the kernel), 7.4-9.4 µs against NCCL's 22-25 µs
from 8 to 256 KiB. Larger ones, float16 ones, and GPUs where symmetric memory cannot be set up, go
through NCCL. Unlike NCCL's, a one-shot kernel waiting for a dead rank is not ended by an abort: a
serving node exits on its watchdog's word (AsyncEngine), but an offline LLM's step in flight then
never ends.
"""

import datetime
import logging
import threading
import uuid

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A step's collectives wait this long for the other ranks; a rank that dies breaks them at once
# (gloo and NCCL see its connections close), so this bounds only a rank that hangs alive.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# Workers join right after they start (imports only), before they load their shards.
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=2)
ONE_SHOT_MAX_BYTES = 1 << 20  # 128 tokens of a 4,096-wide bf16 model
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)  # PyTorch's kernel has no float16
# NCCL's abort waits for every rank's (it frees memory the others may still read), and for the CUDA
# graphs that captured its collectives: a rank killed before its own abort never comes, and the
# abort is then left unfinished after this long.
ABORT_WAIT_S = 10


class TPGroup:
    def __init__(self, rank: int, size: int, device: torch.device, pg=None, one_shot: tuple | None = None):
        self.rank = rank
        self.size = size
        self.device = device  # this rank's
        self.pg = pg  # None when size == 1
        # (symmetric buffer, group name, the group registered under it), on CUDA where it could be set up;
        # the registry holds the group weakly, so it is kept here
        self.one_shot = one_shot

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
             port: int | None = None, one_shot: bool = True) -> "TPGroup":
        """Form the group: the driver passes its store, a worker the store's port. one_shot: small CUDA
        all-reduces one-shot over symmetric memory where it can be set up (all ranks pass the same)."""
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
        if device.type != "cuda":
            return cls(rank, size, device, dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT))
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        pg = dist.ProcessGroupNCCL(store, rank, size, options)
        return cls(rank, size, device, pg, one_shot_buffer(store, pg, rank, size, device) if one_shot else None)

    def close(self) -> None:
        """Release the group: its NCCL communicator, and the name symmetric memory found it by. Every
        rank calls it at about the same time (the driver right after it sends the workers `close`, each
        worker as it takes that message: TPWorkers.stop): NCCL's abort returns once all ranks abort."""
        if self.one_shot is not None:
            torch._C._distributed_c10d._unregister_process_group(self.one_shot[1])
            self.one_shot = None
        if self.pg is None or self.device.type != "cuda":
            return
        abort = threading.Thread(target=self.pg.abort, name="tp-abort", daemon=True)
        abort.start()
        abort.join(ABORT_WAIT_S)
        if abort.is_alive():
            logger.warning("tensor-parallel rank %d: NCCL's abort did not end in %d s (a rank gone without "
                           "its own); its communicator is left as it is", self.rank, ABORT_WAIT_S)

    def split(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of n things cut into `size` contiguous parts as even as they go."""
        return n * self.rank // self.size, n * (self.rank + 1) // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (row-parallel products' partial sums)."""
        if self.size == 1:
            return x
        one_shot = self.one_shot  # read once: close() may drop it from another thread
        if (one_shot is not None and x.nbytes <= ONE_SHOT_MAX_BYTES and x.is_contiguous()
                and x.dtype in ONE_SHOT_DTYPES):
            buffer, name, _ = one_shot
            flat = x.view(-1)  # the kernel copies it into this rank's buffer itself, then sums every rank's
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer[:x.nbytes].view(x.dtype), flat, "sum", name, flat)
        else:
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


# PyTorch's symmetric memory numbers its store exchanges per process: a driver's second group would wait for
# keys its fresh workers write under other numbers (until the rendezvous times out). So the first group
# of a process gets one-shot all-reduces and any later one (a test's second engine) NCCL's.
_symmetric_memory_used = False


def one_shot_buffer(store: dist.Store, pg, rank: int, size: int, device: torch.device) -> tuple | None:
    """Every rank's symmetric buffer for one-shot all-reduces, the name its group is known by and that group;
    None (NCCL all-reduces only) where PyTorch or the GPUs cannot set it up. Collective: every rank
    calls it right after forming the group."""
    global _symmetric_memory_used
    if rank == 0:  # "" when this process set up symmetric memory before: see _symmetric_memory_used
        store.set("one_shot_group", "" if _symmetric_memory_used else f"disagg-tp-{uuid.uuid4().hex}")
        _symmetric_memory_used = True
    name = store.get("one_shot_group").decode()
    if not name:
        logger.info("rank %d: every all-reduce goes through NCCL (symmetric memory serves one group a process)", rank)
        return None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        torch.ops.symm_mem.one_shot_all_reduce_copy_out  # noqa: B018  raises where this PyTorch lacks it
        # Symmetric memory finds its group by a registered name; ours is private (not in the global
        # world), so it is wrapped and registered under a name of its own.
        group = dist.ProcessGroup(store, rank, size)
        group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        group._register_backend(device, dist.ProcessGroup.BackendType.NCCL, pg)
        group._set_group_name(name)
        torch._C._distributed_c10d._register_process_group(name, group)
        buffer = symm_mem.empty(ONE_SHOT_MAX_BYTES, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buffer, name)
        why = ""
    except Exception as e:  # noqa: BLE001  any reason: the all-reduces go through NCCL, as they can anywhere
        buffer, why = None, str(e) or type(e).__name__
    # Every rank must take the same path: one-shot only where every rank could set it up.
    store.set(f"one_shot_ok/{rank}", "0" if why else "1")
    if all(store.get(f"one_shot_ok/{r}") == b"1" for r in range(size)):
        if rank == 0:
            logger.info("all-reduces of up to %d KiB are one-shot, over symmetric memory", ONE_SHOT_MAX_BYTES >> 10)
        return buffer, name, group
    logger.warning("rank %d: no one-shot all-reduce over symmetric memory (%s): every all-reduce goes through "
                   "NCCL", rank, why or "another rank could not set it up")
    return None
