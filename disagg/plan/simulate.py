"""The plan's simulator: a layout's goodput predicted from a profile, by DistServe's method.

Requests arrive as a Poisson process; each node is an engine that runs one step at a time, as the
scheduler builds it (running sequences first, a decode one token and a prompt its next chunk, then
waiting prompts, under the token budget and the sequence cap); a step takes what the profile's
fitted `StepTimes` says, with what serving adds to a step (a fixed part and a part per decoding
sequence, whose token is streamed) and to the first token (measured on a served node,
`Profile.serving`). A colocated node computes a prompt and decodes its answer. In xPyD the router
hands each request to the decode node with the fewest requests in flight, that node to the prefill
node with the fewest prompt tokens to compute (as the decode node's pool picks), every prompt however
short (`remote_prefill` "always"); the prompt's KV then crosses the link (one
transfer at a time per prefill node: a fixed cost and bytes ÷ bandwidth, nothing hidden behind
compute), and its first token reaches the client when the KV is in; the decode node's next step
loads the KV and the one after decodes (as the engine does), to the end. Not modelled: the KV
cache's size (no preemption), prefix-cache hits, layer-wise overlap.

Goodput is the highest rate at which at least ATTAINMENT of the requests meet both SLOs (TTFT and
TPOT), found by doubling and then bisecting the rate, each rate averaged over a few seeds (the same
arrivals scaled, so attainment falls smoothly as the rate rises)."""

import bisect
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from disagg.plan.profile import Profile

ATTAINMENT = 0.9
SEARCH_PRECISION = 0.01
TRICKLE = 1 / 16  # the search's first rate, as a fraction of one request at a time per GPU


@dataclass
class StepTimes:
    """Seconds of one engine step from a profile. A step that computes prompt tokens costs the
    prefill time of all the tokens it computes (its prompt chunks' and one per decoding sequence),
    read off the profile's prefill samples by linear interpolation (extended past both ends along
    the nearest segment), plus the decoding sequences' attention to what they hold. A decode-only
    step costs d0 + d_seq·B + d_ctx·(tokens the B sequences hold), fitted to the decode samples, plus
    what the samples of B sequences took beyond that line, interpolated between the profiled batch
    sizes (flat past both ends): a CUDA graph runs a batch padded to its bucket, with the attention
    split count of the bucket's size, so the step is a staircase in B, not a line."""
    prefill_tokens: list[int]
    prefill_seconds: list[float]
    d0: float
    d_seq: float
    d_ctx: float
    serving_step: float = 0.0  # what a served node adds to each step (Profile.serving)
    serving_per_seq: float = 0.0  # and to it for each decoding sequence past the first
    decode_batches: list[int] = field(default_factory=list)  # the profiled batch sizes, ascending
    decode_residuals: list[float] = field(default_factory=list)  # their samples' mean beyond the line

    @classmethod
    def fit(cls, profile: Profile) -> "StepTimes":
        if len(profile.prefill) < 2 or len(profile.decode) < 3:
            raise ValueError("a profile needs at least 2 prefill and 3 decode samples")
        samples = sorted(profile.prefill, key=lambda s: s.tokens)
        d = nonnegative_fit([[1.0, s.batch, s.batch * s.context] for s in profile.decode],
                            [s.seconds for s in profile.decode])
        beyond: dict[int, list[float]] = {}
        for sample in profile.decode:
            line = d[0] + d[1] * sample.batch + d[2] * sample.batch * sample.context
            beyond.setdefault(sample.batch, []).append(sample.seconds - line)
        batches = sorted(beyond)
        return cls([s.tokens for s in samples], [s.seconds for s in samples], *d, profile.serving.step_extra_s,
                   profile.serving.step_extra_per_seq_s, batches, [float(np.mean(beyond[b])) for b in batches])

    def prefill(self, tokens: int) -> float:
        xs, ys = self.prefill_tokens, self.prefill_seconds
        i = min(max(bisect.bisect_left(xs, tokens), 1), len(xs) - 1)  # the segment [i - 1, i]
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return max(ys[i - 1] + slope * (tokens - xs[i - 1]), 0.0)

    def seconds(self, prompt_tokens: int, decode_seqs: int, decode_tokens: int) -> float:
        """prompt_tokens: of the step's prompt chunks; decode_tokens: the tokens the decoding sequences hold."""
        serving = self.serving_step + self.serving_per_seq * max(decode_seqs - 1, 0)
        if prompt_tokens:
            return self.prefill(prompt_tokens + decode_seqs) + self.d_ctx * decode_tokens + serving
        staircase = float(np.interp(decode_seqs, self.decode_batches, self.decode_residuals)) \
            if self.decode_batches else 0.0
        return self.d0 + self.d_seq * decode_seqs + self.d_ctx * decode_tokens + serving + staircase


