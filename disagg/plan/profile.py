"""`disagg plan profile`: what this hardware takes for the steps a plan simulates, saved as a small
JSON file (`Profile`) so that a plan can be made anywhere.

Steps are timed on the engine itself (`LLMEngine.step`, as `LLM.generate` drives it), so a profile's
times include what a served step pays beside the forward (scheduling, sampling):
- prefill: one step that computes a whole prompt of N tokens (its first token sampled), per N;
- decode: one step of B sequences whose prompts held L tokens each, per B and L (with
  --async-scheduling, the interval between steps that go ahead, as such a node's decode steps do);
- link: one request's KV sent over the configured pipe and acknowledged, for a short and a long
  prompt, giving a fixed cost per transfer and a bandwidth (in a second process, as between nodes);
- serving: a colocated `disagg serve` of the model, one request at a time, then SERVING_BATCH at once:
  what its TTFT and decode steps take beyond the offline ones (HTTP, the engine thread's hand-offs, and each
  streamed token: the event loop's work beside the engine thread; `--no-serving` skips it).
Prompts are random token ids, the prefix cache off: nothing is reused between timings."""

import argparse
import json
import logging
import multiprocessing as mp
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch  # imported when profiling: reading a profile needs no torch

logger = logging.getLogger(__name__)

# Grids: short on the CPU (the embedded model profiles in seconds), a GPU's serving sizes otherwise. A GPU
# decode step is a staircase in the batch (a CUDA graph pads it to its bucket: engine/cuda_graphs.py), so
# without --decode-batch a GPU's batches are each of the engine's buckets up to the grid's largest batch,
# and the batch after each (an 8B model on an H200: 1-5, 8-10, 16-19, 32, 33, 37, 38, 64; graph_edges).
# A GPU step of a few prompt tokens costs its graphs' floor (engine/prefill_graphs.py: 5.5 ms at 64 tokens
# on an H200 against 7.7 at 256), which a line through 256 and 1,024 tokens would put at 3: hence 64.
CPU_GRID = {"prefill_tokens": "32,128,512", "decode_batch": "1,4,8", "decode_context": "32,128"}
GPU_GRID = {"prefill_tokens": "64,256,1024,4096,8192", "decode_batch": "1,8,32,64", "decode_context": "1024,4096"}
LINK_TOKENS = {"cpu": (16, 2048), "cuda": (16, 8192)}  # a short and a long prompt's KV
REPEATS = 3
# A decode sample's timed steps. Two GPU profiles of the same engine with 3 were 0.07 ms apart at the median
# sample and up to 0.31 (of 4.4-13 ms); the serving term (Serving.step_extra_s), a served step less the batch-1
# sample, came out 0.166 and 0.001 ms, their batch-1 samples 0.22 ms apart. With 16, four profiles on one H200 had
# their batch-1 samples within 0.05 ms and a serving term of 0.007-0.055 ms.
DECODE_REPEATS = 16
# Steps before them: a batch's first steps after its prompts run 1-5% slower at 8-32 sequences on an H200 than
# steps 18-50 (benchmarks/decode_warmup.py), which a long answer's TPOT is made of.
DECODE_WARMUP = 16


@dataclass
class PrefillSample:
    tokens: int  # prompt tokens computed in the step
    seconds: float


@dataclass
class DecodeSample:
    batch: int  # sequences, one token each
    context: int  # tokens each sequence holds
    seconds: float


@dataclass
class Link:
    connector: str
    latency_s: float  # a transfer's fixed cost: a short prompt's KV sent and acknowledged
    bytes_per_s: float  # beyond it

    def transfer_seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass
class Serving:
    """What a served node (`disagg serve`, one request at a time) takes beyond the engine's own steps:
    the HTTP, the streaming, the engine thread's hand-offs. Zero when not measured."""
    ttft_extra_s: float = 0.0  # served TTFT less the offline prefill step of the same prompt
    step_extra_s: float = 0.0  # a served decode step (profile.step_gap) less the offline one at batch 1
    # What each further sequence decoding adds to a served step (its token streamed): the served step of
    # SERVING_BATCH requests at once less the offline step of that batch, beyond step_extra_s, per
    # sequence past the first.
    step_extra_per_seq_s: float = 0.0


