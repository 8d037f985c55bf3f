"""`disagg bench`: load generation against an OpenAI-compatible server, and plots of its results.

This module stays light (argparse only): `disagg.cli` imports it to build the parser; the load
generator (`serve.py`) and the plotting (`plot.py`, matplotlib) are imported when they run.
"""

import argparse

from disagg.help_format import HelpFormatter


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """`disagg bench serve ...` and `disagg bench plot ...`."""
    bench = sub.add_parser("bench", help="benchmark a serving endpoint: serve (load generator), plot (results)")
    bench.set_defaults(log_level="WARNING")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bench_sub.add_parser("serve",
                                 help="load-test an OpenAI-compatible endpoint: TTFT, TPOT, ITL, E2E, goodput",
                                 formatter_class=HelpFormatter)
    add_serve_args(serve)
    plot = bench_sub.add_parser("plot", help="plot latency vs QPS from one or more `bench serve --save-json` files",
                                formatter_class=HelpFormatter)
    add_plot_args(plot)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (…/v1 is appended)")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                        help="the API the requests go to: /v1/completions or /v1/chat/completions")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--qps", "--request-rate", default="inf",
                        help="mean request rate of the arrivals (Poisson unless --burstiness); inf = all at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="the shape of the gamma distribution the gaps between arrivals are drawn from, at the "
                             "same mean rate: 1 is Poisson, below 1 burstier, above 1 more even (vLLM's)")
    parser.add_argument("--exact-rate", action="store_true",
                        help="scale each run's gaps so that its arrivals span exactly (requests - 1) / rate seconds: "
                             "as bursty, at the rate asked for (a short run's realized rate otherwise varies by "
                             "about 1/sqrt(requests))")
    parser.add_argument("--qps-sweep", default=None, help="comma-separated rates, one run each (e.g. 0.5,1,2,inf)")
    parser.add_argument("--num-requests", "--num-prompts", type=int, default=32, help="requests per rate")
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    parser.add_argument("--input-len", "--random-input-len", type=int, default=128,
                        help="prompt length in tokens (mean for uniform)")
    parser.add_argument("--output-len", "--random-output-len", type=int, default=32,
                        help="output tokens (mean for uniform)")
    parser.add_argument("--len-dist", choices=["fixed", "uniform", "lognormal"], default="fixed",
                        help="uniform: lengths drawn from [len*(1-range), len*(1+range)]; lognormal: median len, "
                             "sigma range, capped at 4*len (chat-shaped traffic: many short, a long tail)")
    parser.add_argument("--len-range", type=float, default=0.5,
                        help="half-width of the uniform lengths, a fraction; the lognormal's sigma")
    parser.add_argument("--prompt-kind", choices=["words", "token-ids"], default="words",
                        help="words: random English words, ~1 token each for BPE tokenizers (works with any server); "
                             "token-ids: random ids below --vocab-size sent as the prompt (completions only; "
                             "exact lengths; our server and vLLM accept them)")
    parser.add_argument("--vocab-size", type=int, default=32000, help="for --prompt-kind token-ids")
    parser.add_argument("--prompts-file", default=None,
                        help='JSONL, one request a line: {"prompt": str | [ids]} or {"messages": [...]}, '
                             'optional "max_tokens"; used in order, cycled')
    parser.add_argument("--workload", choices=["random", "shared-prefix"], default="random",
                        help="random: each prompt its own; shared-prefix: conversations, each opening with one of "
                             "--num-prefixes prefixes of --prefix-len tokens, in random order, of --turns turns "
                             "that each add --input-len tokens to the prompt before (the next turn is sent when "
                             "the answer is in)")
    parser.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: distinct prefixes")
    parser.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: tokens in each prefix")
    parser.add_argument("--turns", type=int, default=1, help="shared-prefix: requests in each conversation")
    parser.add_argument("--metrics-url", action="append", default=None, metavar="URL",
                        help="a /metrics to read the prefix-cache counters from, before and after each run, for "
                             "its hit rate (repeat for several nodes, e.g. each decode node behind a router, which "
                             "has none); default: BASE_URL/metrics")
    parser.add_argument("--no-ignore-eos", action="store_true",
                        help="do not send ignore_eos (for servers that refuse it)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="the requests' sampling temperature; 0 is greedy")
    parser.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2e:5000 (all must hold)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a request may wait for its connection, or for its next bytes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts and arrival times")
    parser.add_argument("--label", default=None, help="name of this system in plots (default: the base URL)")
    parser.add_argument("--save-json", default=None, help="write the results (summary and per request) here")
    parser.add_argument("--plot", default=None, help="write latency vs QPS to this PNG (needs matplotlib)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_plot_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="+", help="JSON files written by `disagg bench serve --save-json`")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--label", action="append", default=None,
                        help="a line's name, once per file in order (default: the label saved in each file)")


def run_bench(args: argparse.Namespace) -> None:
    if args.bench_command == "serve":
        from disagg.bench.serve import main

        main(args)
    else:
        from disagg.bench.plot import plot_files

        plot_files(args.results, args.out, args.label)
        print(f"wrote {args.out}")
