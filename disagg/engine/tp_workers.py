"""TPWorkers: the processes of tensor-parallel ranks 1..N-1, driven by the engine's process (rank 0).

The driver runs the scheduler, the block manager, the prefix cache and the sampler; every rank
(the driver included) runs the same ModelRunner on its shard of the model and its own KVCache, which
holds its KV heads' share of every block (docs/ARCHITECTURE.md, "Tensor parallelism"). Before each
forward the driver sends each worker a `StepMessage` over a pipe: the batch as the model runner reads
it (tokens, positions, block tables), so that each worker runs the very same step and meets the
driver in the same collectives. A worker mirrors the sequences of the step as plain `Sequence`s;
it holds no request state beyond the last step.

A rank that dies is seen at once: its collectives raise in the other ranks (its connections
close), and a watchdog thread here names it and calls `on_death` (a serving node exits: AsyncEngine).
A worker exits on the driver's `close` (the engine's close: every rank releases the group) or when
the driver's pipe closes (a failure, the driver's exit), and, should it be stuck where it never reads the pipe
(a collective that waits for a driver killed mid-step: on CUDA a kernel that spins on the GPU for
good), once its parent process is gone (`exit_with`), so none outlives its driver.
"""

import atexit
import dataclasses
import functools
import logging
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp

from disagg.engine.config import EngineConfig
from disagg.engine.parallel import TPGroup, symmetric_bytes
from disagg.engine.sampling_params import SamplingParams
from disagg.engine.scheduler import ScheduledSeq
from disagg.engine.sequence import KVExport, Sequence

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5  # how often a worker checks that its driver is alive

# What a rank_service returns in a worker's process, if anything: put(request_id, first, end, kv) gets that
# rank's KV heads of layers [first, end) of an export with own_heads, as KVExport.put does on the driver.
ExportPut = Callable[[str, int, int, torch.Tensor], None]


class RankDied(RuntimeError):
    """A tensor-parallel rank is gone: the engine cannot compute any more."""


@dataclass
class StepSeq:
    """One sequence of a step, as much of it as the model runner reads."""
    request_id: str
    tokens: list[int]  # its token ids from num_computed_tokens, one past the step's (a prompt logprob's target)
    num_computed_tokens: int
    num_new_tokens: int
    num_tokens: int
    num_prompt_tokens: int
    block_table: list[int]
    prompt_logprobs: int | None
    export: KVExport | None  # its KVExport's state (a prefill node's), without its callbacks

    @classmethod
    def of(cls, item: ScheduledSeq) -> "StepSeq":
        seq, start, export = item.seq, item.seq.num_computed_tokens, item.seq.kv_export
        if export is not None:  # its state as the step starts; a worker's put drops what it is given
            export = dataclasses.replace(export, put=None, first_token=None)
        return cls(seq.request_id, seq.token_ids[start:start + item.num_new_tokens + 1], start,
                   item.num_new_tokens, seq.num_tokens, seq.num_prompt_tokens, list(seq.block_table),
                   seq.params.prompt_logprobs, export)


@dataclass
class KVLoad:
    """KV received from elsewhere for a sequence's blocks from token `start` on: each worker's heads of
    it follow the message, sent by the driver over the group."""
    block_ids: list[int]
    start: int
    num_tokens: int


@dataclass
class StepMessage:
    method: str  # the ModelRunner method: "run", "run_ahead" or "all_logits"; or "load_kv", or "close"
    batch: list[StepSeq]
    load: KVLoad | None = None
    placeholders: bool = False  # run_ahead: input tokens -(i + 1) are row i of the last run_ahead's tokens


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the driver's GPU index + r on CUDA (cuda:0 and cuda:1 for TP=2 from cuda:0)."""
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


