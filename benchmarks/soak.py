"""Soak run (issue 24): victims token-exact under hostile load on a CPU 1P1D pair behind the router.

    python benchmarks/soak.py --duration 600 --streams 200 --hostile 50 --json soak.json   # the defaults
    python benchmarks/soak.py --duration 60 --streams 40 --hostile 12                     # a short run

(from the repository root: the nodes are `python -m disagg.cli` processes.)

Starts, on loopback only, a prefill node and a decode node sharing a KV auth token, both with an API
key, and `disagg router` in front. Each victim prompt's greedy answer (max_tokens 32, ignore_eos) is
taken from the unloaded system; then for --duration seconds --streams streaming victims run through
the router at all times, each compared with its reference text, while --hostile hostile requests,
spread evenly over the run, cycle through issue 24's list (KINDS below) against the router and the
decode node in turn, and a separate process polls every node's /health each 0.5 s. Afterwards, once
no KV block is in use, each process's RSS, threads and open descriptors are compared with their
level before the load (taken after a warm-up, a burst of victims and one hostile body of each
kind: pools that grow once and stay are not a leak).

The run fails (exit 1) if a victim differs from its reference or gets no complete answer, a /health
answer took over 1 s (or none came), a hostile request got a 5xx or no answer, a held connection was
not closed by the server, or a process ends above its baseline by more than THREAD_MARGIN threads,
FD_MARGIN descriptors or the RSS tolerance (rss_margin: see its docstring).
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from servers import Node, free_port, start_node, wait_ready  # noqa: E402

API_KEY = "soak-api-key-0123456789"
KV_TOKEN = "soak-kv-token-0123456789abcdef"  # >= 16 bytes, as the nodes require
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_TOKENS = 32
PROMPTS = ["Hello", "The capital of France is", "1, 2, 3, 4, 5,", "Once upon a time,", "def add(a, b):",
           "Water boils at", "Name a planet.", "Q: What is 12 times 12?\nA:"]
HEALTH_INTERVAL_S = 0.5
HEALTH_LIMIT_S = 1.0
HEALTH_TIMEOUT_S = 10.0  # a probe not answered by then counts as a failure
# After the load, against the baseline: a pool that grew by a few workers or sockets still closing
# are allowed this much (as in tests/test_hostile.py); a thread or descriptor per request is not.
THREAD_MARGIN = 4
FD_MARGIN = 8
HOLD_S = 45.0  # how long a held connection may stay open: past the nodes' 10 s header and 30 s body timeouts
IDLE_CONNECTIONS = 2000
SLOW_CONNECTIONS = 200
GRPC_CALLS = 500  # each of Info and Abort, per flood


def rss_margin(baseline_bytes: int) -> int:
    """RSS may end 10 % or 150 MiB above its baseline, whichever is more. Freed memory is not all given
    back: glibc's malloc arenas and Python's object allocator keep the pages of the load's high-water
    mark (200 requests' bodies, token lists and SSE buffers, a 3 MB chat body parsed in a worker thread
    with its own arena). A real leak is larger: one pathological grammar held ~160 MB for good (issue
    24), so a run with 5 distinct grammars a node would end ~800 MB up."""
    return max(baseline_bytes // 10, 150 * 2**20)


# --- the system ----------------------------------------------------------------------------------

def start_router(log_dir: Path, decode: Node) -> Node:
    port = free_port()
    args = [sys.executable, "-m", "disagg.cli", "router", "--decode-nodes", f"127.0.0.1:{decode.port}",
            "--port", str(port), "--api-key", API_KEY]
    log_path = log_dir / f"router-{port}.log"
    proc = subprocess.Popen(args, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    router = Node("router", proc, port, log_path, args=args)
    wait_ready(router)
    return router


def start_system(log_dir: Path) -> tuple[Node, Node, Node]:
    """(prefill, decode, router). Every prompt crosses to the prefill node; one it does not serve in
    time is recomputed on the decode node (counted in the report)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    key = ["--api-key", API_KEY]
    prefill = start_node("producer", log_dir, kv_extra={"auth_token": KV_TOKEN}, extra_args=key)
    decode = start_node("consumer", log_dir, prefill_nodes=[prefill.grpc_address], extra_args=key,
                        kv_extra={"auth_token": KV_TOKEN, "remote_prefill": "always"})
    return prefill, decode, start_router(log_dir, decode)


@dataclass
class Usage:
    rss_bytes: int
    threads: int
    fds: int


