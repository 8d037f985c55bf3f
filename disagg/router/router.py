"""The router's view of its decode nodes: which are healthy, how busy each is, which to pick.

A decode node is healthy while GET /health answers 200. A node that fails a check, or that the
proxy could not reach, is skipped until a later check passes again. After several failed checks in
a row it is down: the requests it still holds are failed (a hung node would otherwise keep them
forever, since a non-streamed answer has no read timeout). Among the healthy ones the router
picks by its `--routing` policy:

- least_loaded: the fewest requests in flight; ties go to the node that has been sent fewer
  requests so far, so sequential requests alternate instead of all landing on the first.
- round_robin: each node in turn.
- cache_aware (the default): the node that holds most of the prompt's leading KV blocks, less `load_weight` blocks
  for each request it has in flight (score = matched blocks - load_weight x in flight; ties as
  least_loaded). Each node publishes the block hashes its prefix cache and KV tiers hold (GET /kv_events,
  followed in kv_view.py), and the router hashes the prompt's blocks the same way
  (block_hash.py) from its token ids (prompt_tokens.py). Two guards, as in SGLang's router, so
  that a hot node cannot take everything: a prompt of which no node holds `cache_threshold` of the
  blocks is new (the chat template's header and a short system prompt, which every node holds, are
  no reason to pile new conversations on one node) and goes to the least loaded; and when the
  busiest candidate has more than `balance_abs_threshold` requests in flight beyond the least
  busy, the least busy takes it. A node whose events stopped matches nothing. A prompt's blocks
  count as held on the node it was sent to for a few seconds (kv_view.py), before its events can
  say so: later uses of a prefix still being computed follow the first.
"""

import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from disagg.engine.block_hash import prompt_block_hashes
from disagg.router.kv_view import CacheView, follow_kv_events
from disagg.router.metrics import HEALTHY, MATCHED_BLOCKS, OUTSTANDING, REQUESTS

logger = logging.getLogger(__name__)

# A decode node busy with a full batch may answer /health late; that is not a failure.
HEALTH_TIMEOUT_S = 5.0
DOWN_AFTER_FAILED_CHECKS = 3  # then its requests in flight are failed