class TPWorkers:
    def __init__(self, processes: list, pipes: list):
        self.processes = processes  # rank i + 1 at index i
        self.pipes = pipes
        self.tp: TPGroup | None = None  # the driver's place in the group, once formed
        self.kv_heads: list[tuple[int, int]] = []  # each rank's KV heads, set by the builder
        self.channels: list = []  # rank i + 1's rank_service channel at index i (EngineConfig.rank_service)
        self.dead: str | None = None  # why the group can no longer compute
        self.stopping = False
        # Called once, on the watchdog thread, when a worker dies while the engine runs.
        self.on_death: Callable[[str], None] = lambda reason: None
        self.watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self.watchdog.start()
        atexit.register(self.stop)  # before multiprocessing's own exit handler terminates them

    @classmethod
    def start(cls, config: EngineConfig, model_dir: Path, hidden_size: int, dtype: torch.dtype,
              device: torch.device) -> tuple["TPWorkers", TPGroup]:
        """Spawn ranks 1..N-1 and form the group with them as rank 0; returns it once all have joined
        (before they load their shards)."""
        size = config.tensor_parallel_size
        store = TPGroup.host_store(size)
        ctx = mp.get_context("spawn")  # no fork of a process with threads (and CUDA) running
        processes, pipes, channels = [], [], []
        for rank in range(1, size):
            receive, send = ctx.Pipe(duplex=False)
            mine, theirs = ctx.Pipe() if config.rank_service is not None else (None, None)
            process = ctx.Process(target=worker_main, name=f"disagg-tp-rank{rank}", daemon=True,
                                  args=(config, model_dir, dtype, device, rank, store.port, receive,
                                        torch.get_num_threads(), logging.getLogger().level, theirs))
            process.start()
            receive.close()
            if theirs is not None:
                theirs.close()
                channels.append(mine)
            processes.append(process)
            pipes.append(send)
        workers = cls(processes, pipes)
        workers.channels = channels
        workers.tp = TPGroup.join(0, size, device, store=store,
                                  symmetric_bytes=symmetric_bytes_for(config, hidden_size, dtype))
        logger.info("tensor parallelism %d: rank 0 here (pid %d) on %s, ranks %s", size, os.getpid(),
                    device, ", ".join(f"{r} (pid {p.pid}) on {rank_device(device, r)}"
                                      for r, p in enumerate(processes, 1)))
        return workers, workers.tp

    def send(self, method: str, batch: list[ScheduledSeq], placeholders: bool = False) -> None:
        """Have every worker run `method` on this batch (the driver runs it too, right after)."""
        self._send(StepMessage(method, [StepSeq.of(item) for item in batch], placeholders=placeholders))

    def load_kv(self, block_ids: list[int], kv: torch.Tensor, start: int) -> None:
        """Each worker's KV heads of `kv` (every head) into its blocks (ModelRunner.load_kv)."""
        self._send(StepMessage("load_kv", [], KVLoad(block_ids, start, kv.shape[2])))
        for rank, (first, end) in enumerate(self.kv_heads[1:], 1):
            self.tp.send(kv[:, :, :, first:end].to(self.tp.device), rank)

    def _send(self, message: StepMessage) -> None:
        if self.dead is not None:
            raise RankDied(self.dead)
        try:
            for pipe in self.pipes:
                pipe.send(message)
        except OSError as e:  # its process is gone; the watchdog says which
            raise RankDied(self.dead or f"a tensor-parallel rank's pipe broke: {e}") from e

    def fail(self, reason: str) -> None:
        """The driver left a step half done: the ranks are out of step for good, so they are stopped."""
        if self.stopping:
            return
        self.dead = self.dead or reason
        logger.error("%s: stopping the tensor-parallel ranks", self.dead)
        self.stop()
        self.on_death(self.dead)

    def stop(self, release: bool = False) -> None:
        """End the workers. `release` (the engine's close, its decode graphs dropped): first every rank
        releases its place in the group at once (TPGroup.close); otherwise (a failure, the process's exit)
        each worker just exits at its pipe's end."""
        if self.stopping:
            return
        self.stopping = True
        if release and self.dead is None and self.tp is not None:
            try:
                for pipe in self.pipes:
                    pipe.send(StepMessage("close", []))
            except OSError:  # a worker is gone: nobody would meet this rank's abort
                pass
            else:
                self.tp.close()  # while the workers close theirs
        for pipe in self.pipes:
            pipe.close()
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.processes, 1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self.stopping:
            return
        rank, process = sentinels[ready[0]]
        process.join()
        code = process.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited ({code})"
        self.dead = f"tensor-parallel rank {rank} (pid {process.pid}) {how}"
        logger.error("%s: the engine cannot compute without it", self.dead)
        self.on_death(self.dead)


def symmetric_bytes_for(config: EngineConfig, hidden_size: int, dtype: torch.dtype) -> int:
    """Each rank's symmetric buffer (parallel.py): none under vLLM's --disable-custom-all-reduce."""
    return 0 if config.disable_custom_all_reduce else symmetric_bytes(config.max_num_batched_tokens, hidden_size, dtype)