def usage(node: Node) -> Usage:
    pid = node.proc.pid
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return Usage(int(fields["VmRSS"].split()[0]) * 1024, int(fields["Threads"]), len(os.listdir(f"/proc/{pid}/fd")))


TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0A": "LISTEN", "04": "FIN_WAIT1",
              "05": "FIN_WAIT2", "07": "CLOSE", "09": "LAST_ACK", "0B": "CLOSING", "02": "SYN_SENT", "03": "SYN_RECV"}


def open_files(node: Node, ports: dict[int, str]) -> dict[str, int]:
    """What a process's descriptors are, counted: TCP sockets by state, local port and peer (a node's
    name where the port is one of `ports`), other sockets and files by kind. The evidence for a
    process that did not get back to its baseline."""
    pid = node.proc.pid
    tcp = {}
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in list(f)[1:]:
                cols = line.split()
                local, remote = int(cols[1].split(":")[1], 16), int(cols[2].split(":")[1], 16)
                tcp[cols[9]] = (f"{TCP_STATES.get(cols[3], cols[3])} {ports.get(local, 'a local port')} <-> "
                                f"{ports.get(remote, 'a client' if remote else '*')}")
    kinds: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            kind = tcp.get(target[8:-1], "socket (not TCP)")
        else:
            kind = target.split(":")[0] if ":" in target else "file " + target
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def within(now: Usage, base: Usage) -> bool:
    return (now.threads <= base.threads + THREAD_MARGIN and now.fds <= base.fds + FD_MARGIN
            and now.rss_bytes <= base.rss_bytes + rss_margin(base.rss_bytes))


def kv_blocks_used(node: Node) -> float:
    return node.metric("disagg_kv_blocks_used")


def remote_prefills(decode: Node) -> dict[str, float]:
    return decode.labelled("disagg_remote_prefill_total", "outcome")


# --- victims -------------------------------------------------------------------------------------

def victim_body(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}


async def stream_text(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[str, float, float]:
    """(the streamed text, seconds to the end, the longest wait for an event: the first counts from
    the request). Raises if the answer is not a 200 that ends with [DONE] and carries no error event."""
    start = last = time.monotonic()
    text, longest, done, events = "", 0.0, False, 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=victim_body(prompt), headers=AUTH) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    now = time.monotonic()
                    longest, last, events = max(longest, now - last), now, events + 1
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"error event: {event['error']}")
                    text += "".join(choice["text"] for choice in event["choices"])
    except httpx.HTTPError as e:  # where it broke: before the answer's first event, or in the stream
        raise RuntimeError(f"{type(e).__name__} ({e}) after {events} events") from e
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return text, time.monotonic() - start, longest


@dataclass
class Victims:
    sent: int = 0
    completed: int = 0
    exact: int = 0
    mismatches: list[dict] = field(default_factory=list)  # the first few
    mismatch_count: int = 0
    lost: list[str] = field(default_factory=list)  # the first few errors
    lost_count: int = 0
    seconds: list[float] = field(default_factory=list)  # each completed victim's, request to [DONE]
    longest_waits: list[float] = field(default_factory=list)  # each one's longest wait for an event

    def summary(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("seconds", "longest_waits")}
        for name, values in (("seconds", self.seconds), ("longest_wait_s", self.longest_waits)):
            ordered = sorted(values)
            out[name] = {"median": round(statistics.median(ordered), 2), "p99": round(percentile(ordered, 0.99), 2),
                         "max": round(ordered[-1], 2)} if ordered else None
        return out


def percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def victim_loop(client: httpx.AsyncClient, url: str, reference: dict[str, str], slot: int, start: float,
                      stop: float, victims: Victims) -> None:
    i = slot
    while time.monotonic() < stop:
        prompt = PROMPTS[i % len(PROMPTS)]
        i += 1
        victims.sent += 1
        sent = time.monotonic()
        try:
            text, seconds, longest = await stream_text(client, url, prompt)
        # No complete answer: a refusal, a broken connection, an error event or no [DONE].
        except (RuntimeError, KeyError, json.JSONDecodeError) as e:
            victims.lost_count += 1
            if len(victims.lost) < 10:  # times in seconds into the load, to set beside the hostile requests'
                victims.lost.append(f"{prompt!r} sent at {sent - start:.1f} s, lost at "
                                    f"{time.monotonic() - start:.1f} s: {type(e).__name__}: {e}")
            continue
        victims.completed += 1
        victims.seconds.append(seconds)
        victims.longest_waits.append(longest)
        if text == reference[prompt]:
            victims.exact += 1
        else:
            victims.mismatch_count += 1
            if len(victims.mismatches) < 10:
                victims.mismatches.append({"prompt": prompt, "want": reference[prompt], "got": text})


