"""The ``pdserve`` command as a new user meets it: errors are one line on stderr with a status
name, a hint and a non-zero exit code (no traceback unless ``--debug``); every flag of every
subcommand has help, and help shows the defaults. Commands run as subprocesses."""
from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import subprocess
import sys

import pytest

from pdserve import cli
from pdserve.cli import errors as cli_errors
from pdserve.loadtest.ports import free_port, free_port_range
from pdserve.loadtest.procs import ROOT

TIMEOUT_S = 120


def pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def assert_one_line(proc: subprocess.CompletedProcess, code: int, *words: str) -> str:
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# ---- errors -----------------------------------------------------------------------------

def test_bad_sampling_flag_is_one_line_invalid_argument():
    line = assert_one_line(pdserve("generate", "x", "--top-p", "2"), cli_errors.EXIT_INVALID,
                           "pdserve generate: INVALID_ARGUMENT", "top_p")
    assert "fix the flag" in line


def test_unreachable_router_is_one_line_unavailable():
    port = free_port()      # nothing listens there
    line = assert_one_line(pdserve("generate", "x", "--router", f"127.0.0.1:{port}", "--timeout", "10"),
                           cli_errors.EXIT_UNAVAILABLE, "pdserve generate: UNAVAILABLE")
    assert "pdserve up" in line and "--router" in line


def test_debug_keeps_the_traceback():
    proc = pdserve("generate", "x", "--top-p", "2", "--debug")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "top_p" in proc.stderr


@pytest.mark.parametrize("flag", ["--base-port", "--router-port"])
def test_up_with_a_port_in_use_is_one_line_naming_the_flag(flag):
    base, router = free_port_range(4), free_port()
    taken = base + 2 if flag == "--base-port" else router      # the prefill worker's port / the router's
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        proc = pdserve("up", "--base-port", str(base), "--router-port", str(router), "--http-port", "0",
                       "--startup-timeout", "5")
    line = assert_one_line(proc, cli_errors.EXIT_UNAVAILABLE, "pdserve up: UNAVAILABLE",
                           f"cannot bind 127.0.0.1:{taken}", f"pass another {flag}")
    assert ("prefill worker" if flag == "--base-port" else "router") in line


def test_describe_maps_grpc_and_domain_errors():
    from pdserve.common.grpc_utils import InvalidArgument, Unavailable
    assert cli_errors.describe(InvalidArgument("top_p", "must be in (0, 1]")) == (
        "INVALID_ARGUMENT", "top_p: must be in (0, 1]")
    assert cli_errors.describe(Unavailable("down")) == ("UNAVAILABLE", "down")
    assert cli_errors.describe(KeyError("bug")) is None        # a bug keeps its traceback
    line = cli_errors.error_line("generate", "DEADLINE_EXCEEDED", "deadline\npassed")
    assert "\n" not in line and "--timeout" in line
    bind = cli_errors.error_line("prefill", "UNAVAILABLE", "cannot bind 127.0.0.1:50052: in use")
    assert "pass another --port" in bind and "pdserve up" in bind


# ---- help -------------------------------------------------------------------------------

