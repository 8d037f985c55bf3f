"""KV handoff overhead: TTFT of disagg 1P1D minus TTFT of a colocated node, by prompt length.

    python benchmarks/kv_handoff.py --lens 128,512,1024,2048 --repeats 3 --json handoff.json

One request at a time (max_tokens 2, streamed, random token ids: no prefix-cache hits), each
length on both systems side by side, alternating which goes first; medians over repeats. The
colocated node runs with the same core and threads as the prefill node (default: both on core 0,
1 thread; the decode node on core 1), so the difference is the handoff, not more compute.

Split of the disagg TTFT, per request:
- prefill: the prefill node's own time for the call (its log line "prefill <id>: ... in Xs" =
  PrefillResult.prefill_seconds: schedule + compute + KV taken out of the cache + buffer insert);
- kv_transfer: the decode node's `disagg_kv_transfer_seconds` for the request (Prefill call sent
  -> KV loaded into its blocks), read as the histogram's _sum delta around the request;
- transfer+load = kv_transfer - prefill: the call's way there, the pipe (the first token follows the
  KV there), drop_select and the load (the call's answer no longer gates it: it may come after);
- rest = TTFT - kv_transfer: HTTP, tokenization, block reservation, the first token's stream.

The fixed cost of a colocated TTFT, per request, from the node's own histograms read around it:
- engine = queue + prefill time (`disagg_request_queue_time_seconds` + `..._prefill_time_seconds`:
  the request added to the engine -> its first token sampled, at the end of that step);
- fixed = TTFT (client) - engine; of it, `api` = server TTFT (`disagg_time_to_first_token_seconds`:
  the API's request object made -> the token taken off its queue) - engine, and `http` = the rest
  (the client's send, parsing, validation, tokenization, the SSE write and its read).
For 1P1D, each handoff step's share of the request (HANDOFF_STEPS' histograms) is kept too.
"""

import argparse
import json
import os
import re
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_disagg_vs_colocated import EMBEDDED_VOCAB, NodeSpec, System, systems

PREFILL_LINE = re.compile(r"prefill (\S+): (\d+) prompt tokens \((\d+) cached\), ([\d.]+) KiB KV .* in ([\d.]+)s")


# One client for every request, as a user's (the openai SDK's) is: making an httpx.Client builds an
# SSL context, about 22 ms of CPU, which a TTFT timed around httpx.stream() counted every time.
CLIENT = httpx.Client(timeout=600.0)


def one_token_request(prompt: list[int]) -> dict:
    # One token: its event is the first (a token whose text is an incomplete character sends none
    # until the next, so the first event of a longer stream may come a step late).
    return {"prompt": prompt, "max_tokens": 1, "ignore_eos": True, "temperature": 0, "stream": True}