def nonnegative_fit(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: a term fitted negative (noise on few points) is
    dropped and the rest fitted again."""
    a, b = np.array(rows, dtype=float), np.array(y, dtype=float)
    keep = list(range(a.shape[1]))
    while True:
        coef = np.linalg.lstsq(a[:, keep], b, rcond=None)[0]
        if (coef >= 0).all():
            out = [0.0] * a.shape[1]
            for i, c in zip(keep, coef):
                out[i] = float(c)
            return out
        del keep[int(np.argmin(coef))]


@dataclass(frozen=True)
class Layout:
    prefill: int  # prefill nodes; 0: colocated
    decode: int  # decode (or colocated) nodes

    @property
    def gpus(self) -> int:
        return self.prefill + self.decode

    @property
    def name(self) -> str:
        return f"{self.prefill}P{self.decode}D" if self.prefill else f"colocated x{self.decode}"


def layouts(gpus: int) -> list[Layout]:
    """Colocated on every GPU, then every xPyD with x + y = gpus."""
    return [Layout(0, gpus)] + [Layout(p, gpus - p) for p in range(1, gpus)]


@dataclass
class Settings:
    """What the nodes run with (their flags) and what the plan asks of them."""
    ttft_s: float
    tpot_s: float
    max_num_seqs: int = 64  # --max-num-seqs
    batched_tokens: int = 2048  # --max-num-batched-tokens of colocated and decode nodes
    prefill_batched_tokens: int = 2048  # a prefill node's (8192 on a GPU: serve's default there)
    num_requests: int = 200  # per simulated run
    seeds: int = 3  # runs averaged per rate


@dataclass(eq=False)  # one request is never equal to another (running.remove finds this one)
class Request:
    arrival: float
    input_len: int
    output_len: int
    computed: int = 0  # prompt tokens computed
    generated: int = 0  # output tokens
    first_token: float | None = None
    finish: float | None = None
    front: "Node | None" = None  # the decode or colocated node the router gave it

    @property
    def holding(self) -> int:
        return self.input_len + self.generated

    def meets(self, s: Settings) -> bool:
        if self.finish is None or self.first_token - self.arrival > s.ttft_s:
            return False
        return self.output_len < 2 or (self.finish - self.first_token) / (self.output_len - 1) <= s.tpot_s


@dataclass(eq=False)
class Node:
    """One engine: prompts waiting, sequences running (a prompt in chunks, then its decodes)."""
    role: str  # "both", "prefill" or "decode"
    budget: int  # tokens per step
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    busy: bool = False
    in_flight: int = 0  # what the router (or a decode node) counts: requests given and not done
    routed: int = 0
    link_free: float = 0.0  # a prefill node: when its link is free for the next transfer
    arrived: list = field(default_factory=list)  # a decode node: KV in, loaded by the next step, decoded after


class Simulation:
    def __init__(self, layout: Layout, cost: StepTimes, profile: Profile, s: Settings):
        self.cost, self.link, self.kv_bytes, self.s = cost, profile.link, profile.kv_bytes_per_token, s
        # What a client waits for its first token beyond the steps (the served path's own: HTTP, the
        # hand-offs); the steps' share of it is in StepTimes.serving_step.
        self.first_token_extra = max(profile.serving.ttft_extra_s - profile.serving.step_extra_s, 0.0)
        role = "decode" if layout.prefill else "both"
        self.prefill = [Node("prefill", s.prefill_batched_tokens) for _ in range(layout.prefill)]
        self.decode = [Node(role, s.batched_tokens) for _ in range(layout.decode)]
        self.events: list = []
        self.count = 0  # the heap's tie-breaker

    def at(self, when: float, action, *args) -> None:
        self.count += 1
        heapq.heappush(self.events, (when, self.count, action, args))

    def run(self, requests: list[Request]) -> list[Request]:
        for r in requests:
            self.at(r.arrival, self.arrive, r)
        while self.events:
            now, _, action, args = heapq.heappop(self.events)
            action(now, *args)
        return requests

    def arrive(self, now: float, r: Request) -> None:
        front = pick(self.decode)
        front.in_flight += 1
        r.front = front
        if self.prefill:
            node = pick_prefill(self.prefill)
            node.in_flight += 1
        else:
            node = front
        node.waiting.append(r)
        self.start_step(now, node)

    def start_step(self, now: float, node: Node) -> None:
        if node.busy:
            return
        chunks, decodes = self.schedule(node)
        loaded, node.arrived = node.arrived, []  # this step loads their KV (in no time when it has nothing else)
        node.waiting.extend(loaded)
        if not chunks and not decodes:
            if loaded:
                self.start_step(now, node)
            return
        node.busy = True
        seconds = self.cost.seconds(sum(n for _, n in chunks), len(decodes), sum(r.holding for r in decodes))
        self.at(now + seconds, self.end_step, node, chunks, decodes)

    def schedule(self, node: Node) -> tuple[list, list]:
        """As the engine's scheduler: running first, then waiting under the budget and the cap."""
        budget, chunks, decodes = node.budget, [], []
        for r in node.running:
            if budget <= 0:
                break
            if r.computed < r.input_len:
                n = min(r.input_len - r.computed, budget)
                chunks.append((r, n))
                budget -= n
            else:
                decodes.append(r)
                budget -= 1
        while node.waiting and budget > 0 and len(node.running) < self.s.max_num_seqs:
            r = node.waiting.popleft()
            node.running.append(r)
            if r.computed < r.input_len:
                n = min(r.input_len - r.computed, budget)
                chunks.append((r, n))
                budget -= n
            else:  # its KV came from a prefill node: it decodes
                decodes.append(r)
                budget -= 1
        return chunks, decodes

    def end_step(self, now: float, node: Node, chunks: list, decodes: list) -> None:
        node.busy = False
        for r, n in chunks:
            r.computed += n
            if r.computed == r.input_len:  # its first token is sampled
                r.generated = 1
                if node.role == "prefill":
                    node.running.remove(r)
                    start = max(now, node.link_free)
                    node.link_free = start + self.link.transfer_seconds(r.input_len * self.kv_bytes)
                    self.at(node.link_free, self.handed_over, node, r)
                else:
                    r.first_token = now + self.first_token_extra
                    self.finish_if_done(now, node, r)
        for r in decodes:
            r.generated += 1
            self.finish_if_done(now, node, r)
        self.start_step(now, node)

    def handed_over(self, now: float, prefill: Node, r: Request) -> None:
        prefill.in_flight -= 1
        r.first_token = now + self.first_token_extra
        if r.output_len < 2:
            r.finish = now
            r.front.in_flight -= 1
            return
        r.front.arrived.append(r)
        self.start_step(now, r.front)

    def finish_if_done(self, now: float, node: Node, r: Request) -> None:
        if r.generated >= r.output_len:
            r.finish = max(now, r.first_token)
            node.running.remove(r)
            r.front.in_flight -= 1


def pick(nodes: list[Node]) -> Node:
    """The router's least_loaded: fewest in flight, then fewest given so far."""
    node = min(nodes, key=lambda n: (n.in_flight, n.routed))
    node.routed += 1
    return node


def pick_prefill(nodes: list[Node]) -> Node:
    """A decode node's PrefillPool.pick (no prefix is shared here): the fewest prompt tokens still to
    compute, then fewest in flight, then fewest given so far."""
    node = min(nodes, key=lambda n: (pending_tokens(n), n.in_flight, n.routed))
    node.routed += 1
    return node


def pending_tokens(node: Node) -> int:
    return sum(r.input_len - r.computed for r in (*node.running, *node.waiting) if r.computed < r.input_len)


def requests(lengths: list[tuple[int, int]], n: int, rate: float, seed: int) -> list[Request]:
    """n requests of lengths drawn from `lengths`, Poisson arrivals at `rate` (the same seed gives the
    same requests at every rate, their arrivals scaled)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(1.0)
        input_len, output_len = lengths[rng.randrange(len(lengths))]
        out.append(Request(t / rate, input_len, output_len))
    return out


@dataclass
class Prediction:
    layout: Layout
    goodput: float  # requests per second
    attainment: dict[float, float]  # rate -> fraction of requests within both SLOs

    @property
    def per_gpu(self) -> float:
        return self.goodput / self.layout.gpus


class Planner:
    def __init__(self, profile: Profile, lengths: list[tuple[int, int]], s: Settings):
        self.profile, self.lengths, self.s = profile, lengths, s
        self.cost = StepTimes.fit(profile)

    def attainment(self, layout: Layout, rate: float) -> float:
        met = total = 0
        for seed in range(self.s.seeds):
            sim = Simulation(layout, self.cost, self.profile, self.s)
            done = sim.run(requests(self.lengths, self.s.num_requests, rate, seed))
            met += sum(r.meets(self.s) for r in done)
            total += len(done)
        return met / total

    def goodput(self, layout: Layout) -> float:
        """The rate at which attainment first falls below ATTAINMENT, rising from a trickle (0 if even a
        trickle misses). Rising, not searching the whole axis: a burst of num_requests may meet an SLO
        that a steady rate below it does not (the burst's prompts go in one efficient batch)."""
        def ok(rate: float) -> bool:
            return self.attainment(layout, rate) >= ATTAINMENT

        mean_in = sum(i for i, _ in self.lengths) / len(self.lengths)
        mean_out = sum(o for _, o in self.lengths) / len(self.lengths)
        alone = self.cost.seconds(int(mean_in), 0, 0) + mean_out * self.cost.seconds(0, 1, int(mean_in))
        low = TRICKLE * layout.gpus / alone  # a few percent of one request at a time per GPU
        if not ok(low):
            return 0.0
        high = low * 2
        while ok(high):
            low, high = high, high * 2
            if low > 1e4 * layout.gpus / alone:  # the SLO holds even with every request at once
                return math.inf
        while high - low > SEARCH_PRECISION * low:
            mid = (low + high) / 2
            low, high = (mid, high) if ok(mid) else (low, mid)
        return low

    def predict_at(self, layout: Layout, goodput: float, rates: list[float]) -> Prediction:
        """goodput (from `goodput`) with the attainment at each of `rates`."""
        return Prediction(layout, goodput, {rate: self.attainment(layout, rate) for rate in rates})
