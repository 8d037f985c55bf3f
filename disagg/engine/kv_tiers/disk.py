"""DiskTier: KV blocks as files in a local directory, under the host tier (docs/ARCHITECTURE.md,
"Engine (as built)").

One file per block, named by the model/dtype/layout identity and the block's chained hash, so a
directory can be shared by engines of different models and survives a restart (the directory is
scanned at start). A file is a header (magic, version, identity, hash, the block's token ids,
payload size, CRC-32 of the payload) and the block's bytes as the host tier holds them. A file
whose header or checksum is wrong, or that is not a regular file (a FIFO, a device, a symbolic
link), is a miss, never loaded, and is deleted.

The files hold prompts' token ids and their KV (from which much of a prompt can be recovered), so
the directory is this process's user's alone: created 0700 (one open to others is tightened, one
of another user refused) and its files 0600.

Writes and reads run on background threads, never on the engine's step: one writer (a block's
write and its later delete stay in order) and READERS readers (a prefix's blocks arrive in any
order; the engine waits for all of them). A read not done within READ_DEADLINE_S (a disk or network
filesystem that stopped answering) is a miss: the engine goes on, its reader is given up on and
replaced, and the block's memory is never written after that (a reader reads through a buffer of
its own). After MAX_STUCK_READERS such reads, the disk tier is read no more. The index (which
files exist, least recently used first) is kept on the engine thread alone, which learns of
finished jobs by polling `results()`. The total size is bounded: the least recently used files
are deleted. A failed write (disk full, directory gone) stops writing, with one warning; reads go
on.
"""

import contextlib
import errno
import logging
import os
import queue
import stat
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
READ_DEADLINE_S = 2.0  # a read of one block file that takes longer is a miss (a local disk takes milliseconds)
MAX_STUCK_READERS = 16  # readers given up on, each stuck in a read, before the disk tier is read no more
READ_CHUNK = 1 << 20  # bytes a reader reads into its own buffer before copying them into the block


@dataclass(eq=False)  # each job is itself (kept in a set while it is read)
class DiskJob:
    kind: str  # "write", "read" or "delete"
    h: int  # the block's chain hash, 64 bits unsigned
    token_ids: tuple[int, ...] = ()
    data: torch.Tensor | None = None  # a pinned host-tier block: the source of a write, the target of a read
    tag: object = None  # the caller's, handed back with the result
    started: float = 0.0  # reads: time.monotonic() when a reader began it
    reader: threading.Thread | None = None  # reads: the thread reading it
    abandoned: bool = False  # reads: past its deadline, given up on; the reader must not touch `data`


@dataclass
class DiskResult:
    job: DiskJob
    ok: bool
    seconds: float
    error: str = ""
    corrupt: bool = False  # the file is wrong or gone: it leaves the index (a failed read alone does not)
    timed_out: bool = False  # not read within READ_DEADLINE_S: it leaves the index, and is not deleted


class CorruptFile(Exception):
    """A file's header or checksum does not match what was asked for."""


class Abandoned(Exception):
    """The read passed its deadline and was given up on: its reader leaves the block alone."""


