"""The remote end of tests/test_pipes.py, run as its own process.

    python tests/pipe_peer.py PIPE MODE HOST PORT [--token T] [--seed S] [--count N] [--repeat R]
                              [--timeout S] [--device D] [--sources A,B,...]

Modes:
  echo   connect, then for each message of the seeded sequence: receive it (every other
         one into preallocated tensors on --device), check it equals what we expect, send
         it back.
  big    connect, print "sending", then send one message of --count MiB; the test kills us.
  last   --repeat times: connect, send last_message(--count), close at once (nothing may be lost by the close).
  kv     connect (nixl), send --count messages of kv_message(seed, i), close, then print as one JSON
         line how many times our agent loaded the receiver's metadata after the connection's setup.
  flood  open --count raw connections and never speak; after a second print, as one JSON
         line, how many are open with the listener's hello and how many it closed, then hold
         the sockets until stdin closes.
  hold   keep --count silent connections open from each of --sources (addresses to bind),
         opening a new one half a second after the listener closes one, as an attacker holding
         its handshake slots would; print "holding" once all are open, stop when stdin closes.
"""

import argparse
import json
import random
import select
import socket
import sys
import time

import torch

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]
MAX_NUMEL = 1 << 15  # keeps a 500-message run a few hundred MiB at most


def random_tensor(rng: random.Random) -> torch.Tensor:
    ndim = rng.randint(0, 4)
    shape, budget = [], MAX_NUMEL
    for _ in range(ndim):
        dim = 0 if rng.random() < 0.05 else rng.randint(1, min(1000, max(1, budget)))
        shape.append(dim)
        budget //= max(dim, 1)
    dtype = rng.choice(DTYPES)
    gen = torch.Generator().manual_seed(rng.getrandbits(32))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(
        max(info.min, -(2**31)),
        min(info.max, 2**31 - 1),
        shape,
        generator=gen,
        dtype=dtype,
    )


def messages(seed: int, count: int) -> list[list[torch.Tensor] | None]:
    """A reproducible sequence: 5% None, 5% empty lists, else 1-4 random tensors."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        r = rng.random()
        if r < 0.05:
            out.append(None)
        elif r < 0.10:
            out.append([])
        else:
            out.append([random_tensor(rng) for _ in range(rng.randint(1, 4))])
    return out


def same(a: list[torch.Tensor] | None, b: list[torch.Tensor] | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b)
    )


def last_message(mib: int) -> list[torch.Tensor]:
    """--count MiB of int64s counting up: each byte checkable, as many fragments as the transport cuts."""
    return [torch.arange((mib << 20) // 8, dtype=torch.int64)]


def kv_message(seed: int, i: int) -> list[torch.Tensor]:
    """Message i of the kv mode: a request's KV [layers, 2, tokens, heads, dim] in bfloat16 and a
    small float32 tensor beside it."""
    gen = torch.Generator().manual_seed(seed * 1000 + i)
    return [torch.randn(2, 2, 5, 2, 8, generator=gen).to(torch.bfloat16), torch.randn(3, generator=gen)]


class CountingAgent:
    """Stands in for a pipe's NIXL agent: passes every call on and counts them by name."""

    def __init__(self, agent):
        self.agent, self.calls = agent, {}

    def __getattr__(self, name: str):
        attr = getattr(self.agent, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args, **kwargs)

        return counted


def state(s: socket.socket) -> str:
    """"closed" by the listener (after its hello or before), else "hello" once the hello came, or "pending"."""
    s.setblocking(False)  # a socket with a timeout would wait that long for more
    got = b""
    while True:
        try:
            data = s.recv(64)
        except BlockingIOError:
            return "hello" if got else "pending"
        except ConnectionResetError:
            return "closed"
        if not data:
            return "closed"
        got += data


def flood(host: str, port: int, count: int) -> None:
    socks = [socket.create_connection((host, port), timeout=10) for _ in range(count)]
    time.sleep(1.0)
    counts = {"hello": 0, "closed": 0, "pending": 0}
    for s in socks:
        counts[state(s)] += 1
    print(json.dumps(counts), flush=True)
    sys.stdin.read()


def hold(host: str, port: int, sources: list[str], count: int) -> None:
    def open_from(source: str) -> socket.socket:
        s = socket.socket()
        s.bind((source, 0))
        s.connect((host, port))
        return s

    socks = {open_from(source): source for source in sources for _ in range(count)}
    closed: list[tuple[float, str]] = []  # (when to open again, source)
    print("holding", flush=True)
    while True:
        readable, _, _ = select.select([*socks, sys.stdin], [], [], 0.1)
        if sys.stdin in readable:
            return
        for s in readable:
            try:
                data = s.recv(64)  # the listener's hello, or its close
            except OSError:
                data = b""
            if not data:
                closed.append((time.monotonic() + 0.5, socks.pop(s)))
                s.close()
        while closed and closed[0][0] <= time.monotonic():
            source = closed.pop(0)[1]
            socks[open_from(source)] = source


def main() -> int:
    from disagg.pipes import PipeConfig, connect

    p = argparse.ArgumentParser()
    p.add_argument("pipe")
    p.add_argument("mode", choices=["echo", "big", "last", "kv", "flood", "hold"])
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=500)
    p.add_argument("--repeat", type=int, default=1, help="last: connections, one after another")
    p.add_argument("--sources", default="127.0.0.1", help="hold: source addresses, comma-separated")
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument(
        "--device", default="cpu", help="where preallocated receive tensors live"
    )
    args = p.parse_args()
    if args.mode == "flood":
        flood(args.host, args.port, args.count)
        return 0
    if args.mode == "hold":
        hold(args.host, args.port, args.sources.split(","), args.count)
        return 0
    config = PipeConfig(auth_token=args.token, timeout=args.timeout)
    if args.mode == "last":
        for _ in range(args.repeat):
            pipe = connect(args.pipe, config, args.host, args.port)
            pipe.send(last_message(args.count))
            pipe.close()
        return 0
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pipe = connect(args.pipe, config, args.host, args.port)
    if args.mode == "big":
        big = [
            torch.empty(args.count << 20, dtype=torch.uint8)
        ]  # contents do not matter
        print("sending", flush=True)
        pipe.send(big)
        return 0
    if args.mode == "kv":
        pipe._agent = agent = CountingAgent(pipe._agent)
        for i in range(args.count):
            pipe.send(kv_message(args.seed, i))
        pipe.close()
        print(json.dumps({"add_remote_agent": agent.calls.get("add_remote_agent", 0)}), flush=True)
        return 0
    for i, expected in enumerate(messages(args.seed, args.count)):
        if i % 2 and expected is not None:
            got = pipe.recv(out=[torch.empty_like(t, device=device) for t in expected])
        else:
            got = pipe.recv()
        if not same(got, expected):
            print(
                f"peer: message {i} differs from the seeded sequence", file=sys.stderr
            )
            return 1
        pipe.send(got)
    pipe.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
