"""RateLimitedLog: warnings a flood of bad peers or connections cannot turn into a flood of lines.

A leaf module under every layer (the pipes use it too), importing nothing heavy, so that servers
that load no torch (the router) can use it."""

import logging
import threading
import time


class RateLimitedLog:
    """Warnings that at most once per `interval` seconds per reason reach the log, the next
    one counting those held back: a flood of bad peers must not become a flood of lines."""

    def __init__(self, log: logging.Logger, interval: float = 10.0) -> None:
        self._log = log
        self._interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # reason -> time.monotonic() of its last line
        self._held: dict[str, int] = {}  # reason -> lines not logged since

    def warning(self, reason: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(reason)
            if last is not None and now - last < self._interval:
                self._held[reason] = self._held.get(reason, 0) + 1
                return
            self._last[reason] = now
            held = self._held.pop(reason, 0)
        if held:
            message += f" ({held} more like it in the last {self._interval:.0f}s not logged)"
        self._log.warning(message)
