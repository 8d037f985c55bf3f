"""TPGroup: one rank's place in a tensor-parallel group, and the collectives the sharded model runs.

The ranks of an engine are one driver (rank 0, the engine's own process) and `size - 1` worker
processes (tp_workers.py). They meet at a TCPStore the driver hosts on 127.0.0.1 and form their own
process group (gloo on the CPU, NCCL on CUDA), not torch.distributed's global one, so that an engine
sets no state in the process it lives in (on CUDA but the name symmetric memory finds its group by,
released with it). A group of size 1 runs no collective at all: TP=1 is the single-device engine,
bit for bit.

A row-parallel product (a layer's o_proj and down_proj) is summed over ranks by the RMSNorm that
follows it: `row_parallel` computes this rank's part, `sum_add_norm` sums the parts, adds the
residual and normalizes. On CUDA, each rank sets up a buffer of symmetric memory (every rank can
read and write every rank's over NVLink) and the parts are written straight into it:
- up to ONE_SHOT_MAX_BYTES (a decode step's), into one of two slots by turns; one Triton kernel
  (fused_ops.sum_rms_norm) meets the other ranks through the signal pads, reads every rank's part
  over NVLink, sums, adds the residual and normalizes. Two slots, because a rank may write its next
  part while the others still read its last one: a slot is written again only after the barrier of
  the part between, which no rank passes before every rank has finished reading the part before
  that. A forward writes two parts a layer, an even count, so every forward (and every CUDA graph
  captured of one) starts at the same slot.
- larger ones (a prefill's), into the buffer's start, summed there in place by PyTorch's two-shot
  all-reduce: 111 µs against NCCL's 138 µs for a 4,096-token prefill's 32 MiB, 215 against 250 µs
  at 64 MiB on two H200s (benchmarks/allreduce_h200x2.py).
The embedding's all-reduce is PyTorch's one-shot all-reduce (6.7-9.3 µs in CUDA graphs against
NCCL's 23-25 µs from 8 to 256 KiB). Anything larger than the buffer, float16 parts, and GPUs where
symmetric memory cannot be set up, go through NCCL. Unlike NCCL's, a symmetric-memory kernel waiting
for a dead rank is not ended by an abort: a serving node exits on its watchdog's word (AsyncEngine),
but an offline LLM's step in flight then never ends.
"""

import datetime
import logging
import threading
import uuid
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)

# A step's collectives wait this long for the other ranks; a rank that dies breaks them at once
# (gloo and NCCL see its connections close), so this bounds only a rank that hangs alive.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
# Workers join right after they start (imports only), before they load their shards.
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=2)
ONE_SHOT_MAX_BYTES = 1 << 20  # 128 tokens of a 4,096-wide bf16 model; also a slot's size
# A fused sum's kernel has a block a token, each spinning at its barrier until the other ranks' same block
# comes: few enough that all of them are resident at once on every rank, whatever else runs beside them.
FUSED_MAX_ROWS = 128
# The symmetric buffer holds a step's row-parallel product up to this (vLLM's and SGLang's bound for
# their symmetric-memory all-reduce on Hopper).
TWO_SHOT_MAX_BYTES = 64 << 20
SYMMETRIC_DTYPES = (torch.bfloat16, torch.float32)  # PyTorch's kernels have no float16
# NCCL's abort waits for every rank's (it frees memory the others may still read), and for the CUDA
# graphs that captured its collectives: a rank killed before its own abort never comes, and the
# abort is then left unfinished after this long.
ABORT_WAIT_S = 10


@dataclass
class Symmetric:
    """This rank's symmetric memory: `region` bytes for one-shot parts and two-shot sums, then two slots
    of ONE_SHOT_MAX_BYTES for the fused sums' parts."""
    buffer: torch.Tensor  # uint8
    name: str  # the group's registered name
    group: object  # the group registered under it: the registry holds it weakly, so it is kept here
    region: int
    slot_ptrs: tuple[torch.Tensor, ...] = ()  # per slot, every rank's address of it (int64, on the device)
    pad_ptrs: torch.Tensor | None = None  # every rank's signal pad (int64, on the device)
    pad_base: int = 0  # the first signal-pad entry the fused sums' barriers use
    max_rows: int = 0  # the most rows a fused sum takes (one barrier entry per row and rank)

    def offset(self, x: torch.Tensor) -> int | None:
        """Where x starts in the buffer, if it lies there."""
        start = x.data_ptr() - self.buffer.data_ptr()
        return start if 0 <= start < self.buffer.nbytes else None


