"""Tensor parallelism's flags: the workers' ``--tensor-parallel-size`` / ``-tp`` reaching the
engine config, and ``pdserve up`` giving each worker its N GPUs (per side, with ``--gpus``)."""
from __future__ import annotations

import pytest

from pdserve import cli
from pdserve.cli import cmd_up
from pdserve.common.serving.worker_args import engine_config_from_args
from pdserve.loadtest import up_layout
from pdserve.loadtest.compare import expected_processes, expected_workers


def _value(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_worker_flag_reaches_the_engine_config():
    for argv in (["decode", "-tp", "2"], ["decode", "--tensor-parallel-size", "2"], ["prefill", "-tp", "2"]):
        args = cli.build_parser().parse_args(argv)
        assert engine_config_from_args(args).tensor_parallel_size == 2
    assert engine_config_from_args(cli.build_parser().parse_args(["decode"])).tensor_parallel_size == 1


def _plan(*flags: str):
    return cmd_up.plan(cli.build_parser().parse_args(["up", *flags]))


def test_up_gives_each_worker_its_gpus():
    *workers, _ = _plan("--gpus", "0,1,2,3", "-tp", "2", "--placement", "colocated")
    assert [(c.name, c.gpu, _value(c.cmd, "--tensor-parallel-size")) for c in workers] == [
        ("decode worker 0", "0,1", "2"), ("decode worker 1", "2,3", "2")]
    # prefill at TP1 on GPU 0, decode at TP2 on GPUs 1 and 2: KV crosses rank to rank
    args = cli.build_parser().parse_args(["up", "--gpus", "0,1,2", "--placement", "disagg",
                                          "--decode-tensor-parallel-size", "2"])
    up_layout.apply(args)
    assert (args.prefill, args.prefill_gpus, args.decode, args.decode_gpus) == (1, "0", 1, "1,2")
    assert up_layout.worker_gpus(args.decode_gpus, 0, 2) == "1,2"
    *workers, _ = _plan("--gpus", "0,1,2", "--placement", "disagg", "--decode-tensor-parallel-size", "2")
    assert [(c.gpu, _value(c.cmd, "--tensor-parallel-size")) for c in workers] == [("1,2", "2"), ("0", None)]
    *workers, _ = _plan("--prefill-tensor-parallel-size", "2")          # CPU: P TP2 -> D TP1
    assert sorted(_value(c.cmd, "--tensor-parallel-size") or "1" for c in workers) == ["1", "2"]
    with pytest.raises(SystemExit, match="tensor-parallel size must be >= 1"):
        _plan("--prefill-tensor-parallel-size", "-1")
    *workers, _ = _plan("--decode-gpus", "0,1,2,3", "--decode", "2", "--prefill", "0", "--role", "both",
                        "--decode-tensor-parallel-size", "2")
    assert [c.gpu for c in workers] == ["0,1", "2,3"]
    *workers, _ = _plan("--prefill", "0", "--role", "both", "-tp", "3")       # CPU: the ranks are processes
    assert [_value(c.cmd, "--tensor-parallel-size") for c in workers] == ["3"]
    (worker,) = _plan("--gpus", "0,1", "-tp", "2")[:-1]                # fleet of one worker: nothing crosses
    assert (worker.gpu, _value(worker.cmd, "--role")) == ("0,1", "both")
    assert expected_workers("--gpus 0,1,2,3 -tp 2") == (2, 2)
    assert expected_processes("--gpus 0,1,2,3 -tp 2") == 2 + 4
    assert expected_processes("--prefill 0 --role both -tp 3") == 2 + 3
    with pytest.raises(SystemExit, match="3 GPUs .* workers of 2"):
        _plan("--gpus", "0,1,2", "-tp", "2")
