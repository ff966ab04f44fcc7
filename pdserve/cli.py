"""The ``pdserve`` command: services (router / prefill / decode / up) and clients (generate, bench).

Each subcommand lives in its own module and is imported only when it runs, so ``pdserve
--help`` stays fast and a client never loads torch.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from common import env

# subcommand -> (module, help); each module defines add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "generate": ("pdserve.cmd_generate", "generate text: through the router, or --offline in-process"),
    "router": ("router.main", "run the router service (public gRPC API)"),
    "prefill": ("prefill_worker.main", "run a prefill worker"),
    "decode": ("decode_worker.main", "run a decode worker (role decode, or --role both)"),
    "up": ("pdserve.cmd_up", "start router + prefill + decode locally as separate processes"),
    "bench": ("pdserve.cmd_bench", "benchmarks: serve (load-test a router), compare (two deployments), router-overhead"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    parser.add_argument("--log-level", default=env.log_level(), help="logging level (env PDSERVE_LOG_LEVEL)")
    parser.add_argument("--log-format", choices=("text", "json"), default=env.log_format(),
                        help="json: one JSON object per line, with request and trace ids (env PDSERVE_LOG_FORMAT)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:  # a service not built into this install
            p.set_defaults(_missing=str(e))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from common.telemetry import configure_logging
    configure_logging(args.log_level, args.log_format)
    if getattr(args, "_missing", None):
        logging.error("%s is not available: %s", args.command, args._missing)
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