def private_directory(path: Path) -> None:
    """Create `path` as a directory only this user can enter (0700), or check an existing one: another
    user's is refused, one open to others tightened."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.geteuid():
        raise ValueError(f"--kv-disk-path {path} belongs to uid {info.st_uid}, not to this process's "
                         f"({os.geteuid()}): its owner could read the prompts it holds or swap their KV; "
                         "give a directory of your own")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
        logger.warning("KV disk tier: %s was open to other users (mode %o); it is now 0700, since its files "
                       "hold prompts' token ids and KV", path, stat.S_IMODE(info.st_mode))


class DiskTier:
    def __init__(self, path: str | Path, max_bytes: int, identity: bytes, block_bytes: int, block_size: int):
        self.path = Path(path)
        private_directory(self.path)
        self.identity = identity  # 32 bytes: a digest of model, dtype and KV layout
        self.prefix = identity.hex()[:16]
        self.file_bytes = HEADER.size + 8 * block_size + block_bytes
        self.max_files = max_bytes // self.file_bytes
        self.files: OrderedDict[int, None] = OrderedDict()  # hashes on disk, least recently used first
        # Filled only when KV events are published (kv_events.py): hashes that entered or left `files`.
        self.changed_hashes: set[int] | None = None
        self.writing: set[int] = set()
        self.writes_stopped = False
        self.stats = TierStats()
        self.num_in_flight = 0
        self.results_queue: queue.SimpleQueue[DiskResult] = queue.SimpleQueue()
        self.write_jobs: queue.SimpleQueue[DiskJob | None] = queue.SimpleQueue()
        self.read_jobs: queue.SimpleQueue[DiskJob | None] = queue.SimpleQueue()
        # Reads under way (guarded by reads_lock, which the engine thread takes to give up on one past its
        # deadline, and a reader to copy each chunk into a block, so that nothing is copied after that).
        self.reads_lock = threading.Lock()
        self.reading: set[DiskJob] = set()
        self.stuck_readers = 0
        self.reads_stopped = False
        self._local = threading.local()  # each reader's buffer
        if self.max_files == 0:
            logger.warning("--kv-disk-size %d bytes holds no KV block of %d bytes; nothing will be written to %s",
                           max_bytes, self.file_bytes, self.path)
            self.writes_stopped = True
        self._scan()
        self.threads: list[threading.Thread] = []  # the writer and the readers not given up on
        self._start_worker(self.write_jobs, "kv-disk-writer")
        for i in range(READERS):
            self._start_worker(self.read_jobs, f"kv-disk-reader-{i}")

    def _start_worker(self, jobs: queue.SimpleQueue, name: str) -> None:
        thread = threading.Thread(target=self._work, args=(jobs,), name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _scan(self) -> None:
        """Index the files an earlier engine of the same identity left, oldest first (headers are
        checked when a file is read)."""
        found = []
        for entry in os.scandir(self.path):
            name = entry.name
            if name.startswith(self.prefix + "-") and name.endswith(".tmp"):  # a write cut short by a crash
                os.unlink(entry.path)
            elif name.startswith(self.prefix + "-") and name.endswith(".kv") and entry.is_file(follow_symlinks=False):
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
        if h not in self.files or self.reads_stopped:
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
        """Finished writes and reads (and reads given up on), with the index brought up to date."""
        self._give_up_stuck_reads()
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
            elif result.timed_out:  # not deleted: the delete could hang on that disk too
                logger.warning("KV disk tier: %s was not read within %gs; computed instead, and forgotten",
                               self.file_path(job.h), READ_DEADLINE_S)
                self._forget(job.h)
            elif result.corrupt:  # a file that cannot be right goes; one that failed to read (EIO, EMFILE) stays
                self.stats.rejected += 1
                logger.warning("KV disk tier: %s is not loaded (%s); it is deleted", self.file_path(job.h),
                               result.error)
                self._forget(job.h)
                self._submit(self.write_jobs, DiskJob("delete", job.h))
            else:
                logger.warning("KV disk tier: reading %s failed (%s); computed instead", self.file_path(job.h),
                               result.error)
            done.append(result)

    def _give_up_stuck_reads(self) -> None:
        """Reads past their deadline become failed results now, and their readers are replaced (up to
        MAX_STUCK_READERS in all; then reads stop, and those queued fail at once)."""
        now = time.monotonic()
        with self.reads_lock:
            stuck = [job for job in self.reading if now - job.started > READ_DEADLINE_S]
            for job in stuck:
                job.abandoned = True
                self.reading.discard(job)
                self.results_queue.put(DiskResult(job, False, now - job.started, "timed out", timed_out=True))
        for job in stuck:
            self.threads.remove(job.reader)  # left to its fate: a daemon thread that exits if the read returns
            self.stuck_readers += 1
            if self.stuck_readers < MAX_STUCK_READERS:
                self._start_worker(self.read_jobs, f"kv-disk-reader-{READERS + self.stuck_readers}")
            elif not self.reads_stopped:
                self.reads_stopped = True
                logger.warning("KV disk tier: %d reads of %s did not finish within %gs each; the disk tier is "
                               "read no more (writes go on)", self.stuck_readers, self.path, READ_DEADLINE_S)
        while self.reads_stopped:  # no reader may be left to take these
            try:
                job = self.read_jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self.results_queue.put(DiskResult(job, False, 0.0, "disk reads stopped"))

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
        self._note(job.h)
        self.stats.offloaded_bytes += self.file_bytes
        self.stats.offload_latency.observe(result.seconds)
        self._delete_over_budget()

    def _delete_over_budget(self) -> None:
        while len(self.files) > self.max_files:
            h, _ = self.files.popitem(last=False)
            self._note(h)
            self.stats.evictions += 1
            self._submit(self.write_jobs, DiskJob("delete", h))

    def _forget(self, h: int) -> None:
        if h in self.files:
            del self.files[h]
            self._note(h)

    def _note(self, h: int) -> None:
        if self.changed_hashes is not None:
            self.changed_hashes.add(h)

    def close(self) -> None:
        self.write_jobs.put(None)
        for _ in self.threads[1:]:
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
            if job.kind == "read":
                with self.reads_lock:
                    if job.abandoned:  # its result went out at the deadline, and another reader took our place
                        return
                    self.reading.discard(job)
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
            with os.fdopen(self._create(tmp), "wb") as f:
                f.write(self._header(job, payload))
                f.write(payload)
            os.replace(tmp, final)  # a reader never sees half a file under the final name
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()  # a full disk keeps no half-written file
            raise

    @staticmethod
    def _create(path: Path) -> int:
        """A new file only this user can read; whatever is at `path` (a write cut short, a link) goes first."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(path, flags, 0o600)
        except FileExistsError:
            path.unlink()
            return os.open(path, flags, 0o600)

    def _read(self, job: DiskJob) -> None:
        with self.reads_lock:
            job.started, job.reader = time.monotonic(), threading.current_thread()
            self.reading.add(job)
        into = job.data.view(torch.uint8).reshape(-1)
        head_bytes = HEADER.size + 8 * len(job.token_ids)
        # Non-blocking: opening a FIFO for reading would wait for a writer. Never through a link.
        try:
            fd = os.open(self.file_path(job.h), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CorruptFile("a symbolic link, not a block file") from None
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CorruptFile("not a regular file")
            if info.st_size != head_bytes + into.numel():
                raise CorruptFile(f"{info.st_size} bytes, not {head_bytes + into.numel()}")
            head = bytearray(head_bytes)
            _read_exact_into(fd, memoryview(head))
            magic, version, identity, h, num_tokens, size, crc = HEADER.unpack_from(head)
            tokens = struct.unpack_from(f"<{len(job.token_ids)}q", head, HEADER.size)
            if (magic, version, identity) != (MAGIC, VERSION, self.identity):
                raise CorruptFile("not a KV block of this model, dtype and layout")
            if h != job.h or num_tokens != len(job.token_ids) or tokens != job.token_ids:
                raise CorruptFile("another block's file")
            if size != into.numel():
                raise CorruptFile("wrong payload size")
            if self._read_payload(fd, job, into) != crc:
                raise CorruptFile("checksum mismatch")
        finally:
            os.close(fd)

    def _read_payload(self, fd: int, job: DiskJob, into: torch.Tensor) -> int:
        """Read the payload into the block through this thread's own buffer, chunk by chunk, each copied
        under reads_lock unless the read was given up on; returns the payload's CRC-32."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = torch.empty(READ_CHUNK, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        crc, done = 0, 0
        while done < into.numel():
            n = min(READ_CHUNK, into.numel() - done)
            _read_exact_into(fd, view[:n])
            crc = zlib.crc32(view[:n], crc)
            with self.reads_lock:
                if job.abandoned:
                    raise Abandoned
                into[done:done + n].copy_(buffer[:n])
            done += n
        return crc

    def _delete(self, job: DiskJob) -> None:
        self.file_path(job.h).unlink(missing_ok=True)


def _read_exact_into(fd: int, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = os.readv(fd, [view[got:]])
        if not n:
            raise CorruptFile("truncated")
        got += n
