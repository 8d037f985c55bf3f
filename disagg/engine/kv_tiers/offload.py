"""KVOffload: the host and disk tiers under the device block pool, and the copies between them
(docs/ARCHITECTURE.md, "Engine (as built)").

Stores: a full block is copied device -> host when it is cached (`eager`) or when the device pool
evicts it (`lazy`); a host block is then written to disk in the background. Loads (as a KVArrival):
when the scheduler gives a waiting request its blocks (`start`), its prefix after the device hits
is looked up host -> disk, stopping at the first miss, and the hits are copied into its blocks
(disk -> host first, a promotion to the host tier), a few blocks first and then in larger copies,
each looked up while the ones before it run; the leading blocks that have arrived count as computed
and join the prefix cache at each poll, and when all have, the request is no longer `pending` and
runs. Every other request keeps running meanwhile. On CUDA the copies run on
their own stream and are polled through events, so neither stores nor loads wait inside a step; on
the CPU a copy is a plain synchronous copy.
"""

import hashlib
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from disagg.engine.block_manager import BlockKey, BlockManager
from disagg.engine.config import EngineConfig
from disagg.engine.kv_arrival import KVArrival
from disagg.engine.kv_cache import KVCache
from disagg.engine.kv_tiers.disk import DiskResult, DiskTier
from disagg.engine.kv_tiers.host import HostBlock, HostTier
from disagg.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

OFFLOADING_MODES = ("eager", "lazy")


def check_kv_tiers(config: EngineConfig) -> None:
    """Refuse KV tier settings that cannot work, naming the setting."""
    if config.kv_offloading_backend not in (None, "native"):
        raise ValueError(f"kv_offloading_backend must be 'native', got {config.kv_offloading_backend!r}")
    if config.kv_offloading_mode not in OFFLOADING_MODES:
        raise ValueError(f"kv_offloading_mode must be 'eager' or 'lazy', got {config.kv_offloading_mode!r}")
    if not config.kv_offloading_size >= 0:
        raise ValueError(f"kv_offloading_size is GiB of host memory, 0 for none; got {config.kv_offloading_size}")
    if config.kv_offloading_size and not config.enable_prefix_caching:
        raise ValueError("kv_offloading_size needs the prefix cache: KV tiers find blocks by its hashes")
    if config.kv_disk_path is not None and not config.kv_offloading_size:
        raise ValueError("kv_disk_path needs a host tier (kv_offloading_size > 0): disk blocks are written from it")
    if config.kv_disk_path is not None and not (config.kv_disk_size or 0) > 0:
        raise ValueError(f"kv_disk_path needs kv_disk_size, the GiB the directory may hold; got {config.kv_disk_size}")
    if config.kv_disk_path is None and config.kv_disk_size is not None:
        raise ValueError("kv_disk_size is set but kv_disk_path is not")


def kv_identity(model_dir, config_json: bytes, dtype: torch.dtype, block_shape: tuple[int, ...]) -> bytes:
    """What makes two engines' blocks interchangeable: model, dtype and KV layout."""
    text = f"{model_dir}|{dtype}|{block_shape}|".encode() + config_json
    return hashlib.sha256(text).digest()


# Blocks staged at once in one contiguous device buffer (a copy's memory in flight, at most).
STAGING_BYTES = 256 * 2**20
# A prefix load copies FIRST_LOAD_BLOCKS blocks first, so the copy engine starts at once; each later
# copy is as large as all the ones before it together, up to LOAD_COPY_BYTES, and is looked up while
# they run. When the last copy ends, its blocks alone are left to let go of and commit.
FIRST_LOAD_BLOCKS = 8
LOAD_COPY_BYTES = 64 * 2**20


class Copy:
    """Block copies between the device pool and the host tier issued together: on the copy stream
    between two events (CUDA), or done at once (CPU). One wait and one pair of events for the lot.

    A device block is a strided view (a slice of every layer), a host block is contiguous: copying
    one pair at a time costs a staging buffer and a kernel per block, which halves the bandwidth.
    So blocks go through one contiguous staging buffer per batch: one gather or scatter kernel on
    the device side, and one host copy per run of consecutive host slots."""

    def __init__(self, stream: torch.cuda.Stream | None, kv_cache: KVCache, host: HostTier,
                 device_blocks: list[int], host_slots: list[int], to_host: bool):
        self.end = None
        if stream is None:
            start = time.perf_counter()
            copy_blocks(kv_cache, host, device_blocks, host_slots, to_host)
            self.seconds = time.perf_counter() - start
            return
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_stream(torch.cuda.current_stream(stream.device))  # after every write the step queued
        with torch.cuda.stream(stream):
            self.start.record()
            copy_blocks(kv_cache, host, device_blocks, host_slots, to_host)
            self.end.record()

    def done(self) -> bool:
        if self.end is None:
            return True
        if not self.end.query():
            return False
        self.seconds = self.start.elapsed_time(self.end) / 1000
        return True


