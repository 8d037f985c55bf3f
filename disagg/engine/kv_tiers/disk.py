"""DiskTier: KV blocks as files in a local directory, under the host tier (docs/ARCHITECTURE.md,
"Engine (as built)").

One file per block, named by the model/dtype/layout identity and the block's chained hash, so a
directory can be shared by engines of different models and survives a restart (the directory is
scanned at start). A file is a header (magic, version, identity, hash, the block's token ids,
payload size, CRC-32 of the payload) and the block's bytes as the host tier holds them. A file
whose header or checksum is wrong is a miss, never loaded, and is deleted.

Writes and reads run on background threads, never on the engine's step: one writer (a block's
write and its later delete stay in order) and READERS readers (a prefix's blocks arrive in any
order; the engine waits for all of them). The index (which files exist, least recently used first)
is kept on the engine thread alone, which learns of finished jobs by polling `results()`. The
total size is bounded: the least recently used files are deleted. A failed write (disk full,
directory gone) stops writing, with one warning; reads go on.
"""

import contextlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from disagg.engine.kv_tiers.stats import TierStats

logger = logging.getLogger(__name__)

MAGIC = b"DKVB"
VERSION = 1
HEADER = struct.Struct("<4sI32sQIQI")  # magic, version, identity, hash, tokens, payload bytes, crc32
# One thread reads and checksums a prefix at ~1.4 GB/s on the H200 machine (BENCHMARKS.md, "KV tiers
# on one H200"): slower than recomputing it. Both the read and zlib.crc32 let go of the GIL.
READERS = 4


@dataclass
class DiskJob:
    kind: str  # "write", "read" or "delete"
    h: int  # the block's chain hash, 64 bits unsigned
    token_ids: tuple[int, ...] = ()
    data: torch.Tensor | None = None  # a pinned host-tier block: the source of a write, the target of a read
    tag: object = None  # the caller's, handed back with the result


@dataclass
class DiskResult:
    job: DiskJob
    ok: bool
    seconds: float
    error: str = ""
    corrupt: bool = False  # the file is wrong or gone: it leaves the index (a failed read alone does not)


class CorruptFile(Exception):
    """A file's header or checksum does not match what was asked for."""


