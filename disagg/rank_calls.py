"""RankCalls: a node's driver calling what runs in its tensor-parallel worker ranks' processes.

The engine gives the driver one channel per worker (EngineConfig.rank_service); the node's code on
each end speaks over it in numbered calls: the driver sends `Call(number, message)` and awaits the
reply with that number, which a reader thread per channel hands to the caller's event loop. A worker
answers a call with an object whose `number` is the call's and whose `error` says why it failed (None:
it did not). A rank whose process dies fails every call waiting on it at once; one that is alive but
does not answer fails the call at its timeout.
"""

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)
# The bound on a call a worker answers at once (no wait of its own for room or a peer's KV): only a worker
# that is stuck takes longer.
QUICK_CALL_S = 10.0


@dataclass
class Call:
    number: int
    message: Any


class RankGone(RuntimeError):
    """A worker rank's process ended: it cannot answer."""


class RankNoAnswer(RuntimeError):
    """A worker rank did not answer a call in time (its process may still run)."""


class RankCallFailed(RuntimeError):
    """A worker answered a call with an error (its reply, for what more it tells)."""

    def __init__(self, message: str, reply: Any):
        super().__init__(message)
        self.reply = reply


class RankCalls:
    def __init__(self, channels: list, on_reply: Callable[[int, Any], None] = lambda rank, reply: None):
        """channels: rank r's at index r - 1; on_reply(rank, reply) is called on the reader thread with
        every reply, before its caller gets it (counters a worker reports)."""
        self.channels = channels
        self.on_reply = on_reply
        self.numbers = itertools.count()
        self.calls: dict[int, tuple[int, asyncio.AbstractEventLoop, asyncio.Future]] = {}  # number -> rank, waiter
        self.gone: dict[int, str] = {}  # rank -> why its calls fail
        self.lock = threading.Lock()

    def start(self) -> None:
        """Read the replies (once whatever the channels carried first has been read)."""
        for rank, channel in enumerate(self.channels, 1):
            threading.Thread(target=self._read, args=(rank, channel), name=f"rank{rank}-replies", daemon=True).start()

    async def call(self, rank: int, message: Any, timeout: float) -> Any:
        """The worker's reply; raises RankCallFailed with its error, RankGone if its process ended,
        RankNoAnswer if no reply came within `timeout` seconds."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        number = next(self.numbers)
        with self.lock:
            if rank in self.gone:
                raise RankGone(self.gone[rank])
            self.calls[number] = (rank, loop, waiter)
        try:
            self.channels[rank - 1].send(Call(number, message))
            reply = await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            raise RankNoAnswer(f"tensor-parallel rank {rank} did not answer {type(message).__name__} "
                               f"within {timeout:g}s") from None
        finally:
            with self.lock:
                self.calls.pop(number, None)
        if reply.error is not None:
            raise RankCallFailed(f"tensor-parallel rank {rank}: {reply.error}", reply)
        return reply

    async def each(self, messages: dict[int, Any], timeout: float) -> dict[int, Any]:
        """A call to each of these ranks at once, each bounded by `timeout`; the first failure cancels the
        waits for the others (the caller then undoes the request, which ends them on the workers)."""
        tasks = {rank: asyncio.ensure_future(self.call(rank, message, timeout)) for rank, message in messages.items()}
        try:
            await asyncio.gather(*tasks.values())
            return {rank: task.result() for rank, task in tasks.items()}
        finally:
            for task in tasks.values():
                task.cancel()

    def _read(self, rank: int, channel) -> None:
        while True:
            try:
                reply = channel.recv()
            except (EOFError, OSError):
                break
            self.on_reply(rank, reply)
            with self.lock:
                call = self.calls.get(reply.number)
            if call is not None:
                call[1].call_soon_threadsafe(_resolve, call[2], reply)
        reason = f"tensor-parallel rank {rank}'s process ended"
        with self.lock:
            self.gone[rank] = reason
            waiting = [(loop, waiter) for r, loop, waiter in self.calls.values() if r == rank]
        for loop, waiter in waiting:
            loop.call_soon_threadsafe(_fail, waiter, RankGone(reason))


def _resolve(waiter: asyncio.Future, reply: Any) -> None:
    if not waiter.done():
        waiter.set_result(reply)


def _fail(waiter: asyncio.Future, error: Exception) -> None:
    if not waiter.done():
        waiter.set_exception(error)


def answer_calls(channel, handle: Callable[[Call], None], failed: Callable[[Call, Exception], None],
                 closed: Callable[[], None]) -> None:
    """A worker's end of the channel, until the driver is gone (then `closed()`): each call to `handle`,
    which replies (at once, or from a thread of its own); a call whose handling raises to `failed`, to
    answer with why, and the next calls are still answered."""
    while True:
        try:
            call: Call = channel.recv()
        except (EOFError, OSError):  # the driver is gone; the rank's step loop ends too
            closed()
            return
        try:
            handle(call)
        except Exception as e:
            logger.exception("tensor-parallel rank: call %r failed", call.message)
            failed(call, e)