def _flags(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        yield action


def test_every_flag_of_every_subcommand_has_help():
    parsers = cli.subparsers(cli.build_parser())
    assert len(parsers) > len(cli.SUBCOMMANDS)          # bench's subcommands are walked too
    missing = [f"{p.prog} {'/'.join(a.option_strings) or a.dest}" for p in parsers for a in _flags(p)
               if not a.help or a.help == argparse.SUPPRESS or not a.help.strip()]
    assert not missing, f"flags without help: {missing}"
    assert all(p.formatter_class is argparse.ArgumentDefaultsHelpFormatter for p in parsers)


@pytest.mark.parametrize("command", ["up", "generate", "router", "decode"])
def test_help_shows_defaults(command):
    proc = pdserve(command, "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "(default:" in text and "--debug" in text
    if command == "up":
        assert "(default: 50051)" in text and "--metrics-port" in text and "--max-num-seqs" in text
    if command == "generate":
        assert "(default: 128)" in text and "--quiet" in text


# ---- imports: a subcommand loads its own module only, and no client or router loads torch ------

IMPORT_PROBE = """
import json, sys
from pdserve import cli
seen = {}
cli.build_parser()
seen["none"] = sorted(m for m, _ in cli.SUBCOMMANDS.values() if m in sys.modules)
cli.build_parser().parse_args(["router"])
seen["router"] = sorted(m for m, _ in cli.SUBCOMMANDS.values() if m in sys.modules)
for argv in (["up"], ["generate", "hi"], ["bench", "serve"]):
    cli.build_parser().parse_args(argv)
seen["torch"] = "torch" in sys.modules
print(json.dumps(seen))
"""


def test_build_parser_imports_only_the_chosen_subcommand_and_no_torch():
    # a fresh process: this one's own imports (torch among them) must not count
    proc = subprocess.run([sys.executable, "-c", IMPORT_PROBE], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["none"] == []                               # `pdserve --help` imports no subcommand
    assert seen["router"] == ["pdserve.router.main"]
    assert seen["torch"] is False                           # router, up, generate, bench serve


def test_up_mirrors_the_engine_defaults():
    from pdserve.cli import cmd_up
    from pdserve.common.config import EngineConfig
    from pdserve.common.serving.worker_args import DEFAULT_BUDGET
    engine = EngineConfig()
    for f in dataclasses.fields(cmd_up.EngineDefaults):
        assert getattr(cmd_up.ENGINE_DEFAULTS, f.name) == getattr(engine, f.name), f.name
    assert cmd_up.DEFAULT_BUDGET == DEFAULT_BUDGET


# ---- up: the command lines it starts ------------------------------------------------------

def test_up_passes_metrics_ports_and_worker_flags():
    from pdserve.cli import cmd_up
    args = cli.build_parser().parse_args(["up", "--metrics-port", "9100", "--max-num-seqs", "8",
                                          "--max-model-len", "2048", "--enforce-eager", "--base-port", "50100"])
    children = cmd_up.plan(args)
    assert [c.name for c in children] == ["decode worker 0", "prefill worker 0", "router"]

    def value(cmd, flag):
        return cmd[cmd.index(flag) + 1]
    assert [value(c.cmd, "--metrics-port") for c in children] == ["9101", "9102", "9100"]
    for worker in children[:2]:
        assert value(worker.cmd, "--max-num-seqs") == "8" and value(worker.cmd, "--max-model-len") == "2048"
        assert "--enforce-eager" in worker.cmd and "--dtype" not in worker.cmd     # unset: the worker's default
    assert children[2].ports == {50051: "--router-port", 8000: "--http-port", 9100: "--metrics-port"}
    off = cmd_up.plan(cli.build_parser().parse_args(["up"]))
    assert all(value(c.cmd, "--metrics-port") == "0" for c in off)
    by_role = cmd_up.plan(cli.build_parser().parse_args(
        ["up", "--role", "both", "--extra-worker-args=--max-num-seqs 8",
         "--extra-decode-args=--max-num-batched-tokens 512", "--extra-prefill-args=--max-num-batched-tokens 8192"]))
    assert [value(c.cmd, "--max-num-batched-tokens") for c in by_role[:2]] == ["512", "8192"]
    assert all(value(c.cmd, "--max-num-seqs") == "8" for c in by_role[:2])
    assert "--max-num-batched-tokens" not in by_role[2].cmd      # the router gets neither


def test_up_lays_out_one_worker_per_gpu():
    from pdserve.cli import cmd_up
    from pdserve.loadtest.compare import expected_workers

    def value(cmd, flag):
        return cmd[cmd.index(flag) + 1]

    def up(*flags):
        return cmd_up.plan(cli.build_parser().parse_args(["up", "--gpus", "0,1", *flags]))
    *workers, router = up("--placement", "colocated")
    assert [(c.name, c.gpu) for c in workers] == [("decode worker 0", "0"), ("decode worker 1", "1")]
    assert all(value(c.cmd, "--role") == "both" and value(c.cmd, "--device") == "cuda" for c in workers)
    assert all(value(c.cmd, "--max-num-batched-tokens") == "512" for c in workers)
    assert value(router.cmd, "--pd-policy") == "never"
    *workers, router = up("--placement", "disagg", "--extra-router-args=--pd-policy adaptive")
    assert [(c.name, c.gpu) for c in workers] == [("decode worker 0", "1"), ("prefill worker 0", "0")]
    assert router.cmd[router.cmd.index("--pd-policy"):][:4] == ["--pd-policy", "always", "--pd-policy", "adaptive"]
    *workers, router = up()                                  # fleet, the default
    assert all(value(c.cmd, "--max-num-batched-tokens") == "8192" and "--tpot-target-ms" not in c.cmd
               and value(c.cmd, "--max-mixed-batched-tokens") == "512" for c in workers)
    assert value(router.cmd, "--pd-policy") == "fleet"
    assert expected_workers("--gpus 0,1") == (2, 2) and expected_workers("--gpus 0,1,2,3 --placement disagg") == (2, 2)
    with pytest.raises(SystemExit, match="--role"):
        up("--role", "both")
    with pytest.raises(SystemExit, match="two GPUs"):
        cmd_up.plan(cli.build_parser().parse_args(["up", "--gpus", "0", "--placement", "disagg"]))


def test_up_fails_fast_when_a_service_exits():
    base, router = free_port_range(4), free_port()
    proc = pdserve("up", "--base-port", str(base), "--router-port", str(router), "--http-port", "0",
                   "--extra-worker-args=--no-such-flag")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == cli_errors.EXIT_UNAVAILABLE, proc.stderr
    assert "pdserve up: UNAVAILABLE" in last and "worker 0 exited with code 2 during start-up" in last, last
    assert "Traceback" not in proc.stderr
