"""`disagg bench serve`: an open-loop load generator for OpenAI-compatible servers.

Requests arrive as a Poisson process at a given rate (or all at once for `inf`), each one
streamed, so the client clock gives every request's TTFT (send -> first content chunk), ITL
(every gap between content chunks), E2E (send -> last byte) and TPOT = (E2E - TTFT) /
(output tokens - 1). Output tokens come from the stream's final usage chunk
(`stream_options.include_usage`) when the server sends one, else from the number of content
chunks. `ignore_eos` is sent so every request generates the asked length.

Prompts: the served model's tokenizer is not assumed to be at hand, so by default a prompt is
N random common English words (about one token each for BPE tokenizers; the server's usage
reports the true count, saved per request). `--prompt-kind token-ids` sends N random token ids
instead (exact lengths, completions endpoint only). `--prompts-file` takes JSONL.

`--workload shared-prefix` sends conversations instead of single requests: each opens with one of
`--num-prefixes` random prefixes of `--prefix-len` tokens (conversation i takes prefix i mod N, in a
shuffled order), and each of its `--turns` turns adds `--input-len` new tokens to the previous
turn's prompt (earlier answers are not included, so a turn's prompt extends the one before
whatever the model said; a chat turn is one user message). Conversations arrive at the asked rate;
a conversation's next turn is sent when its answer is in. Every run reads the servers'
prefix-cache counters (`vllm:prefix_cache_hits_total`, `vllm:prefix_cache_queries_total`: prompt
tokens served from the cache, prompt tokens asked; vLLM's names, which our nodes serve too) from
`--metrics-url` (default: the base URL's /metrics) before and after, and reports the hit rate of
the run's prompt tokens, summed over those servers. A router exports none: name its nodes.
"""

import argparse
import asyncio
import itertools
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import httpx
from prometheus_client.parser import text_string_to_metric_families

WORDS = [
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his",
    "her", "this", "which", "have", "are", "be", "not", "or", "had", "it", "but", "one", "all", "were",
    "they", "an", "their", "there", "been", "has", "when", "who", "will", "more", "no", "if", "out", "so",
    "said", "what", "up", "its", "about", "into", "than", "them", "can", "only", "other", "new", "some",
    "could", "time", "these", "two", "may", "then", "do", "first", "any", "my", "now", "such", "like", "our",
    "over", "man", "me", "even", "most", "made", "after", "also", "did", "many", "before", "must", "through",
    "back", "years", "where", "much", "your", "way", "well", "down", "should", "because", "each", "just",
    "those", "people", "how", "too", "little", "state", "good", "very", "make", "world", "still", "own",
    "see", "men", "work", "long", "get", "here", "between", "both", "life", "being", "under", "never", "day",
    "same", "another", "know", "while", "last", "might", "us", "great", "old", "year", "off", "come", "since",
    "against", "go", "came", "right", "used", "take", "three",
]

METRICS = ("ttft", "tpot", "itl", "e2e")
READ_BUFFER = 1 << 20  # aiohttp's read buffer: a server-sent event line may be twice this (its default: 64 KiB)
PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


@dataclass
class RequestSpec:
    prompt: str | list[int] | None  # completions
    messages: list[dict] | None  # chat
    input_len: int  # asked (approximate for words)
    output_len: int


@dataclass
class RequestResult:
    ok: bool
    input_len: int
    output_len: int  # asked
    prompt_tokens: int | None = None  # from the server's usage
    output_tokens: int = 0
    ttft: float | None = None  # seconds
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # seconds since the run began
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class SLO:
    ttft: float | None = None  # milliseconds
    tpot: float | None = None
    e2e: float | None = None

    def met(self, r: RequestResult) -> bool:
        for name in ("ttft", "tpot", "e2e"):
            limit = getattr(self, name)
            value = getattr(r, name)
            if limit is not None and (value is None or value * 1000 > limit):
                return False
        return r.ok

    @classmethod
    def parse(cls, items: list[str]) -> "SLO":
        slo = cls()
        for item in items:
            name, _, ms = item.partition(":")
            if name not in ("ttft", "tpot", "e2e") or not ms:
                raise ValueError(f"--goodput takes METRIC:MS with METRIC ttft, tpot or e2e, got {item!r}")
            setattr(slo, name, float(ms))
        return slo


