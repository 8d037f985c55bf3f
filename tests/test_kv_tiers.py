"""KV tiers under the device pool: the host and disk tiers on their own (no model), then the
engine with the embedded model, whose outputs must equal transformers' float32 greedy ones
whichever tier a prefix comes back from."""

import asyncio
import contextlib
import json
import logging
import os
import shutil
import stat
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from kv_export import KVCollector
from prompts import PASSAGE, hf_greedy
from servers import KV_CACHE_BYTES, start_node, wait_for

from disagg import LLM, SamplingParams
from disagg.engine import async_engine
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.block_hash import prompt_block_hashes
from disagg.engine.block_manager import BlockManager
from disagg.engine.config import EngineConfig
from disagg.engine.engine import LLMEngine
from disagg.engine.kv_tiers import disk as disk_module
from disagg.engine.kv_tiers.disk import HEADER, DiskTier
from disagg.engine.kv_tiers.host import HostTier
from disagg.engine.kv_tiers.offload import slot_runs
from disagg.engine.kv_view import MEDIUM_WEIGHTS
from disagg.engine.loader import DEFAULT_MODEL_NAME
from disagg.engine.sequence import Sequence, SequenceStatus
from disagg.router.kv_view import CacheView

BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4  # one 16-token block of the embedded model, float32
MAX_TOKENS = 8
# 195 tokens each: 12 full blocks, distinct from the first block on.
CONVERSATIONS = [f"Conversation {i}. " + PASSAGE * 3 + "Summarize." for i in range(6)]
PREFIX_TOKENS = 12 * 16


def gib(num_blocks: int) -> float:
    return num_blocks * BLOCK_BYTES / 2**30


# -- the tiers alone --------------------------------------------------------------------------


def test_host_tier_evicts_the_least_recently_used_unpinned_block():
    tier = HostTier(2, (3,), torch.float32, pin_memory=False)
    a, b = tier.allocate(1, (1,)), tier.allocate(2, (2,))
    for block in (a, b):
        block.ready = True
        tier.unpin(block)
    assert tier.lookup(1, (1,)) is a  # a is now the most recently used
    assert tier.lookup(2, (9,)) is None  # the same hash over other tokens is a miss
    c = tier.allocate(3, (3,))
    assert 2 not in tier and 1 in tier and c.slot == b.slot and tier.stats.evictions == 1
    tier.pin(a)  # a and c pinned: nothing can be evicted
    assert tier.allocate(4, (4,)) is None
    assert tier.lookup(3, (3,)) is None  # not ready: a copy is still filling it
    tier.drop(3)  # its fill failed
    assert 3 not in tier and tier.allocate(4, (4,)) is not None


def finish(disk: DiskTier) -> list:
    results = []
    while disk.num_in_flight:
        results += disk.results()
    return results


def test_host_slots_are_copied_in_runs_of_consecutive_slots():
    assert slot_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 5, 9), (5, 6, 2)]
    assert slot_runs([7]) == [(0, 1, 7)] and slot_runs([]) == []


def test_disk_tier_round_trip_restart_and_size_bound(tmp_path):
    identity = bytes(32)
    block = torch.arange(12, dtype=torch.float32)
    disk = DiskTier(tmp_path, 2 * (DiskTier(tmp_path / "probe", 1, identity, 48, 4).file_bytes), identity, 48, 4)
    for h in (2**64 - 5, 6, 7):  # hashes are 64-bit unsigned
        assert disk.write(h, (h % 1000, 0, 0, 0), block + h % 1000, None)
    assert all(r.ok for r in finish(disk))
    assert not disk.lookup(2**64 - 5) and disk.lookup(6) and disk.lookup(7)  # two files fit: the oldest went
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == sorted(disk.file_path(h).name for h in (6, 7))
    disk.close()
    stale = disk.file_path(8).with_suffix(".tmp")
    stale.write_bytes(b"half a block")  # a write cut short by a crash
    again = DiskTier(tmp_path, 10**6, identity, 48, 4)  # a restart finds them, and deletes the stale one
    assert not stale.exists()
    into = torch.empty(12)
    again.read(7, (7, 0, 0, 0), into, None)
    [result] = finish(again)
    assert result.ok and torch.equal(into, block + 7) and again.stats.loaded_bytes == 48
    again.close()
    tiny = DiskTier(tmp_path / "tiny", 10, identity, 48, 4)  # holds no block: writes nothing, serves on
    assert tiny.writes_stopped and not tiny.write(1, (1, 0, 0, 0), block, None)
    tiny.close()


