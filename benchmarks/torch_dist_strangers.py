"""What a stranger (no token) can do to a torch_dist pipe's gloo listeners, on CPU over loopback:
where they listen, and what connections to them cost the node (docs/ARCHITECTURE.md, "What the
token does not cover").

    PYTHONPATH=. python benchmarks/torch_dist_strangers.py [--connections 200]
"""

import argparse
import gc
import os
import socket
import struct
import threading
import time

import torch

from disagg import pipes
from disagg.pipes.base import PipeConfig


def listening() -> set[tuple[str, int]]:
    """(ip, port) of this process's listening IPv4 TCP sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ip, port = fields[1].split(":")
                found.add((socket.inet_ntoa(struct.pack("<I", int(ip, 16))), int(port, 16)))
    return found


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def open_pair(config: PipeConfig):
    """A torch_dist listener, and the two ends of one pipe through it."""
    listener = pipes.listen("torch_dist", config)
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()))
    thread.start()
    connector = pipes.connect("torch_dist", config, *listener.address)
    thread.join()
    return listener, accepted[0], connector


def roundtrip(server, connector) -> bool:
    """One message over gloo (larger than what goes inline); a gloo send waits for the recv."""
    got = []
    receiver = threading.Thread(target=lambda: got.extend(server.recv()))
    receiver.start()
    connector.send([torch.arange(100_000, dtype=torch.float32)])
    receiver.join()
    return torch.equal(got[0], torch.arange(100_000, dtype=torch.float32))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--connections", type=int, default=200, help="strangers' connections to each gloo listener")
    args = parser.parse_args()
    config = PipeConfig(kv_ip="127.0.0.1", kv_port=0, auth_token="t" * 32, timeout=10)
    before = listening()
    listener, server, connector = open_pair(config)
    assert roundtrip(server, connector)
    gloo = sorted(listening() - before - {listener.address})
    print(f"the pipe endpoint {listener.address}; gloo's listeners once the pair is up: {gloo}")
    fds = descriptors()
    for address in gloo:
        for i in range(args.connections):
            with socket.create_connection(address) as stranger:
                stranger.sendall(struct.pack("<Q", 1000 + i))  # a sequence number no pair waits for
    time.sleep(1)
    print(f"descriptors: {fds} before {args.connections * len(gloo)} strangers' connections (each sent a "
          f"sequence number, then closed its end), {descriptors()} after; the pipe still works: "
          f"{roundtrip(server, connector)}")
    for end in (connector, server, listener):
        end.close()
    time.sleep(1)
    print(f"pipes closed, objects held: gloo listeners {sorted(listening() - before)}, descriptors {descriptors()}")
    del listener, server, connector
    gc.collect()
    time.sleep(1)
    print(f"pipe objects dropped: gloo listeners {sorted(listening() - before)}, descriptors {descriptors()}")


if __name__ == "__main__":
    main()