def parse_rates(qps: str, sweep: str | None) -> list[float]:
    text = sweep if sweep else qps
    rates = []
    for part in text.split(","):
        rate = float(part.strip())  # float("inf") works
        if rate <= 0:
            raise ValueError(f"a request rate must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    return rates


def sample_len(rng: random.Random, mean: int, dist: str, width: float) -> int:
    if dist == "fixed":
        return mean
    if dist == "lognormal":
        return min(4 * mean, max(1, round(rng.lognormvariate(math.log(mean), width))))
    low, high = max(1, round(mean * (1 - width))), max(1, round(mean * (1 + width)))
    return rng.randint(low, high)


def build_requests(args: argparse.Namespace, rng: random.Random) -> list[RequestSpec]:
    if args.prompts_file:
        lines = [json.loads(line) for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"{args.prompts_file} holds no requests")
        specs = []
        for i in range(args.num_requests):
            item = lines[i % len(lines)]
            out_len = int(item.get("max_tokens", sample_len(rng, args.output_len, args.len_dist, args.len_range)))
            if "messages" in item:
                specs.append(RequestSpec(None, item["messages"], 0, out_len))
            elif "prompt" in item:
                prompt = item["prompt"]
                specs.append(RequestSpec(prompt, None, len(prompt) if isinstance(prompt, list) else 0, out_len))
            else:
                raise ValueError(f"{args.prompts_file} line {i % len(lines) + 1}: needs 'prompt' or 'messages'")
        return specs
    if args.prompt_kind == "token-ids" and args.endpoint == "chat":
        raise ValueError("--prompt-kind token-ids needs --endpoint completions (chat messages are text)")
    specs = []
    for _ in range(args.num_requests):
        in_len = sample_len(rng, args.input_len, args.len_dist, args.len_range)
        out_len = sample_len(rng, args.output_len, args.len_dist, args.len_range)
        if args.prompt_kind == "token-ids":
            # Avoid the lowest ids (special tokens in most vocabularies).
            prompt = [rng.randrange(1000, args.vocab_size) for _ in range(in_len)]
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(in_len))
        if args.endpoint == "chat":
            specs.append(RequestSpec(None, [{"role": "user", "content": prompt}], in_len, out_len))
        else:
            specs.append(RequestSpec(prompt, None, in_len, out_len))
    return specs


def build_conversations(args: argparse.Namespace, rng: random.Random) -> list[list[RequestSpec]]:
    """The run's requests as conversations, each a list of turns sent one after another (under the
    random workload, one request each)."""
    if args.workload == "random":
        return [[spec] for spec in build_requests(args, rng)]
    if args.prompts_file:
        raise ValueError("--workload shared-prefix makes its own prompts; it does not take --prompts-file")
    if args.prompt_kind == "token-ids" and args.endpoint == "chat":
        raise ValueError("--prompt-kind token-ids needs --endpoint completions (chat messages are text)")
    for name in ("num_prefixes", "prefix_len", "turns", "num_requests"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")

    def tokens(n: int) -> list:
        if args.prompt_kind == "token-ids":
            return [rng.randrange(1000, args.vocab_size) for _ in range(n)]  # above most special tokens
        return [rng.choice(WORDS) for _ in range(n)]

    prefixes = [tokens(args.prefix_len) for _ in range(args.num_prefixes)]
    num_conversations = math.ceil(args.num_requests / args.turns)
    order = list(range(num_conversations))
    rng.shuffle(order)
    conversations, left = [], args.num_requests
    for c in order:
        prompt, turns = list(prefixes[c % args.num_prefixes]), []
        for _ in range(min(args.turns, left)):
            prompt += tokens(sample_len(rng, args.input_len, args.len_dist, args.len_range))
            out_len = sample_len(rng, args.output_len, args.len_dist, args.len_range)
            text = list(prompt) if args.prompt_kind == "token-ids" else " ".join(prompt)
            if args.endpoint == "chat":
                turns.append(RequestSpec(None, [{"role": "user", "content": text}], len(prompt), out_len))
            else:
                turns.append(RequestSpec(text, None, len(prompt), out_len))
        left -= len(turns)
        conversations.append(turns)
    return conversations


def prefix_cache_counters(urls: list[str], headers: dict[str, str]) -> dict[str, dict[str, float] | None]:
    """{url: {"hits", "queries"}} (each summed over its label sets), None for a URL that cannot be
    read or serves neither counter (a router, a server without /metrics): the benchmark goes on, and
    its summary names the URL."""
    counters = {}
    for url in urls:
        try:
            response = httpx.get(url, headers=headers, timeout=30)
            response.raise_for_status()
            samples = [s for family in text_string_to_metric_families(response.text) for s in family.samples]
        except (httpx.HTTPError, ValueError):
            counters[url] = None
            continue
        names = {s.name for s in samples}
        counters[url] = None if not {PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES} <= names else {
            "hits": sum(s.value for s in samples if s.name == PREFIX_CACHE_HITS),
            "queries": sum(s.value for s in samples if s.name == PREFIX_CACHE_QUERIES)}
    return counters


def prefix_cache_delta(before: dict, after: dict) -> dict:
    """The run's prefix-cache hits and queries (prompt tokens) over the servers that count them."""
    counted = [url for url in before if before[url] is not None and after[url] is not None]
    hits = sum(after[url]["hits"] - before[url]["hits"] for url in counted)
    queries = sum(after[url]["queries"] - before[url]["queries"] for url in counted)
    return {"hit_rate": hits / queries if queries else None, "hits": hits, "queries": queries,
            "metrics_urls": counted, "without_counters": [url for url in before if url not in counted]}


def request_body(spec: RequestSpec, args: argparse.Namespace, model: str) -> dict:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "temperature": args.temperature, "max_tokens": spec.output_len}
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if spec.messages is not None:
        body["messages"] = spec.messages
    else:
        body["prompt"] = spec.prompt
    return body