def test_disk_tier_rejects_corrupt_truncated_and_foreign_files(tmp_path):
    ours, theirs = bytes(32), bytes([1]) * 32
    block = torch.ones(12)
    foreign = DiskTier(tmp_path, 10**6, theirs, 48, 4)
    foreign.write(9, (9, 0, 0, 0), block, None)
    finish(foreign)
    disk = DiskTier(tmp_path, 10**6, ours, 48, 4)
    assert not disk.lookup(9)  # another model's file is not indexed
    for h in (1, 2, 3):
        disk.write(h, (h, 0, 0, 0), block, None)
    finish(disk)
    path = disk.file_path(1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one flipped payload byte
    path.write_bytes(data)
    disk.file_path(2).write_bytes(disk.file_path(2).read_bytes()[:-4])  # truncated
    shutil.copy(foreign.file_path(9), disk.file_path(3))  # a foreign file under our name
    for h in (1, 2, 3):
        into = torch.zeros(12)
        disk.read(h, (h, 0, 0, 0), into, None)
        [result] = finish(disk)
        assert not result.ok and result.corrupt
        assert not disk.lookup(h) and not disk.file_path(h).exists()  # forgotten and deleted
    assert disk.stats.rejected == 3
    disk.close()
    foreign.close()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_disk_tier_files_are_this_users_alone(tmp_path, monkeypatch, caplog):
    """Issue 24, finding 11: block files were 0644 in a 0755 directory, and they hold prompts' token ids."""
    identity = bytes(32)
    disk = DiskTier(tmp_path / "new" / "kv", 10**6, identity, 48, 4)
    disk.write(1, (1, 2, 3, 4), torch.ones(12), None)
    finish(disk)
    disk.close()
    assert mode(tmp_path / "new" / "kv") == 0o700 and mode(disk.file_path(1)) == 0o600
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    with caplog.at_level(logging.WARNING, logger="disagg.engine.kv_tiers.disk"):
        DiskTier(shared, 10**6, identity, 48, 4).close()
    assert mode(shared) == 0o700 and "was open to other users (mode 755); it is now 0700" in caplog.text
    monkeypatch.setattr(disk_module.os, "geteuid", lambda: os.getuid() + 1)  # as if another user owned it
    with pytest.raises(ValueError, match="belongs to uid .* give a directory of your own"):
        DiskTier(shared, 10**6, identity, 48, 4)


@pytest.mark.timeout(30)
def test_disk_tier_reads_regular_files_only(tmp_path):
    """Issue 24, finding 10: block files replaced by FIFOs held all four readers forever (an open of a
    FIFO waits for a writer). Now a FIFO, a link or a directory in a block's place is a miss at once,
    deleted, and the readers read the other blocks."""
    identity, block = bytes(32), torch.arange(12, dtype=torch.float32)
    disk = DiskTier(tmp_path, 10**6, identity, 48, 4)
    for h in range(1, 11):
        disk.write(h, (h, 0, 0, 0), block + h, None)
    finish(disk)
    for h in range(1, 7):  # more FIFOs than readers
        disk.file_path(h).unlink()
        os.mkfifo(disk.file_path(h))
    disk.file_path(7).unlink()
    disk.file_path(7).symlink_to(disk.file_path(10))  # another block's (good) file
    disk.file_path(8).unlink()
    disk.file_path(8).mkdir()
    start = time.monotonic()
    into = {h: torch.zeros(12) for h in range(1, 11)}
    for h, tensor in into.items():
        disk.read(h, (h, 0, 0, 0), tensor, None)
    results = {r.job.h: r for r in finish(disk)}
    assert time.monotonic() - start < disk_module.READ_DEADLINE_S
    assert all(not results[h].ok and results[h].corrupt for h in range(1, 9)), results
    assert all(results[h].ok and torch.equal(into[h], block + h) for h in (9, 10))
    finish(disk)  # the deletes
    assert not any(disk.file_path(h).is_fifo() or disk.file_path(h).is_symlink() for h in range(1, 8))
    assert disk.file_path(10).exists() and disk.stats.rejected == 8
    disk.close()


@pytest.mark.timeout(60)
def test_a_stuck_disk_read_is_a_miss_at_its_deadline_and_never_lands_after(tmp_path, monkeypatch, caplog):
    """A read that hangs (a disk or network filesystem that stopped answering) is a miss once
    READ_DEADLINE_S have passed: the engine learns it then, its reader is replaced, and when the read
    comes back at last nothing of it is copied into the block, which the engine may have reused."""
    monkeypatch.setattr(disk_module, "READ_DEADLINE_S", 0.5)
    identity, block = bytes(32), torch.arange(12, dtype=torch.float32)
    disk = DiskTier(tmp_path, 10**6, identity, 48, 4)
    for h in (1, 2, 3):
        disk.write(h, (h, 0, 0, 0), block + h, None)
    finish(disk)
    stalled, release = stall_reads_of(disk.file_path(1), monkeypatch)
    try:
        stuck, fine = torch.full((12,), -1.0), torch.zeros(12)
        start = time.monotonic()
        disk.read(1, (1, 0, 0, 0), stuck, None)
        assert stalled.wait(10)
        disk.read(2, (2, 0, 0, 0), fine, None)  # the other readers serve on meanwhile
        with caplog.at_level(logging.WARNING, logger="disagg.engine.kv_tiers.disk"):
            results = {r.job.h: r for r in finish(disk)}
        assert results[2].ok and torch.equal(fine, block + 2)
        assert results[1].timed_out and 0.5 <= time.monotonic() - start < 2.0
        assert "was not read within 0.5s; computed instead, and forgotten" in caplog.text
        assert not disk.lookup(1) and disk.file_path(1).exists()  # forgotten, not deleted (that could hang too)
        assert len(disk.threads) == 1 + disk_module.READERS  # the stuck reader was replaced
        release.set()  # the read comes back: the block stays as the engine left it
        results[1].job.reader.join(10)
        assert not results[1].job.reader.is_alive() and torch.equal(stuck, torch.full((12,), -1.0))
        # After MAX_STUCK_READERS such reads, the tier is read no more (a lookup misses).
        monkeypatch.setattr(disk_module, "MAX_STUCK_READERS", 2)
        stalled, release = stall_reads_of(disk.file_path(3), monkeypatch)
        disk.read(3, (3, 0, 0, 0), torch.zeros(12), None)
        with caplog.at_level(logging.WARNING, logger="disagg.engine.kv_tiers.disk"):
            [result] = finish(disk)
        assert result.timed_out and disk.reads_stopped and not disk.lookup(2)
        assert "the disk tier is read no more" in caplog.text
    finally:
        release.set()
        disk.close()


def test_block_manager_lists_blocks_for_the_tiers_and_lends_them():
    manager = BlockManager(4, 4)
    manager.newly_cached, manager.evicted = [], []
    a = Sequence("a", list(range(9)), SamplingParams(temperature=0.0))
    manager.allocate(a)
    a.num_computed_tokens = 9
    manager.commit(a)
    table = list(a.block_table)
    assert manager.newly_cached == table[:2]
    manager.hold(table[0])  # a copy out of it is in flight: freeing the sequence does not free it
    manager.free(a)
    assert manager.num_free_blocks == 3 and manager.blocks[table[0]].ref_count == 1
    manager.release(table[0])
    for _ in range(4):
        manager.take_free()  # the uncached blocks first, then the cached ones, the tail first
    assert [(block_id, key[1]) for block_id, key in manager.evicted] == [(table[1], (4, 5, 6, 7)),
                                                                        (table[0], (0, 1, 2, 3))]


# -- the engine ---------------------------------------------------------------------------------


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def generate_exact(llm: LLM, hf_model, prompts: list[str]) -> list:
    outs = llm.generate(prompts, greedy())
    for out in outs:
        assert out.token_ids == hf_greedy(hf_model, out.prompt_token_ids, MAX_TOKENS)
    return outs


def evict_device_cache(llm: LLM) -> None:
    """Take every free block and give it back: the device pool's prefix cache is emptied."""
    bm = llm.engine.block_manager
    for block_id in [bm.take_free() for _ in range(bm.num_free_blocks)]:
        bm.release(block_id)


def assert_nothing_held(llm: LLM) -> None:
    offload = llm.engine.offload
    offload.drain()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert offload.host.num_pinned == 0 and offload.blocks_in_flight() == 0
    assert offload.disk is None or offload.disk.num_in_flight == 0


def test_prefixes_from_the_host_tier_match_transformers(model_dir, hf_model):
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory=48 * BLOCK_BYTES, kv_offloading_size=gib(160))
    prompts = CONVERSATIONS[:4]
    first = generate_exact(llm, hf_model, prompts)
    assert all(o.num_cached_tokens == 0 for o in first)
    evict_device_cache(llm)
    # The first prompt twice in a row: the second copy waits for the first one's load, then hits
    # the device (it neither loads the blocks again nor computes them).
    second = generate_exact(llm, hf_model, prompts[:1] + prompts)
    assert [o.num_cached_tokens for o in second] == [PREFIX_TOKENS] * 5
    host = llm.engine.offload.host.stats
    assert host.hits == 4 * 12 and host.loaded_bytes == 4 * 12 * BLOCK_BYTES  # no block loaded twice
    assert host.lookups == 4 + 4 * 12  # each request looked up once a wait: a miss at first, then 12 hits
    assert_nothing_held(llm)


