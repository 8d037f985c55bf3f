"""The GIL and the KV handoff: a layer-wise entry received while another thread of the same process
runs Python, as a decode node's engine thread and event loop do between their C calls.

    python benchmarks/handoff_gil.py [--switch-intervals-ms 5,1,0.5,0.2] [--parts 32,4] [--pipe tcp]
        [--in-place] [--json PATH]

A producer process sends entries of 32 layers of [2, 1024, 8, 32] float32 (1 MiB a layer) over
--pipe, as --parts messages each; the consumer's process claims them one at a time with
drop_select (with --in-place, received straight into views of a KV cache's blocks, as a decode
node does). Each case: the median time from lookup to entry in hand, with and without a thread that
loops over pure Python in the consumer's process, at each `sys.setswitchinterval`. Python's
default interval is 5 ms: a thread that wakes from a socket read, or returns from any C call that
let go of the GIL, waits up to that long for it while another thread runs Python.
"""

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time

import torch

from disagg.engine.kv_cache import KVCache
from disagg.lookup_buffer import LookupBufferConsumer, LookupBufferProducer
from disagg.pipes import PipeConfig, RowScatter

LAYERS, LAYER_SHAPE = 32, (2, 1024, 8, 32)


BLOCK_SIZE = 16


def produce(pipe: str, port: int, n: int, parts: int, next_entry: mp.Queue) -> None:
    producer = LookupBufferProducer(pipe, PipeConfig(timeout=30), 1 << 30, 30.0, 5.0)
    kv = torch.randn(LAYERS, *LAYER_SHAPE)
    step = LAYERS // parts
    layers = [(first, first + step) for first in range(0, LAYERS, step)]
    for i in range(n):
        producer.open(f"r{i}", [1], layers, kv.shape[2], kv.nbytes, ("127.0.0.1", port))
        for first, end in layers:
            producer.put(f"r{i}", first, end, kv[first:end], None)
        next_entry.get()
    producer.close()


def python_loop(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(300))


def measure(pipe: str, in_place: bool, interval: float, parts: int, busy: bool, n: int) -> float:
    sys.setswitchinterval(interval)
    consumer = LookupBufferConsumer(pipe, PipeConfig(kv_port=0, timeout=30), kv_buffer_size=1 << 30)
    if in_place:  # every entry into the same blocks, one after the other
        _, _, tokens, heads, dim = (LAYERS, *LAYER_SHAPE)
        cache = KVCache(LAYERS, tokens // BLOCK_SIZE, BLOCK_SIZE, heads, dim, torch.float32, torch.device("cpu"))
        into = RowScatter(cache.kv, cache.rows(list(range(tokens // BLOCK_SIZE)), 0, tokens))
        for i in range(n):
            consumer.expect(f"r{i}", [into])
    ctx = mp.get_context("spawn")
    next_entry = ctx.Queue()
    producer = ctx.Process(target=produce, args=(pipe, consumer.address[1], n, parts, next_entry))
    producer.start()
    stop = threading.Event()
    loop = threading.Thread(target=python_loop, args=(stop,))
    if busy:
        loop.start()
    times = []
    try:
        for i in range(n):
            start = time.perf_counter()
            consumer.drop_select(f"r{i}", [1], 30)
            times.append(time.perf_counter() - start)
            next_entry.put(None)
    finally:
        stop.set()
        producer.join()
        consumer.close()
        if busy:
            loop.join()
    return statistics.median(times[2:])  # the first two also connect and warm up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--switch-intervals-ms", default="5,1,0.5,0.2")
    ap.add_argument("--parts", default="32,4")
    ap.add_argument("--entries", type=int, default=12)
    ap.add_argument("--pipe", default="tcp")
    ap.add_argument("--in-place", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for interval_ms in [float(x) for x in args.switch_intervals_ms.split(",")]:
        for parts in [int(x) for x in args.parts.split(",")]:
            for busy in (False, True):
                seconds = measure(args.pipe, args.in_place, interval_ms / 1e3, parts, busy, args.entries)
                rows.append({"switch_interval_ms": interval_ms, "parts": parts, "python_thread": busy,
                             "entry_ms": seconds * 1e3})
                print(f"switch {interval_ms:4.1f} ms  {parts:2d} parts  python thread {'on ' if busy else 'off'}: "
                      f"entry {seconds * 1e3:6.1f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": LAYERS, "layer_shape": LAYER_SHAPE, "dtype": "float32", "pipe": args.pipe,
                       "in_place": args.in_place, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
