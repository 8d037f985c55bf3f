"""Which calls on a KV receiver's path let go of the GIL: while one runs, can another thread run Python?

    python benchmarks/gil_release.py [--json PATH]

A second thread counts in a pure-Python loop; each call below runs 200 times (each after a
time.sleep(0), so it starts on a fresh time slice) and counts the calls during which the counter
moved. A call that lets go of the GIL lets the counter move nearly every time, and then waits for
the GIL to come back (up to sys.setswitchinterval while the counter runs); one that does not is
only rarely interrupted, by the interval itself.
"""

import argparse
import json
import socket
import sys
import threading
import time

import torch

CALLS = 200


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.setswitchinterval(0.005)
    ticks, stop = [0], threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks[0] += 1

    x, big = torch.zeros(1000), torch.zeros(1 << 20)
    views = [x[i * 10:(i + 1) * 10] for i in range(8)]
    a, b = socket.socketpair()
    calls = {
        "tensor.numel()": lambda: x.numel(), "tensor[10:20]": lambda: x[10:20], "view(-1)": lambda: x.view(-1),
        "view(torch.uint8)": lambda: x.view(torch.uint8), "reshape": lambda: x.reshape(10, 100),
        "split": lambda: x.split(100), "torch.empty": lambda: torch.empty(100),
        "_foreach_copy_ (8 views)": lambda: torch._foreach_copy_(views, views),
        "copy_ (4 MiB)": lambda: big.copy_(big), "add (4 MiB)": lambda: big.add(1),
        "socket send + recv": lambda: (a.send(b"x"), b.recv(1)),
    }
    counter = threading.Thread(target=count)
    counter.start()
    rows = []
    try:
        for name, call in calls.items():
            moved = 0
            for _ in range(CALLS):
                time.sleep(0)
                before = ticks[0]
                call()
                moved += ticks[0] != before
            rows.append({"call": name, "other_thread_ran": moved, "calls": CALLS})
            print(f"{name:26s} the other thread ran during {moved:3d} of {CALLS} calls", flush=True)
    finally:
        stop.set()
        counter.join()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "python": sys.version.split()[0], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