def test_a_decode_engine_takes_its_host_tier_hits_and_needs_only_the_rest(model_dir, hf_model):
    """A remote request whose prefix the decode engine's device pool lost but its host tier holds:
    those blocks are loaded into its reservation and count as cached, so the prefill engine sends
    only the rest of the KV (skip_tokens), and the answer is transformers' still."""
    prefill = LLM(str(model_dir), device="cpu", kv_cache_memory=KV_CACHE_BYTES)
    decode = LLM(str(model_dir), device="cpu", kv_cache_memory=48 * BLOCK_BYTES, kv_offloading_size=gib(64))
    prompt = CONVERSATIONS[0]
    generate_exact(decode, hf_model, [prompt])  # its blocks go to the host tier
    evict_device_cache(decode)
    engine = decode.engine
    engine.add_request("r", prompt, greedy(), remote_prefill=True)
    slot = engine.remote_slot("r")
    skip = slot.cached_tokens
    assert skip == PREFIX_TOKENS and engine.offload.host.stats.hits == 12
    export = KVCollector(30, start=skip)  # what the prefill node sends: 195 - 192 = 3 tokens' KV
    prefill.engine.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=1), kv_export=export.export)
    out = None
    while out is None:
        out = next((o for o in prefill.engine.step() if o.finished), None)
    kv = export.kv()
    assert kv.shape[2] == len(out.prompt_token_ids) - PREFIX_TOKENS
    slot.first.output(out.token_ids[0], None)
    engine.finish_remote_prefill("r", kv, slot.first, kv_start=skip)
    done = None
    while done is None:
        done = next((o for o in engine.step() if o.finished), None)
    assert done.token_ids == hf_greedy(hf_model, done.prompt_token_ids, MAX_TOKENS)
    assert_nothing_held(decode)


