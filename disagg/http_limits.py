"""What an HTTP server of ours holds open, and for how long (the flags of `disagg serve` and
`disagg router`); serving.py enforces them. Kept light (argparse only), as the command lines load it.

Issue 24: ~20,000 idle TCP connections used up a decode node's file descriptors, after which
/health timed out and asyncio logged half a million accept() errors in 45 s; connections that
sent nothing, or a byte a second, stayed open for good."""

import argparse
from dataclasses import dataclass


@dataclass
class HTTPLimits:
    limit_concurrency: int = 2048  # connections open at once (uvicorn's name); see serving.BoundedH11Protocol
    backlog: int = 2048  # connections the kernel queues before they are accepted (uvicorn's)
    timeout_keep_alive: float = 5.0  # seconds an idle connection stays open after a response (uvicorn's)
    timeout_request_headers: float = 10.0  # from a connection's first byte (or its opening) to its request's headers
    timeout_request_body: float = 30.0  # from a request's headers to the end of its body

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "HTTPLimits":
        limits = cls(args.limit_concurrency, args.backlog, args.timeout_keep_alive, args.timeout_request_headers,
                     args.timeout_request_body)
        for name in ("limit_concurrency", "backlog"):
            if getattr(limits, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(limits, name)}")
        for name in ("timeout_keep_alive", "timeout_request_headers", "timeout_request_body"):
            if not getattr(limits, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(limits, name)}")
        return limits


def add_http_limit_args(parser: argparse.ArgumentParser) -> None:
    default = HTTPLimits()
    parser.add_argument("--limit-concurrency", type=int, default=default.limit_concurrency,
                        help="HTTP connections open at once (capped below the open-file limit); a new one past it "
                             "closes the longest-idle connection that has no request in progress, or itself")
    parser.add_argument("--backlog", type=int, default=default.backlog,
                        help="HTTP connections the kernel queues before they are accepted")
    parser.add_argument("--timeout-keep-alive", type=float, default=default.timeout_keep_alive,
                        help="seconds an idle HTTP connection stays open after a response")
    parser.add_argument("--timeout-request-headers", type=float, default=default.timeout_request_headers,
                        help="seconds a connection gets to send its request's headers (from its first byte, or "
                             "from its opening); then it is closed")
    parser.add_argument("--timeout-request-body", type=float, default=default.timeout_request_body,
                        help="seconds a request gets to send its body after its headers; then it is closed")