@dataclass
class Profile:
    model: str
    device: str  # "cpu" or the GPU's name
    dtype: str
    kv_bytes_per_token: int
    threads: int  # the CPU threads torch used
    prefill: list[PrefillSample]
    decode: list[DecodeSample]
    link: Link
    serving: Serving = field(default_factory=Serving)
    async_scheduling: bool = False  # steps timed as nodes serving with --async-scheduling take them
    # MODEL as `disagg up` takes it (a Hub id, a directory or .gguf file made absolute; "" the embedded
    # model); None in a profile written before it was recorded.
    model_source: str | None = None
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        d = json.loads(text)
        try:
            return cls(**d | {"prefill": [PrefillSample(**s) for s in d["prefill"]],
                              "decode": [DecodeSample(**s) for s in d["decode"]], "link": Link(**d["link"]),
                              "serving": Serving(**d.get("serving", {}))})
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a profile written by `disagg plan profile`: {e}") from None

    @classmethod
    def load(cls, path: str) -> "Profile":
        try:
            return cls.from_json(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--profile {path}: {e}") from None


def parse_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} takes integers >= 1, got {text!r}")
    return sorted(set(values))


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, vocab) for _ in range(n)]  # above the lowest ids, special tokens in most vocabularies


def time_prefill(engine, tokens: list[int], rng: random.Random) -> list[PrefillSample]:
    from disagg.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    samples = []
    for n in [tokens[0]] + tokens:  # the first: warm-up
        times = []
        for i in range(REPEATS):
            engine.add_request(f"prefill-{n}-{i}-{len(samples)}", random_prompt(rng, n, vocab), params)
            start = time.perf_counter()
            while engine.has_unfinished_requests():  # one step: the budget holds the prompt
                engine.step()
            times.append(time.perf_counter() - start)
        samples.append(PrefillSample(n, statistics.median(times)))
    return samples[1:]


def graph_edges(buckets: list[int]) -> list[int]:
    """Each CUDA graph bucket and the batch after it, up to the largest: where a decode step's staircase
    rises (a batch runs padded to its bucket), and where it is flat until the next."""
    return sorted({b for size in buckets for b in (size, size + 1) if b <= buckets[-1]})