async def send(client: aiohttp.ClientSession, url: str, body: dict, spec: RequestSpec,
               run_start: float) -> RequestResult:
    result = RequestResult(ok=False, input_len=spec.input_len, output_len=spec.output_len)
    start = time.perf_counter()
    result.start = start - run_start
    last = start
    chunks = 0
    usage_tokens = None
    try:
        async with client.post(url, json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {text[:300]}"
                return result
            async for line in response.content:  # one line at a time, its b"\n" included
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    return result
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                    result.prompt_tokens = event["usage"].get("prompt_tokens")
                choices = event.get("choices") or []
                if not choices:
                    continue
                choice = choices[0]
                text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                if text:
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
        result.e2e = time.perf_counter() - start
        result.output_tokens = usage_tokens if usage_tokens is not None else chunks
        result.ok = result.ttft is not None
        if not result.ok:
            result.error = "the stream ended without any content"
    # HttpProcessingError: a line over 2 x READ_BUFFER, or the stream's framing broken; ValueError: a bad event.
    except (aiohttp.ClientError, aiohttp.http_exceptions.HttpProcessingError, TimeoutError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration: float, slo: SLO) -> dict:
    ok = [r for r in results if r.ok]
    summary = {"num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
               "duration_s": duration,
               "request_throughput": len(ok) / duration if duration > 0 else None,
               "output_throughput": sum(r.output_tokens for r in ok) / duration if duration > 0 else None,
               "total_input_tokens": sum(r.prompt_tokens or r.input_len for r in ok),
               "total_output_tokens": sum(r.output_tokens for r in ok)}
    values = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [gap for r in ok for gap in r.itl], "e2e": [r.e2e for r in ok]}
    for name in METRICS:
        xs = [v * 1000 for v in values[name]]
        summary[f"mean_{name}_ms"] = sum(xs) / len(xs) if xs else None
        summary[f"median_{name}_ms"] = percentile(xs, 50)
        summary[f"p99_{name}_ms"] = percentile(xs, 99)
    if any(v is not None for v in (slo.ttft, slo.tpot, slo.e2e)):
        good = sum(slo.met(r) for r in results)
        summary["goodput"] = good / duration if duration > 0 else None
        summary["goodput_fraction"] = good / len(results) if results else None
        summary["slo_ms"] = {k: v for k, v in asdict(slo).items() if v is not None}
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["errors"] = errors[:5]
    return summary


def arrival_offsets(n: int, rate: float, burstiness: float, rng: random.Random, exact: bool = False) -> list[float]:
    """Seconds from the run's start at which each of n requests is sent: the first at once, then gaps
    of mean 1/rate, exponential (Poisson arrivals) at burstiness 1, else gamma of that shape (vLLM's
    --burstiness); all at once for an infinite rate. exact: the gaps scaled to span (n - 1) / rate, so
    that the run's rate is the one asked for (the same arrivals, conditioned on that span: a short run
    no longer lands 15% off its rate by chance)."""
    gaps = [0.0] * max(n - 1, 0)
    if math.isfinite(rate):
        gaps = [rng.expovariate(rate) if burstiness == 1 else rng.gammavariate(burstiness, 1 / (rate * burstiness))
                for _ in gaps]
        total = sum(gaps)
        if exact and total > 0:
            gaps = [g * (len(gaps) / rate) / total for g in gaps]
    return list(itertools.accumulate(gaps, initial=0.0))[:n]


