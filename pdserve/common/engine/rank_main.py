"""A tensor-parallel rank other than 0 (started by ranks.RankLeader): joins the rank group,
builds its ModelRunner (its shard of the model), then runs what rank 0 mirrors to it until
rank 0 says exit or goes away (ranks.py has the contract)."""
from __future__ import annotations

import datetime
import importlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from pdserve.common import env
from pdserve.common.config import EngineConfig
from pdserve.common.context import forward_context
from pdserve.common.engine.model_runner import ModelRunner, resolve_device
from pdserve.common.engine.rank_packet import receive_forward
from pdserve.common.engine.ranks import rank_device, read_frame, source_from_json
from pdserve.common.parallel import RankGroup
from pdserve.common.telemetry import configure_logging

logger = logging.getLogger(__name__)
CALLS = ("allocate_kv_cache", "capture_cuda_graphs", "copy_blocks")    # the runner methods rank 0 may ask for


def _watch_parent(leader_pid: int) -> None:
    """Exit when rank 0 is gone (this process was re-parented), even inside a collective."""
    while os.getppid() == leader_pid:
        time.sleep(0.5)
    logger.error("rank 0 (pid %d) is gone: exiting", leader_pid)
    os._exit(1)


@torch.inference_mode()
def _forward(runner: ModelRunner, header: dict) -> None:
    assert runner.group is not None
    input_ids, positions, ctx, rows = receive_forward(runner.group, header, runner.device)
    mode = header["mode"]
    if mode == "decode_graph" and runner.graph_runner is not None:
        runner.graph_runner.run(input_ids, positions, ctx)
    elif mode == "mixed_graph" and runner.mixed_graph_runner is not None and rows is not None:
        runner.mixed_graph_runner.run(input_ids, positions, ctx, rows)
    elif mode == "eager":
        with forward_context(ctx):
            runner.model(input_ids, positions)
    else:
        raise RuntimeError(f"rank {runner.group.rank} cannot run a forward of mode {mode!r}")


@torch.inference_mode()
def _logits(runner: ModelRunner, header: dict) -> None:
    assert runner.group is not None
    dtype = getattr(torch, header["dtype"].removeprefix("torch."))
    hidden = torch.empty(header["n"], runner.model_config.hidden_size, dtype=dtype, device=runner.device)
    runner.group.broadcast(hidden)
    runner.model.get_submodule("lm_head")(hidden)


def load_extensions(spec: dict, runner: ModelRunner) -> dict[str, Any]:
    """The extensions rank 0 names (ranks.register_rank_extension), by the message kinds they take."""
    by_kind: dict[str, Any] = {}
    for target in spec.get("extensions", []):
        module, name = target.split(":")
        ext = getattr(importlib.import_module(module), name)(spec["rank"], spec["store_port"],
                                                             lambda: runner.kv_cache, spec["timeout_s"])
        by_kind.update(dict.fromkeys(ext.kinds, ext))
    return by_kind


def follow(runner: ModelRunner, stdin, extensions: dict[str, Any] | None = None) -> None:
    """Run rank 0's messages in order until it says exit or its pipe closes."""
    extensions = extensions or {}
    while (message := read_frame(stdin)) is not None:
        kind = message["k"]
        if kind in extensions:
            extensions[kind].handle(message)
        elif kind == "forward":
            _forward(runner, message)
        elif kind == "logits":
            _logits(runner, message)
        elif kind == "call" and message["m"] in CALLS:
            getattr(runner, message["m"])(*message["a"])
        elif kind == "exit":
            return
        else:
            raise RuntimeError(f"unknown message from rank 0: {message!r}")


def main() -> int:
    stdin = sys.stdin.buffer
    spec = read_frame(stdin)
    if spec is None:
        return 1
    rank = spec["rank"]
    # a rank lives as long as rank 0 (which stops it, or whose exit ends it): a Ctrl-C or a
    # SIGTERM sent to the whole process group must not cut a worker's graceful drain short
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(env.log_level())
    threading.Thread(target=_watch_parent, args=(spec["leader_pid"],), daemon=True).start()
    try:
        torch.set_num_threads(spec["threads"])
        config = EngineConfig(**spec["config"])
        device = rank_device(resolve_device(config.device), rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", spec["store_port"], spec["size"], False,
                              timeout=datetime.timedelta(seconds=spec["timeout_s"]))
        store.set(f"joined/{rank}", "1")
        group = RankGroup.create(store, rank, spec["size"], device, spec["timeout_s"])
        runner = ModelRunner(config, source_from_json(spec["source"]), group)
        extensions = load_extensions(spec, runner)
        try:
            follow(runner, stdin, extensions)
        finally:
            for ext in set(extensions.values()):
                ext.close()
    except Exception:  # noqa: BLE001 - any error ends this rank; rank 0's watchdog sees the exit
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