def decode_tokens(batch: int, context: int, budget: int) -> int:
    """A decode timing's max_tokens: more than the steps that start its prompts (each running sequence
    decodes in every one of them, taking a token of the budget: the k-th prompt gets budget - k a step),
    the warm-up and the timed steps, so that none finishes before it is timed."""
    return sum(-(-context // max(budget - k, 1)) for k in range(batch)) + DECODE_WARMUP + DECODE_REPEATS + 8


def time_decode(engine, batches: list[int], contexts: list[int], rng: random.Random) -> list[DecodeSample]:
    from disagg.engine.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    budget = engine.config.max_num_batched_tokens
    samples = []
    grid = [(b, length) for b in batches for length in contexts]
    for b, length in grid[:1] + grid:  # the first: warm-up, as the prefill samples' (it is not kept)
        params = SamplingParams(temperature=0.0, max_tokens=decode_tokens(b, length, budget), ignore_eos=True)
        ids = [f"decode-{b}-{length}-{len(samples)}-{i}" for i in range(b)]
        for request_id in ids:
            engine.add_request(request_id, random_prompt(rng, length, vocab), params)
        started: set[str] = set()
        while len(started) < b:  # the prompts, in as many steps as the budget needs
            started |= {out.request_id for out in engine.step()}
        for _ in range(DECODE_WARMUP):  # with async scheduling the first also puts a step in flight
            engine.step()
        times = []
        for _ in range(DECODE_REPEATS):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        if len(engine.scheduler.running) != b:
            raise RuntimeError(f"decode batch {b} context {length}: {len(engine.scheduler.running)} sequences "
                               "ran in the timed steps")
        for request_id in ids:
            engine.abort_request(request_id)
        samples.append(DecodeSample(b, length, statistics.median(times)))
        logger.info("decode batch %d context %d: %.2f ms", b, length, 1e3 * samples[-1].seconds)
    return samples[1:]


def link_devices(engine_device: "torch.device") -> tuple[str, str]:
    """Sender and receiver devices: two GPUs if present (KV between GPUs), else the CPU. The receiver
    is this process, on its engine's GPU; the sender the next GPU."""
    import torch

    if engine_device.type == "cuda" and torch.cuda.device_count() >= 2:
        index = engine_device.index or 0
        return f"cuda:{(index + 1) % torch.cuda.device_count()}", f"cuda:{index}"
    return "cpu", "cpu"


def send_kv(connector: str, address: tuple[str, int], sizes: list[int], device: str) -> None:
    """The sender process: each size's message REPEATS + 1 times, each acknowledged before the next."""
    import torch

    from disagg import pipes
    from disagg.pipes import PipeConfig

    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    link = pipes.connect(connector, PipeConfig(timeout=120), *address)
    for nbytes in sizes:
        message = [torch.ones(nbytes, dtype=torch.uint8, device=device)]
        for _ in range(REPEATS + 1):
            link.send(message)
            link.recv()
    link.close()


def time_link(connector: str, kv_bytes_per_token: int, engine_device: "torch.device") -> Link:
    """The pipe between two processes: a short and a long prompt's KV, sent and acknowledged."""
    import torch

    from disagg import pipes
    from disagg.pipes import PipeConfig

    sizes = [n * kv_bytes_per_token for n in LINK_TOKENS["cuda" if engine_device.type == "cuda" else "cpu"]]
    send_device, recv_device = link_devices(engine_device)
    if recv_device.startswith("cuda"):
        torch.cuda.set_device(recv_device)  # NCCL places this rank on the current device
    server = pipes.listen(connector, PipeConfig(kv_port=0, timeout=120))
    sender = mp.get_context("spawn").Process(target=send_kv, args=(connector, server.address, sizes, send_device))
    sender.start()
    try:
        link = server.accept(timeout=120)
        seconds = []
        for nbytes in sizes:
            out = [torch.empty(nbytes, dtype=torch.uint8, device=recv_device)]
            times = []
            for _ in range(REPEATS + 1):
                start = time.perf_counter()
                link.recv(out=out)
                if recv_device.startswith("cuda"):
                    torch.cuda.synchronize(recv_device)
                times.append(time.perf_counter() - start)  # from the first byte waited for
                link.send(None)
            seconds.append(statistics.median(times[1:]))
        sender.join(timeout=60)
        link.close()
    finally:
        server.close()
        if sender.is_alive():
            sender.kill()
    latency = seconds[0]
    return Link(connector, latency, (sizes[1] - sizes[0]) / max(seconds[1] - seconds[0], 1e-9))


SERVING_OUTPUT, SERVING_REQUESTS = 16, 4
SERVING_BATCH, SERVING_BATCH_OUTPUT = 8, 64  # requests decoding together, and their tokens: decode steps dominate


def time_serving(args: argparse.Namespace, model: str, vocab: int, prefill: list[PrefillSample],
                 decode: list[DecodeSample]) -> Serving:
    """A colocated `disagg serve` of the same model on the same device: one request at a time, then
    the decode grid's batch nearest SERVING_BATCH at once; their TTFT and decode steps (step_gap)
    against the offline ones they are made of. Prompts hold the decode grid's shortest context, so
    that the offline decode steps they are set against are samples, not interpolations (the TTFT is
    set against the nearest prefill sample); the served node's step budget can take the batch's prompts in one step,
    so that no prompt's chunks are split among the timed decode steps."""
    import os
    import socket
    import subprocess
    import sys

    from disagg.launch import wait_healthy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompt = min(d.context for d in decode)
    batch = min({d.batch for d in decode}, key=lambda b: abs(b - SERVING_BATCH))
    argv = [sys.executable, "-m", "disagg.cli", "serve", model, "--kv-role", "both", "--port", str(port),
            "--max-model-len", str(prompt + SERVING_BATCH_OUTPUT + 16),
            "--max-num-batched-tokens", str(max(batch * prompt, 2048)), "--log-level", "WARNING"]
    flags = (("--device", args.device), ("--dtype", args.dtype), ("--kv-cache-memory", args.kv_cache_memory))
    for flag, value in flags:
        if value is not None:
            argv += [flag, str(value)]
    if args.async_scheduling:
        argv.append("--async-scheduling")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=os.environ)
    try:
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, 600)
        except RuntimeError as e:
            raise RuntimeError(f"the served node for --serving did not start: {e}") from None
        alone = served(port, vocab, prompt, 1, SERVING_REQUESTS + 1, SERVING_OUTPUT)[1:]  # the first: warm-up
        together = served(port, vocab, prompt, batch, batch, SERVING_BATCH_OUTPUT) if batch > 1 else []
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if not alone or (batch > 1 and not together):
        raise RuntimeError("the served node answered no request")
    ttft = statistics.median(r["ttft"] for r in alone)
    step = step_gap(alone)
    offline_ttft = min(prefill, key=lambda s: abs(s.tokens - prompt)).seconds

    def offline_step(b: int) -> float:
        return next(s for s in decode if s.batch == b and s.context == prompt).seconds

    step_extra = max(step - offline_step(min(d.batch for d in decode)), 0.0)
    per_seq = 0.0
    if together:
        per_seq = max(step_gap(together) - offline_step(batch) - step_extra, 0.0) / (batch - 1)
    return Serving(max(ttft - offline_ttft, 0.0), step_extra, per_seq)


def step_gap(requests: list[dict]) -> float:
    """A served decode step: the median over requests of each one's median gap between tokens. Not their
    TPOT: a batch's prompts may reach the node over more than one step, and a request already decoding
    then waits for the later prompts' step (a 4k prompt takes as long as ~20 decode steps of an 8B model),
    which the offline steps it is set against never do. With TPOT, one of four profiles of the same
    engine on an H200 gave a batch of 8 2 ms a step more than its offline step; the other three 0."""
    gaps = [statistics.median(r["itl"]) for r in requests if r["itl"]]
    if not gaps:
        raise RuntimeError("the served node streamed no request's tokens one by one: no decode step to time")
    return statistics.median(gaps)


