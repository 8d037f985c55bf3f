"""Probe: NIXL WRITE bandwidth cuda:0 -> cuda:1 for one 256 MiB region split into k descriptors of
one transfer, against a device-to-device torch copy (copy engine) on 1 and on k streams.

    python benchmarks/nixl_split_probe.py
"""

import json
import multiprocessing as mp
import statistics
import time

import torch

SIZE = 256 << 20  # bytes of a write; the buffers hold two
SPLITS = (1, 2, 4, 8, 16)
REPEATS = 20


def agent_cls():
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def receiver(q_in, q_out) -> None:
    nixl_agent, cfg = agent_cls()
    torch.cuda.set_device(1)
    agent = nixl_agent("probe-recv", cfg(backends=["UCX"]))
    dst = torch.zeros(2 * SIZE, dtype=torch.uint8, device="cuda:1")
    descs = agent.register_memory([dst])
    q_out.put((agent.get_agent_metadata(), dst.data_ptr()))
    q_in.get()  # done
    agent.deregister_memory(descs)


def main() -> None:
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(q_in, q_out))
    proc.start()
    nixl_agent, cfg = agent_cls()
    torch.cuda.set_device(0)
    agent = nixl_agent("probe-send", cfg(backends=["UCX"]))
    src = torch.ones(2 * SIZE, dtype=torch.uint8, device="cuda:0")
    descs = agent.register_memory([src])
    meta, dst_ptr = q_out.get(timeout=120)
    peer = agent.add_remote_agent(meta)
    result = {}
    for k in SPLITS:
        part = SIZE // k
        local = agent.get_xfer_descs([(src.data_ptr() + i * part, part, 0) for i in range(k)], "VRAM")
        remote = agent.get_xfer_descs([(dst_ptr + i * part, part, 1) for i in range(k)], "VRAM")
        handle = agent.initialize_xfer("WRITE", local, remote, peer, b"x")
        samples = []
        for r in range(REPEATS + 2):
            t0 = time.perf_counter()
            assert agent.transfer(handle) != "ERR"
            while (state := agent.check_xfer_state(handle)) != "DONE":
                assert state != "ERR"
            if r >= 2:
                samples.append(SIZE / (time.perf_counter() - t0) / 1e9)
        agent.release_xfer_handle(handle)
        result[f"nixl_split_{k}"] = round(statistics.median(samples), 1)
    for inflight in (2, 4):  # whole 256 MiB writes, several in flight at once
        part = 2 * SIZE // inflight
        handles = [agent.initialize_xfer(
            "WRITE", agent.get_xfer_descs([(src.data_ptr() + i * part, part, 0)], "VRAM"),
            agent.get_xfer_descs([(dst_ptr + i * part, part, 1)], "VRAM"), peer, b"y") for i in range(inflight)]
        samples = []
        for r in range(REPEATS + 2):
            t0 = time.perf_counter()
            for h in handles:
                assert agent.transfer(h) != "ERR"
            for h in handles:
                while agent.check_xfer_state(h) != "DONE":
                    pass
            if r >= 2:
                samples.append(2 * SIZE / (time.perf_counter() - t0) / 1e9)
        for h in handles:
            agent.release_xfer_handle(h)
        result[f"nixl_inflight_{inflight}_of_{part >> 20}MiB"] = round(statistics.median(samples), 1)
    dst0 = torch.empty(SIZE, dtype=torch.uint8, device="cuda:1")
    for k in (1, 2, 4, 8):
        streams = [torch.cuda.Stream(device=0) for _ in range(k)]
        part = SIZE // k
        samples = []
        for r in range(REPEATS + 2):
            torch.cuda.synchronize(0), torch.cuda.synchronize(1)
            t0 = time.perf_counter()
            for i, s in enumerate(streams):
                with torch.cuda.stream(s):
                    dst0[i * part:(i + 1) * part].copy_(src[i * part:(i + 1) * part], non_blocking=True)
            torch.cuda.synchronize(0), torch.cuda.synchronize(1)
            if r >= 2:
                samples.append(SIZE / (time.perf_counter() - t0) / 1e9)
        result[f"torch_copy_streams_{k}"] = round(statistics.median(samples), 1)
    q_in.put("done")
    proc.join(30)
    agent.deregister_memory(descs)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