def test_lazy_offload_cycles_blocks_through_every_tier(model_dir, hf_model, tmp_path):
    # 40 device blocks and 36 host blocks for 6 x 13 blocks: blocks go device -> host -> disk
    # while the batch runs, and come back from all three.
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory=40 * BLOCK_BYTES, kv_offloading_size=gib(36),
              kv_offloading_mode="lazy", kv_disk_path=str(tmp_path), kv_disk_size=gib(200))
    generate_exact(llm, hf_model, CONVERSATIONS)
    offload = llm.engine.offload
    offload.drain()
    assert offload.host.stats.offloaded_bytes > 0 and offload.disk.stats.offloaded_bytes > 0
    outs = generate_exact(llm, hf_model, CONVERSATIONS)
    # The first three come back whole (from host and disk); the tiers are too small to keep all six.
    assert [o.num_cached_tokens for o in outs[:3]] == [PREFIX_TOKENS] * 3
    assert offload.host.stats.hits > 0 and offload.disk.stats.hits > 0 and offload.host.stats.evictions > 0
    assert_nothing_held(llm)


def test_restart_serves_disk_prefixes_and_corrupt_files_are_recomputed(model_dir, hf_model, tmp_path):
    def start() -> LLM:
        return LLM(str(model_dir), device="cpu", kv_cache_memory=48 * BLOCK_BYTES, kv_offloading_size=gib(64),
                   kv_disk_path=str(tmp_path), kv_disk_size=gib(100))

    first = start()
    x, y, z = CONVERSATIONS[:3]
    generate_exact(first, hf_model, [x, y, z])
    first.engine.close()
    # Block 5 of y gets a flipped byte: y's blocks 0-4 come from disk, the rest is computed.
    keys = first.engine.block_manager.block_keys(Sequence("y", first.tokenizer.encode(y), greedy()))
    path = first.engine.offload.disk.file_path(keys[5][0])
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(data)

    llm = start()
    engine = llm.engine
    # z's blocks are read from disk while another request runs; then z is aborted mid-load: every
    # block in every tier comes back.
    engine.add_request("z", z, greedy())
    engine.add_request("w", "Hello", greedy())
    engine.step()
    z_seq = engine.requests["z"].seq
    assert engine.offload.loads and z_seq.status == SequenceStatus.WAITING_FOR_KV and engine.offload.pending(z_seq)
    assert [seq.request_id for seq in engine.scheduler.running] == ["w"]
    assert engine.abort_request("z")
    while "w" in engine.requests:
        engine.step()
    assert_nothing_held(llm)

    outs = generate_exact(llm, hf_model, [x, y])
    assert [o.num_cached_tokens for o in outs] == [PREFIX_TOKENS, 5 * 16]
    assert engine.offload.disk.stats.rejected == 1
    engine.offload.drain()
    assert path.read_bytes() != data  # deleted, then written again from y's recomputed block
    assert engine.offload.host.stats.hits == 0  # the host tier started empty: x came from disk
    assert_nothing_held(llm)


