"""The ``pdserve`` command: services (router / prefill / decode / up) and clients (generate, bench).

Each subcommand lives in its own module, imported only when that subcommand is parsed (its
arguments added then), so ``pdserve --help`` imports none and a client never loads torch. A
domain or gRPC error ends a command with one line on stderr and the exit code of
:mod:`pdserve.cli.errors`; ``--debug`` keeps tracebacks.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Any

from pdserve.common import env

# subcommand -> (module, help); each module defines add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "generate": ("pdserve.cli.cmd_generate", "generate text: through the router, or --offline in-process"),
    "router": ("pdserve.router.main", "run the router service (public gRPC API)"),
    "prefill": ("pdserve.prefill_worker.main", "run a prefill worker"),
    "decode": ("pdserve.decode_worker.main", "run a decode worker (role decode, or --role both)"),
    "up": ("pdserve.cli.cmd_up", "start router + prefill + decode locally as separate processes"),
    "bench": ("pdserve.cli.cmd_bench",
              "benchmarks: serve (load-test a router), compare (two deployments), router-overhead"),
}


EPILOG = ("exit codes: 0 ok, 1 failure, 2 wrong flag or request field, 3 service unreachable or port "
          "in use, 4 deadline exceeded, 130 interrupted")


def _add_debug(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument("--debug", action="store_true", default=default,
                   help="show the traceback of an error instead of one line")


class _Subcommand(argparse.ArgumentParser):
    """A subcommand's parser that takes its arguments from its module on first use.

    ``module`` names the module whose ``add_arguments(parser)`` fills it; it is imported the first
    time this parser parses, formats its help or usage, or is walked by :func:`subparsers`, so
    building the ``pdserve`` parser imports no subcommand and ``pdserve X`` imports only X. A module
    missing from this install leaves ``_missing`` (its error) in the parsed namespace. Parsers
    created below it (a subcommand's own subcommands) get ``module=None``: nothing to import."""

    def __init__(self, *args: Any, module: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending_module = module

    def fill(self) -> None:
        """Add the module's arguments once (later calls do nothing); every parser below it shows defaults."""
        module, self._pending_module = self._pending_module, None
        if module is None:
            return
        try:
            importlib.import_module(module).add_arguments(self)
        except ModuleNotFoundError as e:  # a service not built into this install
            self.set_defaults(_missing=str(e))
        for p in subparsers(self):
            p.formatter_class = argparse.ArgumentDefaultsHelpFormatter

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.fill()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self.fill()
        return super().format_usage()

    def format_help(self) -> str:
        self.fill()
        return super().format_help()


def subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and every parser below it (subcommands, their subcommands), each filled with its arguments."""
    if isinstance(parser, _Subcommand):
        parser.fill()
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found += subparsers(child)
    return found


def build_parser() -> argparse.ArgumentParser:
    """The ``pdserve`` parser: global options and every subcommand's name and help.

    A subcommand's own arguments are added (its module imported) only when that subcommand is
    parsed or its help shown, so ``build_parser().parse_args(["router", ...])`` imports the
    router's module alone and ``pdserve --help`` imports none; :func:`subparsers` fills all."""
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.",
                                     epilog=EPILOG, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--log-level", default=env.log_level(), help="logging level (env PDSERVE_LOG_LEVEL)")
    parser.add_argument("--log-format", choices=("text", "json"), default=env.log_format(),
                        help="json: one JSON object per line, with request and trace ids (env PDSERVE_LOG_FORMAT)")
    _add_debug(parser, False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Subcommand)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=EPILOG, module=module,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)   # every --help shows the defaults
        p.set_defaults(_module=module)
        _add_debug(p, argparse.SUPPRESS)        # also after the subcommand: `pdserve generate ... --debug`
    return parser


def run_command(args: argparse.Namespace) -> int:
    """Run the chosen subcommand; a domain error becomes one line on stderr and its exit code."""
    from pdserve.cli import errors as cli_errors
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except KeyboardInterrupt:
        if args.debug:
            raise
        return cli_errors.EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - sorted below: a domain error or a bug
        described = cli_errors.describe(e)
        if args.debug or described is None:
            raise
        sys.stderr.write(cli_errors.error_line(args.command, *described) + "\n")
        return cli_errors.exit_code(described[0])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pdserve.common.telemetry import configure_logging
    configure_logging(args.log_level, args.log_format)
    if getattr(args, "_missing", None):
        logging.error("%s is not available: %s", args.command, args._missing)
        return 2
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