def served(port: int, vocab: int, prompt: int, concurrency: int, num_requests: int, output_len: int) -> list[dict]:
    """`disagg bench serve` against the node: `num_requests` prompts of `prompt` tokens, `concurrency` at
    a time, prompts of their own (the seed: no prefix-cache hits on an earlier call's); the requests
    that were answered."""
    from disagg.bench import add_serve_args
    from disagg.bench.serve import run_benchmark

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    bench = parser.parse_args(["--base-url", f"http://127.0.0.1:{port}", "--no-progress", "--qps", "inf",
                               "--max-concurrency", str(concurrency), "--num-requests", str(num_requests),
                               "--input-len", str(prompt), "--output-len", str(output_len),
                               "--prompt-kind", "token-ids", "--vocab-size", str(vocab), "--seed", str(concurrency)])
    return [r for r in run_benchmark(bench)["runs"][0]["requests"] if r["ok"]]


def profile(args: argparse.Namespace) -> Profile:
    import torch

    from disagg.cli import local_model
    from disagg.engine.config import EngineConfig
    from disagg.engine.engine import LLMEngine

    grid = GPU_GRID if (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda") \
        else CPU_GRID
    tokens = parse_ints(args.prefill_tokens or grid["prefill_tokens"], "--prefill-tokens")
    batches = parse_ints(args.decode_batch or grid["decode_batch"], "--decode-batch")
    contexts = parse_ints(args.decode_context or grid["decode_context"], "--decode-context")
    budget = max(tokens + [max(batches)])
    decode_len = max(contexts) + decode_tokens(max(batches), max(contexts), budget)
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=local_model(args), device=args.device, dtype=args.dtype, enable_prefix_caching=False,
        max_num_seqs=max(batches), max_num_batched_tokens=budget, max_model_len=max(max(tokens) + 8, decode_len),
        kv_cache_memory=args.kv_cache_memory, async_scheduling=args.async_scheduling))
    mc = engine.model_config
    dtype = engine.dtype
    kv_bytes_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * dtype.itemsize
    capacity = engine.kv_cache.num_blocks * engine.config.block_size
    if max(batches) * decode_len > capacity:
        raise ValueError(f"the decode grid needs {max(batches)} x {decode_len} tokens of KV; the cache holds "
                         f"{capacity}: give --kv-cache-memory more, or lower --decode-batch / --decode-context")
    print(f"loaded {engine.model_dir.name} on {engine.device} in {time.perf_counter() - start:.1f}s", flush=True)
    graphs = getattr(engine.runner, "graphs", None)
    if not args.decode_batch and graphs is not None:  # the same largest batch: the checks above hold
        batches = graph_edges(graphs.buckets)
    rng = random.Random(0)
    prefill = time_prefill(engine, tokens, rng)
    print("prefill ms: " + ", ".join(f"{s.tokens} tok {1e3 * s.seconds:.1f}" for s in prefill), flush=True)
    decode = time_decode(engine, batches, contexts, rng)
    print("decode ms: " + ", ".join(f"b{s.batch} ctx{s.context} {1e3 * s.seconds:.1f}" for s in decode), flush=True)
    if args.link_gbps:
        link = Link(args.kv_connector, args.link_latency_ms / 1e3, args.link_gbps * 1e9)
    else:
        link = time_link(args.kv_connector, kv_bytes_per_token, engine.device)
    print(f"link {link.connector}: {1e3 * link.latency_s:.2f} ms + {link.bytes_per_s / 1e9:.2f} GB/s", flush=True)
    device = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
    model_dir, model_name = str(engine.model_dir), engine.model_dir.name
    serving = Serving()
    if args.serving:
        del engine  # its memory, for the served node's
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        serving = time_serving(args, model_dir, mc.vocab_size, prefill, decode)
        print(f"serving: TTFT +{1e3 * serving.ttft_extra_s:.1f} ms, each step +{1e3 * serving.step_extra_s:.2f} ms "
              f"and +{1e3 * serving.step_extra_per_seq_s:.3f} ms a sequence past the first, beyond the engine's",
              flush=True)
    return Profile(model=model_name, device=device, dtype=str(dtype).removeprefix("torch."),
                   kv_bytes_per_token=kv_bytes_per_token, threads=torch.get_num_threads(),
                   async_scheduling=args.async_scheduling, model_source=model_source(args.model),
                   prefill=prefill, decode=decode, link=link, serving=serving)


def model_source(model: str | None) -> str:
    """MODEL as given to `plan profile`, for the plan's `disagg up` line: a local path made absolute
    (the plan may be made elsewhere), a Hub id as it is, "" for the embedded model."""
    if model is None:
        return ""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


def main(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    result = profile(args)
    Path(args.out).write_text(result.to_json())
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f}s")