def test_disk_write_error_stops_disk_offload_with_one_warning(model_dir, hf_model, tmp_path, caplog):
    disk_dir = tmp_path / "kv"
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory=48 * BLOCK_BYTES, kv_offloading_size=gib(64),
              kv_disk_path=str(disk_dir), kv_disk_size=gib(100))
    shutil.rmtree(disk_dir)
    disk_dir.write_text("not a directory")  # every write fails from now on
    with caplog.at_level(logging.WARNING, logger="disagg.engine.kv_tiers.disk"):
        generate_exact(llm, hf_model, CONVERSATIONS[:2])
        llm.engine.offload.drain()
        evict_device_cache(llm)
        outs = generate_exact(llm, hf_model, CONVERSATIONS[:2])  # the host tier serves on
    assert [o.num_cached_tokens for o in outs] == [PREFIX_TOKENS] * 2
    assert llm.engine.offload.disk.writes_stopped
    assert sum("offloading to disk stops" in r.getMessage() for r in caplog.records) == 1
    assert_nothing_held(llm)


@pytest.mark.parametrize("kwargs,error", [
    ({"kv_offloading_size": 1, "kv_offloading_backend": "lmcache"}, "must be 'native'"),
    ({"kv_offloading_size": 1, "kv_offloading_mode": "sometimes"}, "'eager' or 'lazy'"),
    ({"kv_offloading_size": -1}, "0 for none"),
    ({"kv_disk_path": "/tmp/kv"}, "needs a host tier"),
    ({"kv_offloading_size": 1, "kv_disk_path": "/tmp/kv"}, "needs kv_disk_size"),
    ({"kv_offloading_size": 1, "enable_prefix_caching": False}, "needs the prefix cache"),
])
def test_bad_tier_settings_are_refused(kwargs, error):
    with pytest.raises(ValueError, match=error):
        LLM(device="cpu", **kwargs)


