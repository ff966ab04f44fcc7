"""``pdserve bench``: serving benchmarks (code in pdserve/loadtest/, docs in docs/benchmarks.md).

    pdserve bench serve --router localhost:50051 --dataset random --request-rate 1,2,4,inf
    pdserve bench compare --launch --gpus 0,1 --dataset prefill-heavy --slo ttft_ms=500,tpot_ms=50
    pdserve bench router-overhead

Only argparse is imported here; the benchmark modules load when a subcommand runs.
"""
from __future__ import annotations

import argparse

from pdserve.common import env
from pdserve.router.settings import DEFAULT_PORT as ROUTER_PORT

DATASETS = ("random", "w-nano", "shared-prefix", "multi-turn", "prefill-heavy", "decode-heavy", "jsonl", "phases")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """Workload, arrivals, metrics and output flags (shared by serve and compare)."""
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="random", help="workload (docs/benchmarks.md)")
    g.add_argument("--dataset-path", default=None, help="jsonl: the file")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="requests per run (default: random/mixes 200, w-nano 256, jsonl every line, phases the "
                        "arrivals of --phase-cycles cycles)")
    g.add_argument("--input-len", default=None,
                   help="prompt length N or range LO:HI (shared-prefix: the suffix length)")
    g.add_argument("--output-len", default=None, help="max_tokens N or range LO:HI")
    g.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: number of system prompts")
    g.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens per system prompt")
    g.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per conversation")
    g.add_argument("--closed-loop-turns", action="store_true",
                   help="multi-turn: send a conversation's next turn only once its previous turn has ended (as a "
                        "chat user waits for the answer), at the earliest at its own arrival time; default: every "
                        "turn at its arrival time")
    g.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="synthetic prompts as token ids (exact lengths) or as text of common words")
    g.add_argument("--vocab-size", type=int, default=0, help="token ids drawn below this (default: the model's)")
    g.add_argument("--temperature", type=float, default=None, help="override the dataset's temperature")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="override the dataset's ignore_eos (synthetic: on; jsonl: off)")
    g.add_argument("--seed", type=int, default=0, help="seed of the dataset and the arrivals")
    g.add_argument("--same-prompts", action="store_true",
                   help="every run of a sweep or search sends the same prompts (default: each run its own "
                        "variant of the dataset, so that no run finds an earlier run's prompts cached)")
    ph = p.add_argument_group("phases (--dataset phases, pdserve/loadtest/phases.py)")
    ph.add_argument("--phase-seconds", type=float, default=45.0,
                    help="length of each phase window (s); the windows run prefill-heavy, shared-prefix, "
                         "decode-heavy, repeating")
    ph.add_argument("--phase-rates", default="1,3,2",
                    help="rate multipliers of the prefill-heavy, shared-prefix and decode-heavy phases "
                         "(x --request-rate, the base rate)")
    ph.add_argument("--phase-cycles", type=int, default=None,
                    help="stop after this many full cycles of the three phases (default: 1 without "
                         "--num-prompts; with it, as many as its requests need)")
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", default="inf",
                   help="comma list of rates (req/s), 'inf' = all at once; phases: the finite base rate")
    a.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the intervals: 1 = Poisson, <1 burstier, >1 more regular, inf = fixed")
    a.add_argument("--max-concurrency", default=None,
                   help="at most N requests in flight (a comma list sweeps it too)")
    a.add_argument("--normalize-arrivals", action="store_true",
                   help="rescale arrival times so the last request goes at (n-1)/rate exactly")
    m = p.add_argument_group("metrics")
    m.add_argument("--slo", action="append", default=[],
                   help="goodput SLOs, e.g. ttft_ms=500,tpot_ms=50,e2e_ms=20000 (repeatable); itl_p99_ms=30 "
                        "bounds a run's ITL p99 (SLO capacity)")
    m.add_argument("--goodput", nargs="*", default=[], help="vLLM-style SLOs: ttft:500 tpot:50 e2el:20000")
    m.add_argument("--percentiles", default="50,90,99", help="percentiles reported per metric")
    m.add_argument("--itl-mode", choices=("chunk", "split"), default="chunk",
                   help="ITL of a multi-token message: one gap (vLLM, default) or gap/k per token (SGLang)")
    c = p.add_argument_group("client")
    c.add_argument("--num-client-procs", type=int, default=1, help="client processes (each its own event loop)")
    c.add_argument("--channels-per-proc", type=int, default=4, help="gRPC connections per client process")
    c.add_argument("--request-timeout", type=float, default=600.0, help="deadline of each request (s)")
    c.add_argument("--num-warmups", type=int, default=1, help="warm-up requests before the runs")
    c.add_argument("--ready-timeout", type=float, default=120.0, help="wait this long for the router (s)")
    c.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    o = p.add_argument_group("output")
    o.add_argument("--result-dir", default=".", help="where the JSON and PNGs go (default: the working directory)")
    o.add_argument("--result-filename", default=None, help="name of the JSON (default: serve-<label>-<time>)")
    o.add_argument("--label", default=None, help="name of this run in file names and titles")
    o.add_argument("--save-detailed", action="store_true", help="also save per-request arrays (vLLM names)")
    o.add_argument("--no-plots", action="store_true", help="skip the PNGs")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", required=True, metavar="{serve,compare,router-overhead}")

    s = sub.add_parser("serve", help="load-test a router: a sweep over request rates -> JSON + PNGs",
                       description="Load-test a running router with streamed Generate calls.")
    s.add_argument("--router", default=env.get("ROUTER", f"localhost:{ROUTER_PORT}"),
                   help="router address (env PDSERVE_ROUTER)")
    h = s.add_argument_group("front door")
    h.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                   help="grpc: streamed Generate calls to --router; openai: streamed requests to the OpenAI HTTP "
                        "API at --base-url (the same requests and metrics)")
    h.add_argument("--base-url", default=env.get("OPENAI_BASE_URL", "http://localhost:8000/v1"),
                   help="openai: the API's base URL (env PDSERVE_OPENAI_BASE_URL)")
    h.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="openai: /v1/completions (token-id or text prompts) or /v1/chat/completions (text or chat)")
    h.add_argument("--api-key", default=env.get("API_KEY", ""),
                   help="openai: bearer token, when the router checks tokens (env PDSERVE_API_KEY)")
    add_workload_arguments(s)

    c = sub.add_parser("compare", help="the same workload against two deployments: table + goodput plot",
                       description="Run one workload and rate sweep against two routers (--targets) or two "
                                   "`pdserve up` configurations the tool starts one after the other (--launch).")
    c.add_argument("--targets", default=None,
                   help="NAME=HOST:PORT,NAME=HOST:PORT: two (or more) routers that are already running")
    c.add_argument("--launch", action="store_true",
                   help="start each configuration with `pdserve up`, benchmark it, stop it")
    c.add_argument("--up-config", action="append", default=[], metavar="NAME=ARGS",
                   help="a `pdserve up` configuration (repeatable); default: disagg='--prefill 1 --decode 1' "
                        "and colocated='--prefill 0 --decode 2 --role both'")
    c.add_argument("--gpus", default="",
                   help="GPU ids for the default configurations, e.g. 0,1: disagg gets --prefill-gpus 0 "
                        "--decode-gpus 1, colocated --decode-gpus 0,1")
    c.add_argument("--model", default=env.get("MODEL", "default"), help="--model of `pdserve up`")
    c.add_argument("--device", default=env.get("DEVICE", "cpu"), help="--device of `pdserve up` (cpu or cuda)")
    c.add_argument("--up-args", default="", help="more flags for every `pdserve up`, as one string")
    c.add_argument("--router-port", type=int, default=0, help="router port of launched configs (0 = a free one)")
    c.add_argument("--startup-timeout", type=float, default=900.0, help="wait this long for a launched config (s)")
    k = c.add_argument_group("SLO capacity (pdserve/loadtest/capacity.py)")
    k.add_argument("--capacity", action="store_true",
                   help="per deployment, bisect the highest rate at which >= --slo-attainment of the requests meet "
                        "every per-request --slo and the run's ITL p99 its itl_p99_ms bound; starts from the "
                        "--request-rate list, or from --capacity-range")
    k.add_argument("--capacity-range", default=None, metavar="LO:HI", help="start from this bracket of rates (req/s)")
    k.add_argument("--capacity-tolerance", type=float, default=1.0, help="bisect until the bracket is this narrow")
    k.add_argument("--slo-attainment", type=float, default=0.9, help="fraction of requests that must meet the SLOs")
    add_workload_arguments(c)

    r = sub.add_parser("router-overhead", help="the router alone on scripted workers: added latency, fan-out",
                       description="Benchmark the router on this machine against scripted workers.")
    from_ro = r.add_argument_group("router overhead")
    from_ro.add_argument("--num-requests", type=int, default=300, help="sequential requests per latency setup")
    from_ro.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens of the latency requests")
    from_ro.add_argument("--latency-max-tokens", type=int, default=16, help="output tokens of the latency requests")
    from_ro.add_argument("--latency-step-ms", type=float, default=1.0, help="scripted step time for the latency part")
    from_ro.add_argument("--setups", default="colocated,disagg", help="latency setups: colocated, disagg")
    from_ro.add_argument("--idle-measure-s", type=float, default=3.0,
                         help="seconds of the router's idle CPU use measured before the latency requests")
    from_ro.add_argument("--fanout-concurrency", default="16,64,256", help="concurrent streams of the fan-out part")
    from_ro.add_argument("--fanout-step-ms", type=float, default=2.0, help="scripted step time for the fan-out part")
    from_ro.add_argument("--fanout-max-tokens", type=int, default=512, help="output tokens per fan-out stream")
    from_ro.add_argument("--fanout-rounds", type=float, default=2.0,
                         help="fan-out requests = rounds x concurrency (closed loop)")
    from_ro.add_argument("--num-client-procs", type=int, default=1, help="client processes for the fan-out part")
    from_ro.add_argument("--model", default="default", help="router --model (default: the embedded SmolLM2)")
    from_ro.add_argument("--output", default="router_overhead.json", help="the JSON result (in the working directory)")
    from_ro.add_argument("--log-dir", default=None, help="service logs (default: a temp dir)")
    from_ro.add_argument("--skip-latency", action="store_true", help="skip the latency part (one request at a time)")
    from_ro.add_argument("--skip-fanout", action="store_true", help="skip the fan-out part (concurrent streams)")


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        from pdserve.loadtest.runner import run_serve
        return run_serve(args)
    if args.bench_command == "compare":
        from pdserve.loadtest.compare import run_compare
        return run_compare(args)
    if args.bench_command == "router-overhead":
        from pdserve.loadtest.router_overhead import run_router_overhead
        return run_router_overhead(args)
    raise SystemExit(f"unknown bench command {args.bench_command!r}")


def main(argv: list[str] | None = None) -> int:
    """``python -m pdserve.cli.cmd_bench ...`` (the same as ``pdserve bench ...``)."""
    import logging
    import sys
    parser = argparse.ArgumentParser(prog="pdserve bench", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=env.log_level())
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(run(args) or 0)


if __name__ == "__main__":
    import sys
    sys.exit(main())