# --- hostile requests ----------------------------------------------------------------------------

LONG_PROMPT = list(range(1000, 2000))  # 1,000 token ids
# Each `body` kind: (path, the body's bytes for request i).
BODIES = {
    "distinct pathological grammar": lambda i: ("/v1/completions", {
        "prompt": "Say a", "max_tokens": 4, "temperature": 0, "guided_regex": f"a{{1000}}{{{1000 + i}}}"}),
    "chat of 100,000 empty messages": lambda i: ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": ""}] * 100_000, "max_tokens": 1}),
    "prompt list of 100,000 strings": lambda i: ("/v1/completions", {"prompt": ["hello world"] * 100_000,
                                                                       "max_tokens": 1}),
    "echo+logprobs+n=4 on 1,000 tokens": lambda i: ("/v1/completions", {
        "prompt": LONG_PROMPT, "echo": True, "logprobs": 1, "n": 4, "max_tokens": 1, "temperature": 0}),
    "(a{1000}){300} with n=64": lambda i: ("/v1/completions", {
        "prompt": "Say a", "max_tokens": 4, "n": 64, "temperature": 1.0, "guided_regex": "(a{1000}){300}"}),
    "top_p 1e-300": lambda i: ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 1.0,
                                                   "top_p": 1e-300, "seed": i}),
}
CONNECTION_KINDS = ("idle TCP connections", "slow-header senders", "slow-body senders")
GRPC_KIND = "Info/Abort flood without the token"
KINDS = [*BODIES, *CONNECTION_KINDS, GRPC_KIND]


@dataclass
class Hostile:
    index: int
    kind: str
    target: str
    started_s: float  # since the load began
    seconds: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)  # HTTP status, gRPC code or connection outcome: count
    failed: bool = False  # a 5xx, no answer, or a connection the server kept past HOLD_S
    note: str = ""


def count(hostile: Hostile, key: str) -> None:
    hostile.statuses[key] = hostile.statuses.get(key, 0) + 1


async def send_body(client: httpx.AsyncClient, node: Node, hostile: Hostile, i: int) -> None:
    path, body = BODIES[hostile.kind](i)
    content = json.dumps(body, separators=(",", ":")).encode()
    try:
        r = await client.post(f"{node.url}{path}", content=content,
                              headers={**AUTH, "Content-Type": "application/json"})
    except httpx.HTTPError as e:
        count(hostile, type(e).__name__)
        hostile.failed = True
        return
    count(hostile, str(r.status_code))
    hostile.failed = r.status_code >= 500
    if r.status_code >= 400:
        hostile.note = r.text[:200]