@pytest.mark.slow
def test_a_node_serves_with_tiers_and_exports_their_metrics(tmp_path):
    node = start_node("both", tmp_path, extra_args=["--kv-offloading-size", "0.05", "--kv-offloading-mode", "eager",
                                                    "--kv-disk-path", str(tmp_path / "kv"), "--kv-disk-size", "0.1"])
    try:
        body = {"model": DEFAULT_MODEL_NAME, "prompt": CONVERSATIONS[0], "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{node.url}/v1/completions", json=body, timeout=60).status_code == 200
        assert node.labelled("disagg_kv_tier_blocks_total", "tier") == {
            "device": node.metric("disagg_kv_blocks_total"), "host": 0.05 * 2**30 // BLOCK_BYTES,
            "disk": 0.1 * 2**30 // (BLOCK_BYTES + HEADER.size + 8 * 16)}
        assert node.labelled("disagg_kv_tier_offloaded_bytes_total", "tier")["host"] == 12 * BLOCK_BYTES
        assert node.metric("disagg_kv_block_allocation_seconds_count") == 1
        # Its KV events name each tier that holds the prompt's blocks, as the router's view reads them.
        tokens = httpx.post(f"{node.url}/tokenize", json={"prompt": CONVERSATIONS[0]}, timeout=10).json()["tokens"]
        hashes = prompt_block_hashes(tokens, 16)
        assert len(hashes) == 12
        view, deadline = CacheView(), time.monotonic() + 30
        with httpx.stream("GET", f"{node.url}/kv_events", timeout=10) as events:
            for line in events.iter_lines():  # a heartbeat a second at least
                view.apply(json.loads(line))
                if set(hashes) <= view.hashes.get("disk", set()) or time.monotonic() > deadline:
                    break
        for medium in ("device", "host", "disk"):  # the disk's written in the background
            assert set(hashes) <= view.hashes[medium], medium
        assert view.matched_blocks(hashes) == 12 * MEDIUM_WEIGHTS["device"]
    finally:
        node.kill()


def stall_reads_of(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make the disk tier's reads of `path`'s payload hang, as on a disk that stopped answering, until
    the returned `release` is set; `stalled` is set once one hangs."""
    stalled, release = threading.Event(), threading.Event()
    read_exact_into = disk_module._read_exact_into

    def read(fd: int, view: memoryview) -> None:
        if not stalled.is_set() and os.readlink(f"/proc/self/fd/{fd}") == str(path):
            stalled.set()
            release.wait(60)
        read_exact_into(fd, view)

    monkeypatch.setattr(disk_module, "_read_exact_into", read)
    return stalled, release


def test_a_request_gone_mid_load_frees_every_block_and_the_log_sums_up_the_tiers(model_dir, tmp_path, monkeypatch,
                                                                                 caplog):
    """A request goes away (its client hung up) while its prefix is read from the disk tier, one file of
    which stalls: the engine aborts it, and once the read ends every block of every tier is free.
    Meanwhile the engine is busy, so the log gets the periodic one-line tier summary."""
    disk_dir = tmp_path / "kv"
    config = {"kv_cache_memory": 48 * BLOCK_BYTES, "kv_offloading_size": gib(64), "kv_disk_path": str(disk_dir),
              "kv_disk_size": gib(100)}
    writer = LLM(str(model_dir), device="cpu", **config)
    prompt = CONVERSATIONS[0]
    [expected] = writer.generate([prompt], greedy())
    writer.engine.close()
    keys = writer.engine.block_manager.block_keys(Sequence("p", writer.tokenizer.encode(prompt), greedy()))
    stalled, release = stall_reads_of(writer.engine.offload.disk.file_path(keys[4][0]), monkeypatch)
    monkeypatch.setattr(disk_module, "READ_DEADLINE_S", 60.0)  # the test ends the stall itself
    monkeypatch.setattr(async_engine, "TIERS_LOG_INTERVAL", 0.5)
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), device="cpu", **config)))
    offload = engine.engine.offload
    tokens = writer.tokenizer.encode(prompt)

    async def first_output(request_id: str) -> None:
        async for _ in engine.generate(request_id, tokens, greedy()):
            return

    async def scenario() -> list[int]:
        client = asyncio.create_task(first_output("gone"))
        # Blocks 0-3 arrive, 4 waits for its read, 5-11 wait behind it: 12 blocks in flight.
        await asyncio.to_thread(stalled.wait, 30)
        await asyncio.to_thread(wait_for, lambda: offload.blocks_in_flight() == 12, 30, "the prefix loading")
        await asyncio.to_thread(wait_for, lambda: "in flight 12 blocks, 1 loads" in caplog.text, 15, "the summary")
        client.cancel()  # the client hangs up
        with contextlib.suppress(asyncio.CancelledError):
            await client
        # Blocks 0-3 came back to the pool; 4-11 are held by the load until their reads end.
        await asyncio.to_thread(wait_for, lambda: engine.stats.num_blocks - engine.stats.num_free_blocks == 8, 10,
                                "the abort")
        release.set()
        await asyncio.to_thread(wait_for, lambda: offload.blocks_in_flight() == 0 and not offload.busy, 10,
                                "the load to end")
        assert engine.stats.num_free_blocks == engine.stats.num_blocks
        async for out in engine.generate("again", tokens, greedy()):  # and the prompt is served as usual
            final = out
        return final.token_ids

    try:
        with caplog.at_level(logging.INFO, logger="disagg.engine.async_engine"):
            token_ids = asyncio.run(asyncio.wait_for(scenario(), 120))
        line = next(line for line in caplog.text.splitlines() if "in flight 12 blocks, 1 loads" in line)
        # The prefix's 12 blocks and one for its last token; all 12 found on disk.
        assert "KV tiers: device 13/" in line and "; disk 12/" in line and "hits 12/12" in line
        assert token_ids == expected.token_ids
    finally:
        release.set()
        engine.stop()


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_cuda_tiers_bring_back_the_same_kv_bytes(tmp_path, mode):
    """On CUDA (copy stream, events, pinned host tier): every block loaded from the host tier, and
    from disk after a restart, holds the bytes it was computed with, and the answers equal those of
    plain device-cache hits."""
    import os

    from conftest import write_tiny_llama

    from disagg.engine.loader import resolve_model

    tokenizer_dir = os.environ.get("DISAGG_TEST_TOKENIZER_DIR") or resolve_model(None)
    model = write_tiny_llama(tmp_path / "model", Path(tokenizer_dir), num_layers=4, hidden_size=256,
                             num_heads=4, num_kv_heads=2, intermediate_size=512)

    def start() -> LLM:
        return LLM(str(model), device="cuda", dtype="bfloat16", kv_cache_memory=256 * 2**20,
                   kv_offloading_size=0.25, kv_offloading_mode=mode, kv_disk_path=str(tmp_path / "kv"),
                   kv_disk_size=1.0)

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 40000, (n,), generator=g).tolist() for n in (300, 333, 517, 1000)]
    llm = start()
    llm.generate(prompts, greedy())
    bm, kv = llm.engine.block_manager, llm.engine.kv_cache
    computed = {h: kv.block(b).clone() for h, b in bm.hash_to_block.items()}
    hits = llm.generate(prompts, greedy())  # from the device cache

    def assert_same_bytes() -> None:
        torch.cuda.synchronize()
        for h, b in bm.hash_to_block.items():
            if h in computed:
                assert torch.equal(kv.block(b), computed[h])

    evict_device_cache(llm)
    loaded = llm.generate(prompts, greedy())
    assert [o.num_cached_tokens for o in loaded] == [(len(p) - 1) // 16 * 16 for p in prompts]
    assert [o.token_ids for o in loaded] == [o.token_ids for o in hits]
    assert llm.engine.offload.host.stats.hits == sum((len(p) - 1) // 16 for p in prompts)
    assert_same_bytes()
    assert_nothing_held(llm)
    llm.engine.close()
    del llm

    llm = start()
    bm, kv = llm.engine.block_manager, llm.engine.kv_cache
    restarted = llm.generate(prompts, greedy())
    assert [o.num_cached_tokens for o in restarted] == [o.num_cached_tokens for o in loaded]
    assert [o.token_ids for o in restarted] == [o.token_ids for o in hits]
    assert_same_bytes()
    assert_nothing_held(llm)


def test_a_tier_copy_that_cannot_start_leaves_nothing_behind(model_dir, hf_model, monkeypatch):
    """A copy between the pools failing to start (say, no device memory for its staging buffer):
    stores are not kept, loads are computed instead, and no hash, hold or pin is left behind."""
    from disagg.engine.kv_tiers import offload as kv_offload

    llm = LLM(str(model_dir), device="cpu", kv_cache_memory=48 * BLOCK_BYTES, kv_offloading_size=gib(64))
    generate_exact(llm, hf_model, CONVERSATIONS[:2])  # their blocks are in the host tier
    evict_device_cache(llm)
    real = kv_offload.copy_blocks

    def failing(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(kv_offload, "copy_blocks", failing)
    outs = generate_exact(llm, hf_model, CONVERSATIONS[:3])  # two failed loads, one failed store
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    offload = llm.engine.offload
    assert not offload.storing and not offload.loading
    assert_nothing_held(llm)
    monkeypatch.setattr(kv_offload, "copy_blocks", real)
    evict_device_cache(llm)
    assert [o.num_cached_tokens for o in generate_exact(llm, hf_model, CONVERSATIONS[:2])] == [PREFIX_TOKENS] * 2


def test_a_load_whose_later_copy_cannot_start_keeps_the_blocks_before_it(model_dir, hf_model, monkeypatch):
    """A prefix load copies its first blocks, then looks up and copies the next ones: when a later
    copy cannot start, the blocks already copied count as cached, the rest is computed, and no
    hold or pin is left behind."""
    from disagg.engine.kv_tiers import offload as kv_offload

    llm = LLM(str(model_dir), device="cpu", kv_cache_memory=48 * BLOCK_BYTES, kv_offloading_size=gib(64))
    generate_exact(llm, hf_model, CONVERSATIONS[:1])
    evict_device_cache(llm)
    real, load_copies = kv_offload.copy_blocks, []

    def second_load_copy_fails(kv_cache, host, device_blocks, host_slots, to_host):
        if not to_host:
            load_copies.append(len(device_blocks))
            if len(load_copies) == 2:
                raise RuntimeError("out of memory")
        real(kv_cache, host, device_blocks, host_slots, to_host)

    monkeypatch.setattr(kv_offload, "copy_blocks", second_load_copy_fails)
    [out] = generate_exact(llm, hf_model, CONVERSATIONS[:1])
    assert load_copies == [kv_offload.FIRST_LOAD_BLOCKS, 12 - kv_offload.FIRST_LOAD_BLOCKS]
    assert out.num_cached_tokens == kv_offload.FIRST_LOAD_BLOCKS * 16
    assert_nothing_held(llm)
