"""The router: one OpenAI front door over several decode nodes (xPyD), `disagg router`.

Only the command line lives here, so that `disagg --help` does not load the router's server."""

import argparse

from disagg.help_format import HelpFormatter
from disagg.http_limits import add_http_limit_args

# The request body limit of the router and of the decode nodes' API (`disagg serve` uses it too);
# it lives here because this module must stay light. Prompts of a full context fit with room to spare.
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 2**20
ROUTINGS = ("cache_aware", "least_loaded", "round_robin")  # router.py says how each picks


def add_router_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("router", help="one OpenAI front door over several decode nodes (xPyD)",
                            formatter_class=HelpFormatter)
    parser.add_argument("--decode-nodes", required=True,
                        help="HOST:PORT[,HOST:PORT...] of the decode nodes' HTTP (OpenAI) servers "
                             "(http://HOST:PORT too)")
    parser.add_argument("--host", default="127.0.0.1", help="address the router's HTTP server binds")
    parser.add_argument("--port", type=int, default=8000, help="the router's HTTP port")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every path but /health, /metrics and /ping "
                             "(forwarded to the decode nodes; default: $DISAGG_API_KEY)")
    parser.add_argument("--routing", choices=ROUTINGS, default="cache_aware",
                        help="how a decode node is picked: the one whose prefix cache holds most of the prompt (less "
                             "--load-weight blocks per request in flight), fewest requests in flight, or each in turn")
    parser.add_argument("--tokenizer", default=None,
                        help="cache_aware: the served model's Hugging Face directory (tokenizer.json, "
                             "tokenizer_config.json), to hash the prompt's blocks as the nodes do; default: the "
                             "tokenizer directory the first healthy decode node loaded (its /v1/models tokenizer, "
                             "else root), which must be on this machine; if no node answers at start, the embedded "
                             "model's (or none: routing by load) with a warning, until one does")
    parser.add_argument("--load-weight", type=float, default=8.0,
                        help="cache_aware: how many prompt blocks held one request in flight on a node is worth")
    parser.add_argument("--cache-threshold", type=float, default=0.3,
                        help="cache_aware: a prompt of which no node holds this fraction of the blocks is new and goes "
                             "to the least loaded node (a shared system prompt is no reason to pile on one node)")
    parser.add_argument("--balance-abs-threshold", type=int, default=32,
                        help="cache_aware: when the busiest node has more than this many requests in flight beyond "
                             "the least busy, the least busy takes the request")
    parser.add_argument("--health-interval", type=float, default=2.0,
                        help="seconds between health checks of each decode node")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies are refused with 413 before they are forwarded")
    parser.add_argument("--enable-docs", action="store_true",
                        help="serve /docs and /openapi.json (off: they map the API for anyone who reaches the port)")
    add_http_limit_args(parser)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