class TPGroup:
    def __init__(self, rank: int, size: int, device: torch.device, pg=None, symmetric: Symmetric | None = None):
        self.rank = rank
        self.size = size
        self.device = device  # this rank's
        self.pg = pg  # None when size == 1
        self.symmetric = symmetric  # on CUDA where it could be set up
        self.slot = 1  # the fused sums' slot last written (row_parallel takes turns)

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
             port: int | None = None, symmetric_bytes: int = 0) -> "TPGroup":
        """Form the group: the driver passes its store, a worker the store's port. symmetric_bytes: on
        CUDA, the symmetric buffer each rank sets up where it can (0: every all-reduce through NCCL;
        all ranks pass the same)."""
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=RENDEZVOUS_TIMEOUT)
        if device.type != "cuda":
            return cls(rank, size, device, dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT))
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        pg = dist.ProcessGroupNCCL(store, rank, size, options)
        return cls(rank, size, device, pg,
                   symmetric_buffer(store, pg, rank, size, device, symmetric_bytes) if symmetric_bytes else None)

    def close(self) -> None:
        """Release the group: its NCCL communicator, and the name symmetric memory found it by. Every
        rank calls it at about the same time (the driver right after it sends the workers `close`, each
        worker as it takes that message: TPWorkers.stop): NCCL's abort returns once all ranks abort."""
        if self.symmetric is not None:
            torch._C._distributed_c10d._unregister_process_group(self.symmetric.name)
            self.symmetric = None
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
        """The sum over ranks, in place."""
        if self.size == 1:
            return x
        symmetric = self.symmetric  # read once: close() may drop it from another thread
        if (symmetric is not None and x.nbytes <= ONE_SHOT_MAX_BYTES and x.is_contiguous()
                and x.dtype in SYMMETRIC_DTYPES):
            flat = x.view(-1)  # the kernel copies it into this rank's buffer itself, then sums every rank's
            part = symmetric.buffer[:x.nbytes].view(x.dtype)
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(part, flat, "sum", symmetric.name, flat)
        else:
            self.pg.allreduce([x]).wait()
        return x

    def row_parallel(self, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """This rank's part of a row-parallel product of tokens [T, in]: the ranks' parts sum to the
        product, which sum_add_norm forms. Written into the symmetric buffer where that sums it: into the
        next slot for a fused sum, else at the buffer's start; the part is then a view of the buffer,
        valid until it is written there again (sum_add_norm reads it first)."""
        symmetric = self.symmetric
        if self.size == 1 or symmetric is None or x.dtype not in SYMMETRIC_DTYPES or linear.bias is not None:
            return linear(x)
        nbytes = x.shape[0] * linear.out_features * x.element_size()
        if symmetric.slot_ptrs and nbytes <= ONE_SHOT_MAX_BYTES and x.shape[0] <= symmetric.max_rows:
            self.slot = 1 - self.slot
            start = symmetric.region + self.slot * ONE_SHOT_MAX_BYTES
        elif ONE_SHOT_MAX_BYTES < nbytes <= symmetric.region:
            start = 0
        else:
            return linear(x)
        out = symmetric.buffer[start:start + nbytes].view(x.dtype).view(x.shape[0], linear.out_features)
        torch.mm(x, linear.weight.t(), out=out)
        return out

    def sum_add_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(x summed over ranks, residual): the RMSNorm of the sum + residual, and that (new) residual.
        x: this rank's part from row_parallel."""
        if self.size == 1:
            return norm(x, residual)
        symmetric = self.symmetric
        start = symmetric.offset(x) if symmetric is not None else None
        if start is not None and start >= symmetric.region and norm.fused_ops is not None:
            # a slot: one kernel sums, adds and normalizes (without the Triton kernels, under the sdpa backend,
            # the part is summed one-shot from there as any other)
            slot = (start - symmetric.region) // ONE_SHOT_MAX_BYTES
            out = norm.fused_ops.sum_rms_norm(symmetric.slot_ptrs[slot], symmetric.pad_ptrs, symmetric.pad_base,
                                              self.rank, residual, norm.weight, norm.eps)
            return out, residual
        if start == 0:
            # Its last barrier waits for every rank's writes and reads: the next part may overwrite the buffer.
            torch.ops.symm_mem.two_shot_all_reduce_(x, "sum", symmetric.name)
        else:
            self.all_reduce(x)
        return norm(x, residual)

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


def symmetric_bytes(max_tokens: int, hidden_size: int, dtype: torch.dtype) -> int:
    """The symmetric buffer's region for a step of up to max_tokens tokens: its row-parallel product, up to
    TWO_SHOT_MAX_BYTES, and at least a one-shot all-reduce's part; none for a dtype PyTorch's kernels lack."""
    if dtype not in SYMMETRIC_DTYPES:
        return 0
    region = max(ONE_SHOT_MAX_BYTES, min(TWO_SHOT_MAX_BYTES, max_tokens * hidden_size * dtype.itemsize))
    return -(-region // 256) * 256  # the slots after it start 16-byte aligned (the fused kernel's loads)


# PyTorch's symmetric memory numbers its store exchanges per process: a driver's second group would wait for
# keys its fresh workers write under other numbers (until the rendezvous times out). So the first group
# of a process gets symmetric memory and any later one (a test's second engine) NCCL's all-reduces.
_symmetric_memory_used = False


def symmetric_buffer(store: dist.Store, pg, rank: int, size: int, device: torch.device,
                     region: int) -> Symmetric | None:
    """Every rank's symmetric memory, `region` bytes (symmetric_bytes) and the fused sums' two slots; None
    (NCCL all-reduces only) where PyTorch or the GPUs cannot set it up. Collective: every rank calls it
    right after forming the group."""
    global _symmetric_memory_used
    if rank == 0:  # "" when this process set up symmetric memory before: see _symmetric_memory_used
        store.set("symmetric_group", "" if _symmetric_memory_used else f"disagg-tp-{uuid.uuid4().hex}")
        _symmetric_memory_used = True
    name = store.get("symmetric_group").decode()
    if not name:
        logger.info("rank %d: every all-reduce goes through NCCL (symmetric memory serves one group a process)", rank)
        return None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        torch.ops.symm_mem.one_shot_all_reduce_copy_out  # noqa: B018  raise where this PyTorch lacks them
        torch.ops.symm_mem.two_shot_all_reduce_  # noqa: B018
        # Symmetric memory finds its group by a registered name; ours is private (not in the global
        # world), so it is wrapped and registered under a name of its own.
        group = dist.ProcessGroup(store, rank, size)
        group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        group._register_backend(device, dist.ProcessGroup.BackendType.NCCL, pg)
        group._set_group_name(name)
        torch._C._distributed_c10d._register_process_group(name, group)
        buffer = symm_mem.empty(region + 2 * ONE_SHOT_MAX_BYTES, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buffer, name)
        # The fused sums' barriers take the upper half of each signal pad, away from PyTorch's kernels'
        # (which count their blocks' entries from 0).
        entries = handle.signal_pad_size // 4
        at = buffer.data_ptr() - handle.buffer_ptrs[rank] + region  # the slots, from each rank's allocation
        symmetric = Symmetric(
            buffer, name, group, region,
            # the fused kernel's barrier indexes the ranks with tl.arange: a power-of-two group
            slot_ptrs=tuple(torch.tensor([p + at + slot * ONE_SHOT_MAX_BYTES for p in handle.buffer_ptrs],
                                         dtype=torch.int64, device=device) for slot in (0, 1))
            if size & (size - 1) == 0 else (),
            pad_ptrs=torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device),
            pad_base=entries // 2, max_rows=min(FUSED_MAX_ROWS, (entries - entries // 2) // size))
        why = ""
    except Exception as e:  # noqa: BLE001  any reason: the all-reduces go through NCCL, as they can anywhere
        symmetric, why = None, str(e) or type(e).__name__
    # Every rank must take the same path: symmetric memory only where every rank could set it up.
    store.set(f"symmetric_ok/{rank}", "0" if why else "1")
    if all(store.get(f"symmetric_ok/{r}") == b"1" for r in range(size)):
        if rank == 0:
            logger.info("all-reduces over symmetric memory: a decode step's products summed with their norm "
                        "up to %d KiB and %d tokens, larger ones two-shot up to %d MiB", ONE_SHOT_MAX_BYTES >> 10,
                        symmetric.max_rows, region >> 20)
        return symmetric
    logger.warning("rank %d: no all-reduce over symmetric memory (%s): every all-reduce goes through "
                   "NCCL", rank, why or "another rank could not set it up")
    return None