def copy_blocks(kv_cache: KVCache, host: HostTier, device_blocks: list[int], host_slots: list[int],
                to_host: bool) -> None:
    """Device blocks -> host slots (to_host) or back, pair by pair, through a staging buffer. On CUDA
    it runs on the current stream, so a staging buffer is reused only after its copies."""
    blocks = kv_cache.blocks_view()  # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    per_batch = max(1, STAGING_BYTES // host.block_bytes)
    non_blocking = blocks.device.type == "cuda"
    for first in range(0, len(device_blocks), per_batch):
        slots = host_slots[first:first + per_batch]
        # Pinned and sent without waiting: torch.tensor(..., device="cuda") would wait for every
        # copy queued on the stream before it, and the copy engine would idle until the next one.
        index = torch.tensor(device_blocks[first:first + per_batch], pin_memory=non_blocking)
        index = index.to(blocks.device, non_blocking=non_blocking)
        if to_host:
            staging = blocks.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous()
            for i, j, slot in slot_runs(slots):
                host.kv[slot:slot + j - i].copy_(staging[i:j], non_blocking=non_blocking)
        else:
            staging = torch.empty((len(slots), *host.kv.shape[1:]), dtype=host.kv.dtype, device=blocks.device)
            for i, j, slot in slot_runs(slots):
                staging[i:j].copy_(host.kv[slot:slot + j - i], non_blocking=non_blocking)
            blocks.index_copy_(2, index, staging.permute(1, 2, 0, 3, 4, 5))


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(i, j, first slot) for each stretch slots[i:j] of consecutive host slots."""
    runs, i = [], 0
    for j in range(1, len(slots) + 1):
        if j == len(slots) or slots[j] != slots[j - 1] + 1:
            runs.append((i, j, slots[i]))
            i = j
    return runs


@dataclass
class Store:
    """A device -> host block copy in flight."""
    h: int
    host: HostBlock
    device_block: int
    held: bool  # eager: held in the device pool until copied; lazy: stream order protects it


@dataclass
class StoreBatch:
    stores: list[Store]
    copy: Copy


@dataclass
class LoadItem:
    key: BlockKey
    host: HostBlock  # pinned until the block is on the device
    state: str  # "reading" (disk -> host), "copying" (host -> device), "done", "failed"
    device_block: int = -1  # the sequence's block it goes to, held by the load until it arrives


@dataclass
class LoadCopy:
    """Host -> device block copies started together: one event polled for all of them."""
    items: list[LoadItem]
    copy: Copy


@dataclass
class PrefixLoad:
    seq: Sequence
    first: int  # index of the sequence's first block loaded (the ones before were device hits)
    items: list[LoadItem]
    remote: bool = False  # a decode node's remote request's: its blocks are counted when reserved
    arrived: int = 0  # leading items on the device, let go of by the load (and committed, if not remote)


class KVOffload(KVArrival):
    def __init__(self, config: EngineConfig, kv_cache: KVCache, block_manager: BlockManager, identity: bytes):
        check_kv_tiers(config)
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.mode = config.kv_offloading_mode
        cuda = kv_cache.kv.device.type == "cuda"
        self.stream = torch.cuda.Stream(kv_cache.kv.device) if cuda else None
        block_shape = kv_cache.block(0).shape
        block_bytes = kv_cache.block(0).nbytes
        num_host = int(config.kv_offloading_size * 2**30) // block_bytes
        if num_host < 1:
            raise ValueError(f"kv_offloading_size {config.kv_offloading_size} GiB holds no KV block of "
                             f"{block_bytes} bytes; give it more")
        self.host = HostTier(num_host, block_shape, kv_cache.kv.dtype, pin_memory=cuda)
        self.disk = None
        if config.kv_disk_path is not None:
            self.disk = DiskTier(config.kv_disk_path, int(config.kv_disk_size * 2**30), identity, block_bytes,
                                 kv_cache.block_size)
        if self.mode == "eager":
            block_manager.newly_cached = []
        else:
            block_manager.evicted = []
        self.stores: list[StoreBatch] = []
        self.storing: set[int] = set()  # hashes on their way device -> host
        self.loads: list[PrefixLoad] = []
        self.load_copies: list[LoadCopy] = []
        self.loading: dict[int, PrefixLoad] = {}  # hash -> the load bringing it to the device
        self.max_pending_writes = max(1, num_host // 2)  # host blocks pinned by disk writes at most
        self.unwritten: deque[int] = deque()  # host blocks to write to disk once writes are fewer
        logger.info("KV tiers: host %d blocks (%.1f MiB%s), %s offload%s", num_host, num_host * block_bytes / 2**20,
                    ", pinned" if cuda else "", self.mode,
                    f", disk {self.disk.path} ({self.disk.max_files} blocks)" if self.disk else "")

    @property
    def busy(self) -> bool:
        """Copies or disk jobs are in flight."""
        return bool(self.stores or self.loads or self.unwritten or (self.disk and self.disk.num_in_flight))

    def blocks_in_flight(self) -> int:
        """Blocks being copied between the device pool and the host tier (or read from disk for it)."""
        return sum(len(batch.stores) for batch in self.stores) + sum(len(load.items) for load in self.loads)

    # -- stores: device -> host -> disk ---------------------------------------------------

    def store_new(self) -> None:
        """Start copying the blocks the device pool listed since the last call. Called after each
        step's postprocess (eager) and before anything writes device blocks (lazy: an evicted
        block's KV is still in place until then)."""
        bm = self.block_manager
        stores = []
        if bm.newly_cached:
            for block_id in bm.newly_cached:
                block = bm.blocks[block_id]
                if block.hash is not None:  # still cached: its KV is what the key says
                    stores += self._new_store(block_id, (block.hash, block.token_ids), held=True)
            bm.newly_cached.clear()
        if bm.evicted:
            for block_id, key in bm.evicted:
                stores += self._new_store(block_id, key, held=False)
            bm.evicted.clear()
        if not stores:
            return
        try:
            copy = Copy(self.stream, self.kv_cache, self.host, [s.device_block for s in stores],
                        [s.host.slot for s in stores], to_host=True)
        except Exception as e:  # noqa: BLE001  e.g. no device memory for the staging buffer: these blocks are not kept
            logger.warning("KV tiers: copying %d blocks to the host tier failed (%s); they are not offloaded",
                           len(stores), e)
            for store in stores:
                self.host.drop(store.h)
                if store.held:
                    self.block_manager.release(store.device_block)
            return
        self.storing.update(s.h for s in stores)
        batch = StoreBatch(stores, copy)
        if self.stream is None:  # the CPU copied them already: nothing to keep pinned
            self._finish_stores(batch)
            return
        if not all(s.held for s in stores):  # lazy: the next step reuses the blocks, after the copy
            torch.cuda.current_stream(self.stream.device).wait_event(batch.copy.end)
        self.stores.append(batch)

    def _new_store(self, block_id: int, key: BlockKey, held: bool) -> list[Store]:
        h, tokens = key
        if h in self.host:  # never copied twice
            return []
        host = self.host.allocate(h, tokens)
        if host is None:  # every host block is pinned: this one is not kept
            return []
        if held:
            self.block_manager.hold(block_id)
        return [Store(h, host, block_id, held)]

    def _finish_stores(self, batch: StoreBatch) -> None:
        self.host.stats.offload_latency.observe(batch.copy.seconds)
        for store in batch.stores:
            self.storing.discard(store.h)
            store.host.ready = True
            self.host.stats.offloaded_bytes += self.host.block_bytes
            if store.held:
                self.block_manager.release(store.device_block)
            self.host.unpin(store.host)
            if self.disk is not None:
                self.unwritten.append(store.h)
                if len(self.unwritten) > self.host.num_blocks:  # older ones the host tier has dropped by now
                    self.unwritten.popleft()

    def _write_to_disk(self) -> None:
        """Queue disk writes of new host blocks while few are pending (each pins its host block);
        a block the host tier evicts before its turn is not written (docs/ARCHITECTURE.md says why)."""
        while self.unwritten and self.disk.num_in_flight < self.max_pending_writes:
            h = self.unwritten.popleft()
            host = self.host.blocks.get(h)
            if host is not None and host.ready and self.disk.write(h, host.token_ids, self.host.kv[host.slot], host):
                self.host.pin(host)

    # -- loads: disk -> host -> device ----------------------------------------------------

    def blocked(self, seq: Sequence) -> bool:
        """Its prefix goes on in blocks another request is loading: it waits for them (it would
        compute them again), and hits them in the device cache once they arrive."""
        hits = len(self.block_manager.prefix_hits(seq))
        misses = self.block_manager.block_keys(seq, hits + 1)[hits:]
        return bool(misses) and misses[0][0] in self.loading

    def start(self, seq: Sequence) -> None:
        """The sequence just got its blocks: copy the leading ones the device pool missed but the
        tiers hold into them. A remote sequence's count as cached at once, so the prefill node
        does not send that KV, and come from the host tier only: a disk read that failed after the
        prefill node was told to skip those tokens would leave a hole. A local sequence's count as
        computed as they arrive."""
        self.store_new()  # lazy: blocks its allocation evicted are copied out before anything overwrites them
        bs = self.block_manager.block_size
        first = seq.num_cached_tokens // bs
        keys = self.block_manager.block_keys(seq, first + FIRST_LOAD_BLOCKS)[first:]
        items = self._find_below(keys, FIRST_LOAD_BLOCKS, disk=not seq.remote)
        if items:
            loading = self._start_load(seq, first, items, remote=seq.remote)
            if seq.remote:
                seq.num_cached_tokens += loading * bs

    def pending(self, seq: Sequence) -> bool:
        return any(load.seq is seq for load in self.loads)

    def _find_below(self, keys: list[BlockKey], limit: int, disk: bool = True) -> list[LoadItem]:
        """Up to `limit` leading keys found in the host tier (pinned) or, with `disk`, on disk (each
        given a host block for the disk to fill), up to the first miss."""
        items = []
        for h, tokens in keys[:limit]:
            if h in self.loading:
                break
            self.host.stats.lookups += 1
            # A block still on its way from the device will do: its load is queued after that copy
            # on the same stream (on the CPU the copy is done already).
            host = self.host.lookup(h, tokens, filling_ok=h in self.storing)
            if host is not None:
                self.host.stats.hits += 1
                self.host.pin(host)
                items.append(LoadItem((h, tokens), host, "copying"))
                continue
            if self.disk is None or not disk:
                break
            self.disk.stats.lookups += 1
            if h in self.host or not self.disk.lookup(h) or (host := self.host.allocate(h, tokens)) is None:
                break
            self.disk.stats.hits += 1
            items.append(LoadItem((h, tokens), host, "reading"))
        return items

    def _start_load(self, seq: Sequence, first: int, items: list[LoadItem], remote: bool = False) -> int:
        """Load `items` (found for the sequence's blocks from block `first` on) and then the next
        hits below the device into its blocks, a copy at a time: each copy starts before the next
        blocks are hashed and looked up, so on CUDA the copy engine works while the host walks the
        rest of the prefix. Returns how many blocks are loading (none after a copy that could not
        start)."""
        self.store_new()  # lazy: blocks its allocation evicted are copied out before the loads overwrite them
        load = PrefixLoad(seq, first, [], remote)
        self.loads.append(load)  # first: whatever fails below, poll() ends the load and lets go of its blocks
        per_copy = max(1, LOAD_COPY_BYTES // self.host.block_bytes)
        limit = FIRST_LOAD_BLOCKS
        while True:
            if not self._add_to_load(load, items):
                return len(load.items) - len(items)
            if len(items) < limit:  # the prefix ended at a miss, or at its last block
                return len(load.items)
            limit = min(per_copy, len(load.items))
            start = first + len(load.items)
            items = self._find_below(self.block_manager.block_keys(seq, start + limit)[start:], limit, disk=not remote)
            if not items:
                return len(load.items)

    def _add_to_load(self, load: PrefixLoad, items: list[LoadItem]) -> bool:
        """Hold the device blocks the items go to (so an abort meanwhile does not free them under a
        copy), start their disk reads and host copies; False if the host copies could not start."""
        start = load.first + len(load.items)
        for item, block_id in zip(items, load.seq.block_table[start:start + len(items)]):
            item.device_block = block_id
            self.block_manager.hold(block_id)
            self.loading[item.key[0]] = load
            if item.state == "reading":
                self.disk.read(item.key[0], item.key[1], self.host.kv[item.host.slot], item)
        load.items += items
        return self._copy_in([item for item in items if item.state == "copying"])

    def _copy_in(self, items: list[LoadItem]) -> bool:
        """Start the host -> device copies of these items; False (the items failed) if that failed."""
        if not items:
            return True
        try:
            copy = Copy(self.stream, self.kv_cache, self.host, [i.device_block for i in items],
                        [i.host.slot for i in items], to_host=False)
        except Exception as e:  # noqa: BLE001  e.g. no device memory for the staging buffer: computed instead
            logger.warning("KV tiers: loading %d blocks from the host tier failed (%s); they are computed",
                           len(items), e)
            for item in items:
                item.state = "failed"
                self.host.unpin(item.host)
            return False
        self.load_copies.append(LoadCopy(items, copy))
        return True

    def _advance(self, load: PrefixLoad) -> None:
        """Let go of the leading blocks that arrived since the last poll: they count as computed and
        join the prefix cache now, so when the last copy ends only its own blocks are left to do.
        The load ends once every block arrived or failed."""
        items, arrived = load.items, load.arrived
        while arrived < len(items) and items[arrived].state == "done":
            self.block_manager.release(items[arrived].device_block)
            self.host.unpin(items[arrived].host)
            arrived += 1
        if arrived > load.arrived:
            load.arrived = arrived
            if self._waiting_for(load):
                seq = load.seq
                seq.num_computed_tokens = seq.num_cached_tokens = (load.first + arrived) * self.block_manager.block_size
                self.block_manager.commit(seq)
        if arrived < len(items) and items[arrived].state != "failed":
            return  # the next block is still on its way
        if all(item.state in ("done", "failed") for item in items[arrived:]):
            self.loads.remove(load)
            self._finish_load(load)

    def _waiting_for(self, load: PrefixLoad) -> bool:
        """The load's sequence waits for it: not remote (counted when reserved), not aborted."""
        return not load.remote and load.seq.status == SequenceStatus.WAITING_FOR_KV

    def _finish_load(self, load: PrefixLoad) -> None:
        """Every block arrived or failed: the ones after the leading arrived ones are let go of (the
        sequence computes them); it is no longer pending, so it runs."""
        for item in load.items[load.arrived:]:
            self.block_manager.release(item.device_block)
            if item.state == "done":
                self.host.unpin(item.host)
        for item in load.items:
            del self.loading[item.key[0]]

    # -- polling ------------------------------------------------------------------------

    def poll(self) -> None:
        """Take in finished copies and disk jobs (on the engine thread, once a step)."""
        still = []
        for batch in self.stores:
            if batch.copy.done():
                self._finish_stores(batch)
            else:
                still.append(batch)
        self.stores = still
        if self.disk is not None:
            self._copy_in([item for result in self.disk.results() if (item := self._disk_done(result))])
            self._write_to_disk()
        still = []
        for load_copy in self.load_copies:
            if load_copy.copy.done():
                for item in load_copy.items:
                    item.state = "done"
                self.host.stats.loaded_bytes += len(load_copy.items) * self.host.block_bytes
                self.host.stats.load_latency.observe(load_copy.copy.seconds)
            else:
                still.append(load_copy)
        self.load_copies = still
        for load in list(self.loads):
            self._advance(load)

    def _disk_done(self, result: DiskResult) -> LoadItem | None:
        """A finished disk job; a block read that is now to be copied to the device."""
        job = result.job
        if job.kind == "write":
            self.host.unpin(job.tag)
            return None
        item: LoadItem = job.tag
        if not result.ok:
            item.state = "failed"
            self.host.drop(item.key[0])
            return None
        item.host.ready = True  # promoted to the host tier
        return item

    def drain(self) -> None:
        """Wait until every copy and disk job has finished (tests, shutdown)."""
        while self.busy:
            self.poll()
            time.sleep(0.001)

    def close(self) -> None:
        self.drain()
        if self.disk is not None:
            self.disk.close()

    def summary(self) -> str:
        host, disk, device = self.host.stats, self.disk.stats if self.disk else None, self.block_manager.stats
        bm = self.block_manager
        line = (f"KV tiers: device {bm.num_blocks - bm.num_free_blocks}/{bm.num_blocks} blocks used, "
                f"hits {device.hits}/{device.lookups}; host {self.host.num_used}/{self.host.num_blocks}, "
                f"hits {host.hits}/{host.lookups}, offloaded {host.offloaded_bytes / 2**30:.2f} GiB, "
                f"loaded {host.loaded_bytes / 2**30:.2f} GiB")
        if disk is not None:
            line += (f"; disk {len(self.disk.files)}/{self.disk.max_files}, hits {disk.hits}/{disk.lookups}, "
                     f"written {disk.offloaded_bytes / 2**30:.2f} GiB, read {disk.loaded_bytes / 2**30:.2f} GiB"
                     f"{', writes stopped' if self.disk.writes_stopped else ''}")
        return line + f"; in flight {self.blocks_in_flight()} blocks, {len(self.loads)} loads"