async def run_rate(args: argparse.Namespace, rate: float, conversations: list[list[RequestSpec]], model: str,
                   slo: SLO, rng: random.Random) -> tuple[dict, list[RequestResult]]:
    url = f"{args.base_url.rstrip('/')}/v1/{'chat/completions' if args.endpoint == 'chat' else 'completions'}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    progress = None
    if not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=sum(map(len, conversations)), desc=f"qps {rate}", unit="req", leave=False)

    offsets = arrival_offsets(len(conversations), rate, args.burstiness, rng, args.exact_rate)
    # aiohttp rather than httpx (which reads the metrics and the model): the client stamps every token
    # of every stream on one event loop, and a loop busy parsing delays the stamps it measures.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=args.timeout, sock_read=args.timeout)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, read_bufsize=READ_BUFFER,
                                     connector=aiohttp.TCPConnector(limit=0)) as client:
        run_start = time.perf_counter()

        async def one(spec: RequestSpec) -> RequestResult:
            body = request_body(spec, args, model)
            if semaphore is None:
                result = await send(client, url, body, spec, run_start)
            else:
                async with semaphore:
                    result = await send(client, url, body, spec, run_start)
            if progress is not None:
                progress.update(1)
            return result

        async def converse(turns: list[RequestSpec]) -> list[RequestResult]:
            return [await one(spec) for spec in turns]  # each turn once the answer before it is in

        tasks = []
        for turns, at in zip(conversations, offsets):
            # Until its time from the start: sleeping each gap in turn would add every wake-up's lateness.
            await asyncio.sleep(max(0.0, run_start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(converse(turns)))
        results = [result for turns in await asyncio.gather(*tasks) for result in turns]
        duration = time.perf_counter() - run_start
    if progress is not None:
        progress.close()
    summary = {"qps": rate if math.isfinite(rate) else "inf", **summarize(results, duration, slo),
               "arrival_rate": (len(offsets) - 1) / offsets[-1] if len(offsets) > 1 and offsets[-1] > 0 else None}
    return summary, results


def served_model(base_url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{base_url.rstrip('/')}/v1/models"
    try:
        response = httpx.get(url, headers=headers, timeout=30)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(f"could not read the served model from {url} ({type(e).__name__}: {e}); "
                           "check --base-url and that the server is up, or pass --model") from e


def run_benchmark(args: argparse.Namespace) -> dict:
    """Every rate of --qps / --qps-sweep in turn; the JSON that --save-json writes."""
    rates = parse_rates(args.qps, args.qps_sweep)
    if args.burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    slo = SLO.parse(args.goodput)
    model = args.model or served_model(args.base_url, args.api_key)
    config = {k: v for k, v in vars(args).items() if k not in ("func",) and not callable(v)}
    config["model"] = model
    out = {"label": args.label or args.base_url, "model": model, "endpoint": args.endpoint, "config": config,
           "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "runs": []}
    metrics_urls = args.metrics_url or [f"{args.base_url.rstrip('/')}/metrics"]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    for index, rate in enumerate(rates):
        rng = random.Random(args.seed + index)
        conversations = build_conversations(args, rng)
        before = prefix_cache_counters(metrics_urls, headers)
        summary, results = asyncio.run(run_rate(args, rate, conversations, model, slo, rng))
        summary["prefix_cache"] = prefix_cache_delta(before, prefix_cache_counters(metrics_urls, headers))
        out["runs"].append({**summary, "requests": [{**asdict(r), "tpot": r.tpot} for r in results]})
        print(format_summary(summary), flush=True)
    return out


def format_summary(s: dict) -> str:
    def ms(name: str) -> str:
        values = [s[f"{k}_{name}_ms"] for k in ("mean", "median", "p99")]
        return "/".join("-" if v is None else f"{v:.1f}" for v in values)

    line = (f"qps {s['qps']}: {s['completed']}/{s['num_requests']} ok in {s['duration_s']:.1f}s, "
            f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} out tok/s | "
            f"mean/median/p99 ms: TTFT {ms('ttft')}  TPOT {ms('tpot')}  ITL {ms('itl')}  E2E {ms('e2e')}")
    cache = s.get("prefix_cache")
    if cache is not None:
        rate = "-" if cache["hit_rate"] is None else f"{cache['hit_rate']:.3f}"
        line += f" | prefix cache hit rate {rate} ({cache['hits']:.0f}/{cache['queries']:.0f} prompt tokens)"
        if cache["without_counters"]:
            line += f" (no prefix-cache counters at {', '.join(cache['without_counters'])})"
    if "goodput" in s:
        line += f" | goodput {s['goodput']:.2f} req/s ({100 * s['goodput_fraction']:.0f}% within SLO)"
    if s.get("errors"):
        line += f"\n  errors: {s['errors']}"
    return line


def main(args: argparse.Namespace) -> None:
    out = run_benchmark(args)
    if args.save_json:
        Path(args.save_json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.save_json}")
    if args.plot:
        from disagg.bench.plot import plot_results

        plot_results([out], args.plot)
        print(f"wrote {args.plot}")
    failed = sum(run["failed"] for run in out["runs"])
    if failed:
        raise RuntimeError(f"{failed} request(s) failed; first errors: "
                           f"{[e for run in out['runs'] for e in run.get('errors', [])][:3]}")
