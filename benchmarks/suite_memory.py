"""The memory a command and every process it starts hold, sampled: for the test suite's peak.

    python benchmarks/suite_memory.py --log mem.tsv -- python -m pytest -q -n 2 --dist loadgroup tests

Every 0.5 s it sums Pss and Rss (/proc/PID/smaps_rollup) over the command's process tree and over any
process whose working directory is under this checkout (a node that outlived its parent). Pss counts a
page shared by n processes as 1/n in each, so the sum is what the tree costs the machine; Rss sums count
shared pages (torch's libraries, a model file in the page cache) once per process. Each sample is a line
of the log: time, total Pss and Rss in MB, and the largest processes with what they are; a process that a
test started carries the test's name (PYTEST_CURRENT_TEST in its environment). The command's own output
passes through, each line also written to the log with its time. At the end it prints the peaks.
"""

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parent_pids() -> dict[int, int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # ended meanwhile
                continue
            # The command name (field 2) may hold spaces and parentheses: the fields after its last ')'.
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def tree(root: int, parents: dict[int, int]) -> set[int]:
    """root and its descendants, and the processes working under this checkout (not this sampler)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    for pid in parents:
        try:
            if Path(os.readlink(f"/proc/{pid}/cwd")).is_relative_to(ROOT):
                found.add(pid)
        except OSError:  # ended, or another user's
            continue
    return found - {os.getpid()}


def rollup(pid: int) -> tuple[int, int]:
    """(Pss, Rss) of a process in kB; (0, 0) once it has ended."""
    pss = rss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
            elif line.startswith("Rss:"):
                rss = int(line.split()[1])
    except OSError:
        pass
    return pss, rss


def describe(pid: int) -> str:
    """What a process is: its command line, shortened, and the test that started it."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    args = [a for a in argv if a]
    if "-m" in args and args.index("-m") + 1 < len(args):  # python -m module ...: from the module on
        args = args[args.index("-m") + 1:]
    text = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(args))
    text = text[:90]
    worker = next((e.split("=", 1)[1] for e in environ if e.startswith("PYTEST_XDIST_WORKER=")), None)
    test = next((e.split("=", 1)[1] for e in environ if e.startswith("PYTEST_CURRENT_TEST=")), None)
    if test:  # started by a test: which one (a pytest worker itself only ever has its starting environment)
        text += f"  [{test.split(' ')[0]}]"
    elif worker and "pytest" not in text:
        text += f"  [{worker}]"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, required=True, help="where the samples and the output go (TSV)")
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--top", type=int, default=8, help="processes named in each sample")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command to run")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    log = args.log.open("w", buffering=1)
    lock = threading.Lock()
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def relay() -> None:  # the command's output, on our stdout and in the log
        for line in proc.stdout:
            sys.stdout.write(line)
            with lock:
                log.write(f"{time.monotonic() - start:.1f}\tOUT\t{line.rstrip()}\n")

    relay_thread = threading.Thread(target=relay, daemon=True)
    relay_thread.start()
    peak_pss = peak_rss = 0
    peak_line = ""
    while proc.poll() is None:
        now = time.monotonic() - start
        sizes = {pid: rollup(pid) for pid in tree(proc.pid, parent_pids())}
        pss = sum(p for p, _ in sizes.values()) // 1024
        rss = sum(r for _, r in sizes.values()) // 1024
        top = sorted(sizes, key=lambda pid: -sizes[pid][0])[:args.top]
        line = f"{now:.1f}\tMEM\tpss={pss}\trss={rss}\tn={len(sizes)}\t" + " | ".join(
            f"{sizes[pid][0] // 1024} {pid} {describe(pid)}" for pid in top)
        with lock:
            log.write(line + "\n")
        if pss > peak_pss:
            peak_pss, peak_line = pss, line
        peak_rss = max(peak_rss, rss)
        time.sleep(max(0.0, args.interval - (time.monotonic() - start - now)))
    relay_thread.join()
    summary = (f"exit {proc.returncode}, {time.monotonic() - start:.0f} s; peak Pss {peak_pss} MB, "
               f"peak Rss sum {peak_rss} MB\nat the peak: {peak_line}")
    print(summary)
    log.write(f"{time.monotonic() - start:.1f}\tEND\t{summary}\n")
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