def describe(error: Exception) -> str:
    """`ReadError: reason`, or only the type for errors that carry no message."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def parse_decode_nodes(text: str) -> list[str]:
    """`host:port,http://host:port,...` -> addresses (host:port); raises ValueError naming the bad entry.
    A URL is taken as its host and port, as the routers of SGLang and vLLM's examples take them; the router
    speaks plain HTTP to the nodes, so another scheme, or a path, is refused."""
    addresses = []
    for entry in (a.strip() for a in text.split(",") if a.strip()):
        address = entry.removeprefix("http://").rstrip("/")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or "/" in address:
            raise ValueError(f"--decode-nodes entry {entry!r} is not HOST:PORT or http://HOST:PORT")
        addresses.append(address)
    if not addresses:
        raise ValueError("--decode-nodes needs at least one HOST:PORT (a decode node's HTTP port)")
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"--decode-nodes lists a node twice: {text}")
    return addresses


@dataclass(frozen=True)
class Routing:
    policy: str = "cache_aware"  # cache_aware, least_loaded or round_robin
    load_weight: float = 8.0  # cache_aware: prefix blocks one request in flight is worth
    cache_threshold: float = 0.3  # cache_aware: below this fraction of the prompt's blocks held, least loaded
    balance_abs_threshold: int = 32  # cache_aware: beyond this spread of requests in flight, least loaded


@dataclass
class DecodeNode:
    address: str  # host:port of the node's HTTP (OpenAI) server
    healthy: bool = False
    reason: str = "not checked yet"  # why it is unhealthy, for /health and the 503 message
    outstanding: int = 0  # requests proxied to it and not finished
    routed: int = 0  # requests sent to it so far
    failures: int = 0  # failed health checks (or unreachable proxied requests) in a row
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set at DOWN_AFTER_FAILED_CHECKS failures
    cache: CacheView = field(default_factory=CacheView)  # its prefix cache, under cache_aware routing

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def mark_healthy(self) -> None:
        if not self.healthy:
            logger.info("decode node %s is healthy", self.address)
        self.healthy = True
        self.reason = ""
        self.failures = 0
        self.down.clear()
        HEALTHY.labels(self.address).set(1)

    def mark_unhealthy(self, reason: str) -> None:
        if self.healthy or self.reason != reason:
            logger.warning("decode node %s is unhealthy: %s", self.address, reason)
        self.healthy = False
        self.reason = reason
        self.failures += 1
        HEALTHY.labels(self.address).set(0)
        if self.failures >= DOWN_AFTER_FAILED_CHECKS and not self.down.is_set():
            logger.warning("decode node %s is down after %d failures in a row; failing its %d requests in flight",
                           self.address, self.failures, self.outstanding)
            self.down.set()


def least_loaded(candidates: list[DecodeNode]) -> DecodeNode:
    return min(candidates, key=lambda n: (n.outstanding, n.routed))


def cache_aware(candidates: list[DecodeNode], matched: dict[str, int], num_blocks: int,
                routing: Routing) -> DecodeNode:
    """The best scored candidate: prefix blocks held (`matched`, by address, of the prompt's
    `num_blocks`) less load_weight per request in flight; the least loaded one for a prompt no node
    holds enough of, or when their loads are too far apart."""
    lightest = least_loaded(candidates)
    if max(matched.values()) < routing.cache_threshold * num_blocks:
        return lightest
    if max(n.outstanding for n in candidates) - lightest.outstanding > routing.balance_abs_threshold:
        return lightest
    return max(candidates, key=lambda n: (matched[n.address] - routing.load_weight * n.outstanding,
                                          -n.outstanding, -n.routed))


class Router:
    """The decode nodes, their health loop and (cache_aware) their KV event streams. Create and
    start it inside the running event loop."""

    def __init__(self, addresses: list[str], health_interval: float = 2.0, routing: Routing = Routing(),
                 api_key: str | None = None):
        self.nodes = [DecodeNode(address) for address in addresses]
        self.health_interval = health_interval
        self.routing = routing
        # The decode nodes' key too: /kv_events and /v1/models need it where they ask for one.
        self.auth_headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.turn = 0  # round_robin: the index of the next node to try first
        # A fresh connection per check: a kept-alive one the node is just closing would fail a healthy node.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(HEALTH_TIMEOUT_S),
                                        limits=httpx.Limits(max_keepalive_connections=0))
        self.events_client = httpx.AsyncClient()
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Check every node once (so the first request is routed right), then keep checking; under
        cache_aware, follow each node's KV events."""
        await self.check_all()
        self.tasks.append(asyncio.create_task(self._health_loop(), name="decode-health"))
        if self.routing.policy == "cache_aware":
            self.tasks += [asyncio.create_task(follow_kv_events(n.cache, f"{n.url}/kv_events", self.events_client,
                                                                self.auth_headers), name=f"kv-events-{n.address}")
                           for n in self.nodes]

    def pick(self, exclude: set[str] = frozenset(), token_ids: list[int] | None = None) -> DecodeNode | None:
        """The healthy node not in `exclude` that the routing policy picks for a prompt of
        `token_ids` (None: not known, routed by load), or None when there is none."""
        candidates = [n for n in self.nodes if n.healthy and n.address not in exclude]
        if not candidates:
            return None
        if self.routing.policy == "round_robin":
            node = min(candidates, key=lambda n: (self.nodes.index(n) - self.turn) % len(self.nodes))
            self.turn = (self.nodes.index(node) + 1) % len(self.nodes)
            return node
        if self.routing.policy != "cache_aware" or not token_ids:
            return least_loaded(candidates)
        hashes: dict[int, list[int]] = {}  # block size -> the prompt's block hashes (nodes may differ)
        matched = {}
        for n in candidates:
            size = n.cache.block_size
            if size and size not in hashes:
                hashes[size] = prompt_block_hashes(token_ids, size)
            matched[n.address] = n.cache.matched_blocks(hashes[size]) if size else 0
        num_blocks = len(next(iter(hashes.values()), []))
        node = cache_aware(candidates, matched, num_blocks, self.routing)
        MATCHED_BLOCKS.labels(node.address).inc(matched[node.address])
        if node.cache.block_size:
            node.cache.expect(hashes[node.cache.block_size])
        return node

    def begin(self, node: DecodeNode) -> None:
        node.outstanding += 1
        node.routed += 1
        REQUESTS.labels(node.address).inc()
        OUTSTANDING.labels(node.address).set(node.outstanding)

    def end(self, node: DecodeNode) -> None:
        node.outstanding -= 1
        OUTSTANDING.labels(node.address).set(node.outstanding)

    def unavailable_reason(self) -> str:
        reasons = "; ".join(f"{n.address}: {n.reason}" for n in self.nodes if not n.healthy)
        return reasons or "every decode node failed this request"

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(n) for n in self.nodes))

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)  # one that failed must not stop the rest
        self.tasks = []
        await self.client.aclose()
        await self.events_client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self.check_all()

    async def _check(self, node: DecodeNode) -> None:
        try:
            response = await self.client.get(f"{node.url}/health")
        except httpx.HTTPError as e:
            node.mark_unhealthy(f"GET /health failed: {describe(e)}")
            return
        if response.status_code != 200:
            node.mark_unhealthy(f"GET /health answered {response.status_code}")
            return
        node.mark_healthy()