def worker_main(config: EngineConfig, model_dir: Path, dtype: torch.dtype, device: torch.device, rank: int,
                port: int, pipe, num_threads: int, log_level: int, channel) -> None:
    """A worker rank: join the group, build this rank's runner, then run each step the driver sends."""
    from disagg.engine.builder import build_rank_runner  # here: the builder imports this module
    from disagg.engine.loader import load_config

    # A worker follows its driver: Ctrl-C or a SIGTERM to the process group stops the driver (gracefully),
    # whose exit ends this one; a worker that died first would take the node down as a failure.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    driver = multiprocessing.parent_process().pid  # as spawned, before any check: it may be gone already
    threading.Thread(target=exit_with, args=(driver,), name="tp-driver-watch", daemon=True).start()
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    torch.set_num_threads(num_threads)
    device = rank_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mc = load_config(model_dir)
    tp = TPGroup.join(rank, config.tensor_parallel_size, device, port=port,
                      symmetric_bytes=symmetric_bytes_for(config, mc.hidden_size, dtype))
    runner = build_rank_runner(config, model_dir, mc, device, dtype, tp)
    export_put = None  # what gets this rank's KV heads of an export with own_heads, by request id
    if channel is not None:
        export_put = config.rank_service(rank, runner.kv_cache, channel)
    seqs: dict[str, Sequence] = {}
    ahead: torch.Tensor | None = None  # the tokens the last run_ahead chose: the next one's placeholders
    while True:
        try:
            message: StepMessage = pipe.recv()
        except EOFError:  # the driver stopped (or died)
            return
        if message.method == "close":  # the engine's close (TPWorkers.stop)
            runner.close()  # its decode graphs, before the group they captured collectives of
            tp.close()  # beside the driver's own close: NCCL's abort needs every rank's
            return
        if message.method == "load_kv":
            load, kv_cache = message.load, runner.kv_cache
            layers, two, _, heads, dim = kv_cache.kv.shape
            part = torch.empty(layers, two, load.num_tokens, heads, dim, dtype=kv_cache.kv.dtype, device=device)
            tp.recv(part, 0)
            kv_cache.scatter(load.block_ids, part, load.start)
            continue
        seqs = {step.request_id: mirror(step, seqs.get(step.request_id), export_put) for step in message.batch}
        batch = [ScheduledSeq(seqs[step.request_id], step.num_new_tokens) for step in message.batch]
        if message.method == "run_ahead":
            _, ahead = runner.run_ahead(batch, ahead if message.placeholders else None)
        else:
            getattr(runner, message.method)(batch)


def exit_with(driver: int) -> None:
    """Exit once the driver process is gone (this process is then another's child), whatever the
    worker's main thread is waiting for."""
    while os.getppid() == driver:
        time.sleep(PARENT_POLL_S)
    os._exit(1)


def mirror(step: StepSeq, seq: Sequence | None, export_put: ExportPut | None = None) -> Sequence:
    """The driver's sequence as this step reads it: its block table (the same list while it only grows,
    so a device block table sends only new entries), the tokens the step computes and its export, whose
    put is `export_put` for this request where each rank hands out its own KV heads."""
    if seq is None:
        seq = Sequence(step.request_id, [0] * step.num_prompt_tokens,
                       SamplingParams(prompt_logprobs=step.prompt_logprobs))
    seq.token_ids[step.num_tokens:] = []
    seq.token_ids.extend([0] * (step.num_tokens - len(seq.token_ids)))
    start = step.num_computed_tokens
    seq.token_ids[start:start + len(step.tokens)] = step.tokens
    seq.num_computed_tokens = start
    seq.kv_export = None
    if step.export is not None:
        own = step.export.own_heads and export_put is not None
        seq.kv_export = dataclasses.replace(step.export, put=functools.partial(export_put, step.request_id)
                                            if own else _drop)
    old = seq.block_table
    if step.block_table[:len(old)] == old:
        old.extend(step.block_table[len(old):])
    else:  # rebuilt (preempted, or given new blocks)
        seq.block_table = step.block_table
    return seq


def _drop(first: int, end: int, kv: torch.Tensor) -> None:
    """A worker's export whose KV the driver hands out, gathered from every rank."""