def ttft_of(url: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    with CLIENT.stream("POST", f"{url}/v1/completions", json=one_token_request(prompt)) as response:
        response.raise_for_status()
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']}")
                if event.get("choices"):
                    ttft = time.perf_counter() - start
                    for _ in lines:  # drain
                        pass
                    return ttft
    raise RuntimeError("no content in the stream")


# One keep-alive connection per node for ttft_raw.
RAW_SOCKETS: dict[str, socket.socket] = {}


def ttft_raw(url: str, prompt: list[int]) -> float:
    """ttft_of's request through a bare HTTP/1.1 socket: the time to the first event's bytes, with none of
    a client library's own work (httpx's parsing and wake-ups: about 1 ms a first token on a CPU core),
    so that what it times beyond the engine is the node's."""
    host, port = url.removeprefix("http://").split(":")
    sock = RAW_SOCKETS.get(url)
    if sock is None:
        sock = RAW_SOCKETS[url] = socket.create_connection((host, int(port)), timeout=600)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = json.dumps(one_token_request(prompt)).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    start = time.perf_counter()
    sock.sendall(request)
    got, ttft = b"", None
    while not got.endswith(b"0\r\n\r\n"):  # the chunked stream's end; [DONE] comes before it
        data = sock.recv(65536)
        if not data:
            raise RuntimeError("the node closed the connection")
        got += data
        if ttft is None and b'"choices":[{' in got:
            ttft = time.perf_counter() - start
    if not got.startswith(b"HTTP/1.1 200") or ttft is None:
        raise RuntimeError(f"no first token in the answer: {got[:300]!r}")
    return ttft


# Histograms read around each request: the colocated node's engine and API times, the pair's handoff steps.
COLOCATED_TIMES = ["request_queue_time", "request_prefill_time", "time_to_first_token"]
DECODE_STEPS = ["time_to_first_token", "remote_prefill_call", "kv_lookup_wait", "kv_entry_receive", "kv_load",
                "first_token_delay", "request_queue_time", "request_prefill_time"]
PREFILL_STEPS = ["prefill_compute", "kv_buffer_insert", "first_token_send", "request_queue_time",
                 "request_prefill_time"]


def scrape(url: str, names: list[str]) -> dict[str, float]:
    """The _sum of each disagg_<name>_seconds histogram on one node's /metrics."""
    text = CLIENT.get(f"{url}/metrics").text
    sums = {}
    for line in text.splitlines():
        if line.startswith("disagg_") and "_seconds_sum " in line:
            sums[line[len("disagg_"):line.index("_seconds_sum ")]] = float(line.split()[1])
    return {name: sums.get(name, 0.0) for name in names}


def deltas(before: dict[str, float], after: dict[str, float], prefix: str = "") -> dict[str, float]:
    return {prefix + name: after[name] - before[name] for name in after}


def last_prefill(system: System) -> tuple[float, float]:
    """(prefill seconds, KiB of KV) from the prefill node's newest log line."""
    matches = PREFILL_LINE.findall(system.prefill.log())
    if not matches:
        raise RuntimeError(f"no 'prefill ... in Xs' line in {system.prefill.log_path}")
    _, _, cached, kib, seconds = matches[-1]
    if int(cached):
        raise RuntimeError(f"the prompt hit the prefix cache ({cached} tokens): prompts must be fresh")
    return float(seconds), float(kib)


def measure(sys_by_name: dict[str, System], lens: list[int], repeats: int, vocab: int, seed: int = 0,
            raw_client: bool = False) -> dict:
    """raw_client: each colocated request is followed by one through ttft_raw (colocated_fixed_raw_client)."""
    import random

    rng = random.Random(seed)
    rows: dict[int, dict[str, list[float]]] = {n: {} for n in lens}
    step = 0
    for repeat in range(repeats):
        for n in lens:
            order = ["colocated", "disagg"] if step % 2 == 0 else ["disagg", "colocated"]
            step += 1
            for name in order:
                system = sys_by_name[name]
                prompt = [rng.randrange(1000, vocab) for _ in range(n)]
                rec = rows[n]
                if name == "disagg":
                    before = system.front.metric_sum("disagg_kv_transfer_seconds_sum")
                    count = system.front.metric_sum("disagg_kv_transfer_seconds_count")
                    steps = scrape(system.front.url, DECODE_STEPS), scrape(system.prefill.url, PREFILL_STEPS)
                else:
                    times = scrape(system.front.url, COLOCATED_TIMES)
                ttft = ttft_of(system.front.url, prompt)
                rec.setdefault(f"ttft_{name}", []).append(ttft)
                time.sleep(0.2)  # histograms are observed as requests finish; the prefill node logs after answering
                if name == "colocated":
                    d = deltas(times, scrape(system.front.url, COLOCATED_TIMES))
                    engine = d["request_queue_time"] + d["request_prefill_time"]
                    for key, value in {"engine": engine, "fixed": ttft - engine,
                                       "api": d["time_to_first_token"] - engine,
                                       "http": ttft - d["time_to_first_token"]}.items():
                        rec.setdefault(f"colocated_{key}", []).append(value)
                    if raw_client:  # the same again through a bare socket: the node's share of *fixed*
                        times = scrape(system.front.url, COLOCATED_TIMES)
                        raw = ttft_raw(system.front.url, [rng.randrange(1000, vocab) for _ in range(n)])
                        time.sleep(0.2)
                        d = deltas(times, scrape(system.front.url, COLOCATED_TIMES))
                        engine = d["request_queue_time"] + d["request_prefill_time"]
                        rec.setdefault("colocated_fixed_raw_client", []).append(raw - engine)
                if name == "disagg":
                    for key, value in {**deltas(steps[0], scrape(system.front.url, DECODE_STEPS), "decode_"),
                                       **deltas(steps[1], scrape(system.prefill.url, PREFILL_STEPS), "prefill_")
                                       }.items():
                        rec.setdefault(key, []).append(value)
                    transfer = system.front.metric_sum("disagg_kv_transfer_seconds_sum") - before
                    if system.front.metric_sum("disagg_kv_transfer_seconds_count") != count + 1:
                        raise RuntimeError("the KV did not come from the prefill node (recomputed?): "
                                           "see the decode node's log")
                    prefill, kib = last_prefill(system)
                    rec.setdefault("prefill", []).append(prefill)
                    rec.setdefault("kv_transfer", []).append(transfer)
                    rec.setdefault("kv_mib", []).append(kib / 1024)
            print(f"  repeat {repeat} len {n}: colocated {rec['ttft_colocated'][-1] * 1000:.0f} ms, "
                  f"disagg {rec['ttft_disagg'][-1] * 1000:.0f} ms (prefill {rec['prefill'][-1] * 1000:.0f}, "
                  f"kv_transfer {rec['kv_transfer'][-1] * 1000:.0f}) load {os.getloadavg()[0]:.1f}", flush=True)
    out = {}
    for n, rec in rows.items():
        med = {k: statistics.median(v) for k, v in rec.items()}
        # Per-request differences first, then medians (both systems' requests of a repeat ran side by side).
        overhead = [d - c for d, c in zip(rec["ttft_disagg"], rec["ttft_colocated"])]
        transfer_load = [t - p for t, p in zip(rec["kv_transfer"], rec["prefill"])]
        rest = [d - t for d, t in zip(rec["ttft_disagg"], rec["kv_transfer"])]
        out[n] = {**med, "overhead": statistics.median(overhead), "transfer_load": statistics.median(transfer_load),
                  "rest": statistics.median(rest), "samples": rec}
    return out


def table(results: dict) -> str:
    lines = [("| prompt tokens | KV MiB | TTFT colocated ms | TTFT disagg ms | overhead ms | prefill (P node) ms | "
             "transfer+load ms | rest ms |"), "|---|---|---|---|---|---|---|---|"]
    for n, r in results.items():
        lines.append(f"| {n} | {r['kv_mib']:.1f} | {r['ttft_colocated'] * 1000:.0f} | "
                     f"{r['ttft_disagg'] * 1000:.0f} | {r['overhead'] * 1000:+.0f} | {r['prefill'] * 1000:.0f} | "
                     f"{r['transfer_load'] * 1000:.1f} | {r['rest'] * 1000:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", default="128,512,1024,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cores", default="0,1", help="prefill and colocated on the first, decode on the second")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--connector", default="tcp")
    ap.add_argument("--model", default=None)
    ap.add_argument("--vocab-size", type=int, default=EMBEDDED_VOCAB)
    ap.add_argument("--log-dir", default="/tmp/disagg-handoff-logs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    first, second = args.cores.split(",")
    start = time.time()
    same_core = NodeSpec(cpus=first, threads=args.threads)
    with systems(Path(args.log_dir), same_core, same_core, NodeSpec(cpus=second, threads=args.threads),
                 model=args.model, connector=args.connector,
                 kv_extra={"remote_prefill": "always"}) as sys_by_name:  # the handoff is what is measured
        measure(sys_by_name, [64], 1, args.vocab_size, seed=999)  # warm-up
        results = measure(sys_by_name, lens, args.repeats, args.vocab_size)
    print(f"\n{time.time() - start:.0f}s")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