async def hold_connection(node: Node, opener: bytes, trickle: bytes) -> str:
    """Opens a connection, sends `opener` at once and then `trickle` a byte a second, and waits for the
    server to close it: 'closed' or 'reset' by the server, 'kept' past HOLD_S, or 'refused' at connect."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", node.port)
    except OSError:
        return "refused"
    deadline = time.monotonic() + HOLD_S
    sent = 0
    try:
        writer.write(opener)
        while time.monotonic() < deadline:
            if sent < len(trickle):
                writer.write(trickle[sent:sent + 1])
                sent += 1
            try:
                data = await asyncio.wait_for(reader.read(4096), timeout=1.0)
            except TimeoutError:
                continue
            if data == b"":
                return "closed"
        return "kept"
    except OSError:
        return "reset"
    finally:
        writer.close()


async def hold_connections(node: Node, hostile: Hostile) -> None:
    headers = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n" \
              "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    number, opener, trickle = {
        "idle TCP connections": (IDLE_CONNECTIONS, b"", b""),
        "slow-header senders": (SLOW_CONNECTIONS, b"", headers.encode()),
        "slow-body senders": (SLOW_CONNECTIONS, headers.encode(), b'{"prompt": "' + b"a" * 100),
    }[hostile.kind]
    outcomes = await asyncio.gather(*(hold_connection(node, opener, trickle) for _ in range(number)))
    for outcome in outcomes:
        count(hostile, outcome)
    hostile.failed = "kept" in hostile.statuses


def grpc_flood(prefill: Node, hostile: Hostile) -> None:
    import grpc

    from disagg.proto import disagg_pb2 as pb
    from disagg.proto import disagg_pb2_grpc

    with grpc.insecure_channel(prefill.grpc_address) as channel:
        stub = disagg_pb2_grpc.PrefillServiceStub(channel)
        for n in range(GRPC_CALLS):
            calls = (("Info", stub.Info, pb.InfoRequest(kv_host="127.0.0.1", kv_port=20000 + n)),
                     ("Abort", stub.Abort, pb.AbortRequest(request_id=f"soak-{n}", kv_dest_host="127.0.0.1",
                                                           kv_dest_port=1)))
            for name, method, request in calls:
                try:
                    method(request, timeout=10)
                    count(hostile, f"{name} OK")
                    hostile.failed = True  # no token: must be refused
                except grpc.RpcError as e:
                    count(hostile, f"{name} {e.code().name}")
                    hostile.failed |= e.code() != grpc.StatusCode.UNAUTHENTICATED


async def run_hostile(client: httpx.AsyncClient, nodes: dict[str, Node], hostile: Hostile) -> None:
    start = time.monotonic()
    if hostile.kind in BODIES:
        await send_body(client, nodes[hostile.target], hostile, hostile.index)
    elif hostile.kind in CONNECTION_KINDS:
        await hold_connections(nodes[hostile.target], hostile)
    else:
        await asyncio.to_thread(grpc_flood, nodes["prefill"], hostile)
    hostile.seconds = round(time.monotonic() - start, 2)


def plan_hostile(number: int, duration: float) -> list[Hostile]:
    """Spread evenly over the run, cycling through KINDS; each kind's turns alternate between the
    router and the decode node (gRPC: the prefill node)."""
    plan = []
    for i in range(number):
        kind = KINDS[i % len(KINDS)]
        target = "prefill" if kind == GRPC_KIND else ("router", "decode")[(i + i // len(KINDS)) % 2]
        plan.append(Hostile(i, kind, target, round((i + 0.5) * duration / number, 1)))
    return plan


# --- /health, from a process of its own (the load generator's loop would add its own delays) ------

def poll_health(urls: dict[str, str], stop: multiprocessing.Event, out: multiprocessing.Queue) -> None:
    """Puts {node: [(time.monotonic() of the probe, seconds or None if unanswered)]} on `out` once
    `stop` is set (CLOCK_MONOTONIC is the same in every process)."""
    latencies: dict[str, list[tuple[float, float | None]]] = {name: [] for name in urls}
    with httpx.Client(timeout=HEALTH_TIMEOUT_S) as client:
        while not stop.is_set():
            tick = time.monotonic()
            for name, url in urls.items():
                start = time.monotonic()
                try:
                    client.get(f"{url}/health").raise_for_status()
                    latencies[name].append((start, time.monotonic() - start))
                except httpx.HTTPError:
                    latencies[name].append((start, None))
            stop.wait(max(0.0, HEALTH_INTERVAL_S - (time.monotonic() - tick)))
    out.put(latencies)


def health_summary(probes: list[tuple[float, float | None]], load_start: float) -> dict:
    answered = sorted(t for _, t in probes if t is not None)
    slowest = sorted(probes, key=lambda p: float("inf") if p[1] is None else p[1], reverse=True)[:5]
    return {"probes": len(probes), "unanswered": len(probes) - len(answered),
            "max_s": round(answered[-1], 3) if answered else None,
            "p99_s": round(percentile(answered, 0.99), 3) if answered else None,
            "median_s": round(statistics.median(answered), 4) if answered else None,
            "over_limit": sum(t > HEALTH_LIMIT_S for t in answered),
            # (seconds into the load, latency): to set beside the hostile requests' times
            "slowest": [(round(at - load_start, 1), None if t is None else round(t, 3)) for at, t in slowest]}


# --- the run -------------------------------------------------------------------------------------

async def reference_texts(url: str, prompts: list[str] = PROMPTS) -> dict[str, str]:
    async with httpx.AsyncClient(timeout=300) as client:
        return {prompt: (await stream_text(client, url, prompt))[0] for prompt in prompts}


async def warm_up(nodes: dict[str, Node], reference: dict[str, str], streams: int) -> list[str]:
    """A burst of victims at full concurrency and one hostile body of each kind: the pools they grow
    (threads, connections) are in the baseline. Returns the warm-up's failures."""
    problems = []
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=streams + 8)) as client:
        answers = await asyncio.gather(*(stream_text(client, nodes["router"].url, PROMPTS[i % len(PROMPTS)])
                                         for i in range(streams)), return_exceptions=True)
        for i, answer in enumerate(answers):
            if isinstance(answer, BaseException) or answer[0] != reference[PROMPTS[i % len(PROMPTS)]]:
                problems.append(f"warm-up victim {i}: {answer!r}")
        for kind in BODIES:
            hostile = Hostile(-1, kind, "router", 0.0)
            await send_body(client, nodes["router"], hostile, -1)
            if hostile.failed:
                problems.append(f"warm-up {kind}: {hostile.statuses} {hostile.note}")
    return problems