class DiskTier:
    def __init__(self, path: str | Path, max_bytes: int, identity: bytes, block_bytes: int, block_size: int):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.identity = identity  # 32 bytes: a digest of model, dtype and KV layout
        self.prefix = identity.hex()[:16]
        self.file_bytes = HEADER.size + 8 * block_size + block_bytes
        self.max_files = max_bytes // self.file_bytes
        self.files: OrderedDict[int, None] = OrderedDict()  # hashes on disk, least recently used first
        self.writing: set[int] = set()
        self.writes_stopped = False
        self.stats = TierStats()
        self.num_in_flight = 0
        self.results_queue: queue.SimpleQueue[DiskResult] = queue.SimpleQueue()
        self.write_jobs: queue.SimpleQueue[DiskJob | None] = queue.SimpleQueue()
        self.read_jobs: queue.SimpleQueue[DiskJob | None] = queue.SimpleQueue()
        if self.max_files == 0:
            logger.warning("--kv-disk-size %d bytes holds no KV block of %d bytes; nothing will be written to %s",
                           max_bytes, self.file_bytes, self.path)
            self.writes_stopped = True
        self._scan()
        workers = [(self.write_jobs, "kv-disk-writer")]
        workers += [(self.read_jobs, f"kv-disk-reader-{i}") for i in range(READERS)]
        self.threads = [threading.Thread(target=self._work, args=(jobs,), name=name, daemon=True)
                        for jobs, name in workers]
        for thread in self.threads:
            thread.start()

    def _scan(self) -> None:
        """Index the files an earlier engine of the same identity left, oldest first (headers are
        checked when a file is read)."""
        found = []
        for entry in os.scandir(self.path):
            name = entry.name
            if name.startswith(self.prefix + "-") and name.endswith(".tmp"):  # a write cut short by a crash
                os.unlink(entry.path)
            elif name.startswith(self.prefix + "-") and name.endswith(".kv") and entry.is_file():
                try:
                    found.append((entry.stat().st_mtime, int(name[len(self.prefix) + 1:-3], 16)))
                except ValueError:
                    continue
        for _, h in sorted(found):
            self.files[h] = None
        self._delete_over_budget()
        if self.files:
            logger.info("KV disk tier %s: %d blocks from an earlier run", self.path, len(self.files))

    def file_path(self, h: int) -> Path:
        return self.path / f"{self.prefix}-{h:016x}.kv"

    def __contains__(self, h: int) -> bool:
        return h in self.files or h in self.writing

    def lookup(self, h: int) -> bool:
        """The block is on disk (made most recently used)."""
        if h not in self.files:
            return False
        self.files.move_to_end(h)
        return True

    def write(self, h: int, token_ids: tuple[int, ...], data: torch.Tensor, tag: object) -> bool:
        """Queue a write of a host block (kept pinned by the caller until its result); False if
        writing has stopped or the block is there already."""
        if self.writes_stopped or h in self:
            return False
        self.writing.add(h)
        self._submit(self.write_jobs, DiskJob("write", h, token_ids, data, tag))
        return True

    def read(self, h: int, token_ids: tuple[int, ...], into: torch.Tensor, tag: object) -> None:
        self._submit(self.read_jobs, DiskJob("read", h, token_ids, into, tag))

    def _submit(self, jobs: queue.SimpleQueue, job: DiskJob) -> None:
        self.num_in_flight += 1
        jobs.put(job)

    def results(self) -> list[DiskResult]:
        """Finished writes and reads, with the index brought up to date."""
        done = []
        while True:
            try:
                result = self.results_queue.get_nowait()
            except queue.Empty:
                return done
            self.num_in_flight -= 1
            job = result.job
            if job.kind == "delete":
                continue
            if job.kind == "write":
                self._finish_write(result)
            elif result.ok:
                self.stats.loaded_bytes += job.data.nbytes
                self.stats.load_latency.observe(result.seconds)
            elif result.corrupt:  # a file that cannot be right goes; one that failed to read (EIO, EMFILE) stays
                self.stats.rejected += 1
                logger.warning("KV disk tier: %s is not loaded (%s); it is deleted", self.file_path(job.h),
                               result.error)
                self.files.pop(job.h, None)
                self._submit(self.write_jobs, DiskJob("delete", job.h))
            else:
                logger.warning("KV disk tier: reading %s failed (%s); computed instead", self.file_path(job.h),
                               result.error)
            done.append(result)

    def _finish_write(self, result: DiskResult) -> None:
        job = result.job
        self.writing.discard(job.h)
        if not result.ok:
            if not self.writes_stopped:
                logger.warning("KV disk tier: writing %s failed (%s); offloading to disk stops, serving goes on",
                               self.path, result.error)
            self.writes_stopped = True
            return
        self.files[job.h] = None
        self.stats.offloaded_bytes += self.file_bytes
        self.stats.offload_latency.observe(result.seconds)
        self._delete_over_budget()

    def _delete_over_budget(self) -> None:
        while len(self.files) > self.max_files:
            h, _ = self.files.popitem(last=False)
            self.stats.evictions += 1
            self._submit(self.write_jobs, DiskJob("delete", h))

    def close(self) -> None:
        self.write_jobs.put(None)
        for _ in range(READERS):
            self.read_jobs.put(None)
        for thread in self.threads:
            thread.join(timeout=10)

    # -- on the background threads ---------------------------------------------------------

    def _work(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            start = time.perf_counter()
            try:
                {"write": self._write, "read": self._read, "delete": self._delete}[job.kind](job)
                result = DiskResult(job, True, time.perf_counter() - start)
            except Exception as e:  # noqa: BLE001  any failure is this job's: the thread serves on
                result = DiskResult(job, False, time.perf_counter() - start, f"{type(e).__name__}: {e}",
                                    corrupt=isinstance(e, (CorruptFile, FileNotFoundError)))
            self.results_queue.put(result)

    def _header(self, job: DiskJob, payload: memoryview) -> bytes:
        tokens = struct.pack(f"<{len(job.token_ids)}q", *job.token_ids)
        return HEADER.pack(MAGIC, VERSION, self.identity, job.h, len(job.token_ids),
                           len(payload), zlib.crc32(payload)) + tokens

    def _write(self, job: DiskJob) -> None:
        payload = memoryview(job.data.view(torch.uint8).numpy()).cast("B")
        final = self.file_path(job.h)
        tmp = final.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(self._header(job, payload))
                f.write(payload)
            os.replace(tmp, final)  # a reader never sees half a file under the final name
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()  # a full disk keeps no half-written file
            raise

    def _read(self, job: DiskJob) -> None:
        into = memoryview(job.data.view(torch.uint8).numpy()).cast("B")
        with open(self.file_path(job.h), "rb") as f:
            head = f.read(HEADER.size + 8 * len(job.token_ids))
            if len(head) != HEADER.size + 8 * len(job.token_ids):
                raise CorruptFile("truncated header")
            magic, version, identity, h, num_tokens, size, crc = HEADER.unpack_from(head)
            tokens = struct.unpack_from(f"<{len(job.token_ids)}q", head, HEADER.size)
            if (magic, version, identity) != (MAGIC, VERSION, self.identity):
                raise CorruptFile("not a KV block of this model, dtype and layout")
            if h != job.h or num_tokens != len(job.token_ids) or tokens != job.token_ids:
                raise CorruptFile("another block's file")
            if size != len(into) or f.readinto(into) != size or f.read(1):
                raise CorruptFile("wrong payload size")
            if zlib.crc32(into) != crc:
                raise CorruptFile("checksum mismatch")

    def _delete(self, job: DiskJob) -> None:
        self.file_path(job.h).unlink(missing_ok=True)
