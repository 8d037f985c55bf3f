"""The router's view of its decode nodes: which are healthy, how busy each is, which to pick.

A decode node is healthy while GET /health answers 200. A node that fails a check, or that the
proxy could not reach, is skipped until a later check passes again. After several failed checks in
a row it is down: the requests it still holds are failed (a hung node would otherwise keep them
forever, since a non-streamed answer has no read timeout). Among the healthy ones the
router picks the node with the fewest requests in flight; ties go to the node that has been
sent fewer requests so far, so sequential requests alternate instead of all landing on the first.
"""

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import httpx

from disagg.router.metrics import HEALTHY, OUTSTANDING, REQUESTS

logger = logging.getLogger(__name__)

# A decode node busy with a full batch may answer /health late; that is not a failure.
HEALTH_TIMEOUT_S = 5.0
DOWN_AFTER_FAILED_CHECKS = 3  # then its requests in flight are failed


def describe(error: Exception) -> str:
    """`ReadError: reason`, or only the type for httpx errors that carry no message."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def parse_decode_nodes(text: str) -> list[str]:
    """`host:port,host:port` -> addresses; raises ValueError naming the bad entry."""
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    if not addresses:
        raise ValueError("--decode-nodes needs at least one HOST:PORT (a decode node's HTTP port)")
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--decode-nodes entry {address!r} is not HOST:PORT")
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"--decode-nodes lists a node twice: {text}")
    return addresses


@dataclass
class DecodeNode:
    address: str  # host:port of the node's HTTP (OpenAI) server
    healthy: bool = False
    reason: str = "not checked yet"  # why it is unhealthy, for /health and the 503 message
    outstanding: int = 0  # requests proxied to it and not finished
    routed: int = 0  # requests sent to it so far
    failures: int = 0  # failed health checks (or unreachable proxied requests) in a row
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set at DOWN_AFTER_FAILED_CHECKS failures

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


class Router:
    """The decode nodes and their health loop. Create and start it inside the running event loop."""

    def __init__(self, addresses: list[str], health_interval: float = 2.0):
        self.nodes = [DecodeNode(address) for address in addresses]
        self.health_interval = health_interval
        # A fresh connection per check: a kept-alive one the node is just closing would fail a healthy node.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(HEALTH_TIMEOUT_S),
                                        limits=httpx.Limits(max_keepalive_connections=0))
        self.health_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Check every node once (so the first request is routed right), then keep checking."""
        await self.check_all()
        self.health_task = asyncio.create_task(self._health_loop(), name="decode-health")

    def pick(self, exclude: set[str] = frozenset()) -> DecodeNode | None:
        """The least busy healthy node not in `exclude`, or None when there is none."""
        candidates = [n for n in self.nodes if n.healthy and n.address not in exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda n: (n.outstanding, n.routed))

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
        if self.health_task is not None:
            self.health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.health_task
            self.health_task = None
        await self.client.aclose()

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
