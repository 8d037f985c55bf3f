"""A lookup-buffer producer in its own process, driven by tests/test_lookup_buffer.py.

    python tests/lookup_peer.py --dest HOST:PORT [--dest HOST:PORT ...] --source-port P
        --first I --count N --buffer-bytes B [--big-floats F]

Entry i (first <= i < first + count; count 0 means forever) is request f"req-{i}" with
make_request(i)'s tokens, tensors (+ the --big-floats tensor) and extras, addressed to dest[i % len(dest)]. Once
every entry is sent it prints the producer's stats as one JSON line and exits.
The repository root must be on PYTHONPATH.
"""

import argparse
import dataclasses
import itertools
import json
import time

import torch

from disagg.lookup_buffer import LookupBufferProducer
from disagg.pipes import PipeConfig


def make_request(i: int) -> tuple[list[int], list[torch.Tensor], dict[str, int | float | str]]:
    """Deterministic tokens, KV tensors of mixed shapes and dtypes, and extras for request i."""
    gen = torch.Generator().manual_seed(i)
    n = 5 + i % 23
    token_ids = torch.randint(0, 32000, (n,), generator=gen).tolist()
    kv = [
        torch.randn(2, n, 4, 16, generator=gen),
        torch.randn(2, n, 4, 16, generator=gen).to(torch.bfloat16),
        torch.randn(n, 8, generator=gen).to(torch.float16),
        torch.arange(n, dtype=torch.int64),
        torch.randn(n, generator=gen) > 0,
        torch.tensor(i / 7, dtype=torch.float64),  # 0-d
    ]
    extras = {"first_token": token_ids[-1], "temperature": 0.5 + i / 1000, "note": f"req-{i}"}
    return token_ids, kv, extras


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dest", action="append", required=True, help="consumer HOST:PORT, repeatable")
    parser.add_argument("--source-port", type=int, required=True, help="kv_port naming this producer")
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, default=1, help="0: insert forever")
    parser.add_argument("--buffer-bytes", type=int, default=1 << 20)
    parser.add_argument("--big-floats", type=int, default=0, help="add torch.ones(BIG_FLOATS) to every entry")
    args = parser.parse_args()

    dests = [(host, int(port)) for host, port in (d.rsplit(":", 1) for d in args.dest)]
    config = PipeConfig(kv_ip="127.0.0.1", kv_port=args.source_port, timeout=10.0)
    producer = LookupBufferProducer("tcp", config, kv_buffer_size=args.buffer_bytes, ttl=30.0, insert_timeout=30.0)
    # One tensor shared by all entries: inserting is instant, so the sender is always busy.
    big = [torch.ones(args.big_floats)] if args.big_floats else []
    indices = itertools.count(args.first) if args.count == 0 else range(args.first, args.first + args.count)
    for i in indices:
        token_ids, kv, extras = make_request(i)
        producer.insert(f"req-{i}", token_ids, kv + big, extras, dests[i % len(dests)])
    deadline = time.monotonic() + 30.0
    while producer.stats().entries and time.monotonic() < deadline:
        time.sleep(0.01)
    print(json.dumps(dataclasses.asdict(producer.stats())), flush=True)
    producer.close()


if __name__ == "__main__":
    main()