async def load(nodes: dict[str, Node], reference: dict[str, str], args: argparse.Namespace,
               plan: list[Hostile]) -> Victims:
    victims = Victims()
    start = time.monotonic()
    stop = start + args.duration
    limits = httpx.Limits(max_connections=args.streams + 16, max_keepalive_connections=args.streams)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30), limits=limits) as streams, \
            httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30)) as attackers:

        async def scheduled(hostile: Hostile) -> None:
            await asyncio.sleep(max(0.0, start + hostile.started_s - time.monotonic()))
            print(f"  [{time.monotonic() - start:5.0f}s] hostile {hostile.index}: {hostile.kind} -> {hostile.target}",
                  flush=True)
            await run_hostile(attackers, nodes, hostile)
            print(f"  [{time.monotonic() - start:5.0f}s] hostile {hostile.index} done in {hostile.seconds}s: "
                  f"{hostile.statuses}", flush=True)

        await asyncio.gather(*(victim_loop(streams, nodes["router"].url, reference, slot, start, stop, victims)
                               for slot in range(args.streams)), *(scheduled(h) for h in plan))
    return victims


def settle(nodes: dict[str, Node], baseline: dict[str, Usage], timeout: float) -> float:
    """Waits (at most `timeout` s) until no KV block is in use and every process is back within its
    margins; returns the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            idle = kv_blocks_used(nodes["decode"]) == 0 and kv_blocks_used(nodes["prefill"]) == 0
        except httpx.HTTPError:
            idle = False
        if idle and all(within(usage(node), baseline[name]) for name, node in nodes.items()):
            break
        time.sleep(1.0)
    return time.monotonic() - start


def hostile_by_kind(plan: list[Hostile]) -> dict[str, dict]:
    by_kind: dict[str, dict] = {}
    for h in plan:
        entry = by_kind.setdefault(h.kind, {"sent": 0, "statuses": {}, "failed": 0, "max_seconds": 0.0})
        entry["sent"] += 1
        entry["failed"] += h.failed
        entry["max_seconds"] = max(entry["max_seconds"], h.seconds)
        for key, n in h.statuses.items():
            entry["statuses"][key] = entry["statuses"].get(key, 0) + n
    return by_kind


def failures_of(report: dict, plan: list[Hostile]) -> list[str]:
    victims = report["victims"]
    failures = list(report["warm_up_problems"])
    if victims["mismatch_count"]:
        failures.append(f"{victims['mismatch_count']} victims differ from their reference")
    if victims["lost_count"]:
        failures.append(f"{victims['lost_count']} victims got no complete answer")
    failures += [f"/health of {name}: max {h['max_s']} s, {h['unanswered']} unanswered"
                 for name, h in report["health"].items() if h["unanswered"] or (h["max_s"] or 0) > HEALTH_LIMIT_S]
    failures += [f"hostile {h.index} ({h.kind} -> {h.target}): {h.statuses} {h.note}" for h in plan if h.failed]
    failures += [f"{name} not back to baseline: {r['baseline']} -> {r['after']}"
                 for name, r in report["resources"].items() if not r["back_to_baseline"]]
    return failures


def run(args: argparse.Namespace) -> dict:
    """Starts the system, runs the soak and returns its report (with "failures")."""
    begun = time.time()
    prefill, decode, router = start_system(Path(args.log_dir))
    nodes = {"prefill": prefill, "decode": decode, "router": router}
    ports = {port: f"{name} {what}" for name, node in nodes.items()
             for what, port in (("HTTP", node.port), ("gRPC", node.grpc_port), ("KV", node.kv_port)) if port}
    ctx = multiprocessing.get_context("spawn")
    stop_health, health_out = ctx.Event(), ctx.Queue()
    loads: list[float] = []
    stop_loads = threading.Event()

    def sample_load_average() -> None:
        while not stop_loads.wait(10):
            loads.append(os.getloadavg()[0])

    try:
        reference = asyncio.run(reference_texts(router.url))
        print(f"reference texts from the unloaded system: {len(reference)} prompts", flush=True)
        warm_up_problems = asyncio.run(warm_up(nodes, reference, args.streams))
        settle(nodes, {name: usage(node) for name, node in nodes.items()}, 30)
        baseline = {name: usage(node) for name, node in nodes.items()}
        log_sizes = {name: node.log_path.stat().st_size for name, node in nodes.items()}
        files_before = {name: open_files(node, ports) for name, node in nodes.items()}
        prefills_before = remote_prefills(decode)
        print(f"baseline after warm-up: {baseline}", flush=True)

        poller = ctx.Process(target=poll_health, args=({n: node.url for n, node in nodes.items()}, stop_health,
                                                       health_out))
        poller.start()
        threading.Thread(target=sample_load_average, daemon=True).start()
        plan = plan_hostile(args.hostile, args.duration)
        start = time.monotonic()
        victims = asyncio.run(load(nodes, reference, args, plan))
        load_seconds = time.monotonic() - start
        stop_loads.set()
        stop_health.set()
        health = health_out.get(timeout=60)
        poller.join(timeout=30)

        dead = {name: node.proc.returncode for name, node in nodes.items() if node.proc.poll() is not None}
        if dead:
            print(json.dumps(victims.summary(), indent=1))
            sys.exit(f"FAILED: {dead} (name: exit code) ended during the load; their logs are in {args.log_dir}")
        settle_seconds = settle(nodes, baseline, args.settle)
        after = {name: usage(node) for name, node in nodes.items()}
        files_after = {name: open_files(node, ports) for name, node in nodes.items()}
        after_one_more = None
        if not all(within(after[name], baseline[name]) for name in nodes):
            # Evidence: are they held only until the next request (an idle pool cleaned lazily)?
            asyncio.run(reference_texts(router.url, PROMPTS[:1]))
            time.sleep(6.0)  # past the nodes' 5 s keep-alive
            after_one_more = {name: asdict(usage(node)) | {"open_files": open_files(node, ports)}
                              for name, node in nodes.items()}
        prefills_after = remote_prefills(decode)
    finally:
        for node in (router, decode, prefill):
            node.kill()

    report = {
        "args": vars(args), "wall_seconds": round(time.time() - begun), "load_seconds": round(load_seconds, 1),
        "settle_seconds": round(settle_seconds, 1),
        "load_average": {"max": max(loads, default=None), "mean": round(statistics.mean(loads), 2) if loads else None},
        "warm_up_problems": warm_up_problems, "victims": victims.summary(),
        "remote_prefills": {k: prefills_after.get(k, 0) - prefills_before.get(k, 0) for k in prefills_after},
        "hostile": hostile_by_kind(plan), "hostile_requests": [asdict(h) for h in plan],
        "health": {name: health_summary(probes, start) for name, probes in health.items()},
        "resources": {name: {"baseline": asdict(baseline[name]), "after": asdict(after[name]),
                             "rss_margin_bytes": rss_margin(baseline[name].rss_bytes),
                             "back_to_baseline": within(after[name], baseline[name]),
                             "open_files_before": files_before[name], "open_files_after": files_after[name],
                             "log_growth_bytes": nodes[name].log_path.stat().st_size - log_sizes[name]}
                      for name in nodes},
        "after_one_more_victim": after_one_more,
        "margins": {"threads": THREAD_MARGIN, "fds": FD_MARGIN, "rss": "max(10% of baseline, 150 MiB)"},
    }
    report["failures"] = failures_of(report, plan)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600, help="seconds of load")
    ap.add_argument("--streams", type=int, default=200, help="concurrent victim streams")
    ap.add_argument("--hostile", type=int, default=50, help="hostile requests spread over the run")
    ap.add_argument("--settle", type=float, default=120, help="seconds allowed to get back to the baseline")
    ap.add_argument("--log-dir", default="/tmp/disagg-soak-logs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # for the idle sockets
    report = run(args)
    print(json.dumps({k: report[k] for k in ("victims", "remote_prefills", "hostile", "health", "resources",
                                             "load_average", "settle_seconds")}, indent=1))
    failures = report["failures"]
    print("\nFAILED:\n  " + "\n  ".join(failures) if failures else "\nOK: every check held")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
