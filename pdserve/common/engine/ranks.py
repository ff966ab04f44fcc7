"""The ranks of a tensor-parallel engine (``tensor_parallel_size`` N > 1), seen from rank 0.

Rank 0 is this process: it runs the scheduler, samples, and (in a worker) speaks gRPC. It starts
one process per other rank (``python -m pdserve.common.engine.rank_main``, in this process's
process group, so that stopping a worker's group stops its ranks too) and every rank builds the
same ModelRunner over its shard of the model (pdserve/common/parallel). Rank 0 then mirrors to the others, in order:

- the runner calls every rank makes (``allocate_kv_cache``: the pool is the blocks that fit on
  every rank; ``capture_cuda_graphs``);
- every model forward (eager, or a decode / mixed-step graph replay: the mode is rank 0's
  choice, so the collectives match) and every LM-head call (the logits of hidden rows it
  broadcasts).

Each message is a length-prefixed JSON header on the follower's stdin, then its tensors by one
broadcast over the rank group (rank_packet.py). No pickle. Messages of other kinds go to the
extensions a worker registered before its engine starts (``register_rank_extension``: the KV
transfers between tensor-parallel workers, pdserve/common/kv_transfer/rank_agent.py); any thread
may send (frames are written whole, in the order sent).

Failure: a rank that exits ends the engine. Rank 0's watchdog notices at once; in a worker
(``exit_on_rank_failure``) the whole process then exits, so the router sees one dead worker; in
process (the offline API) the other ranks are stopped and every later call raises
``RankFailure``. A follower exits when rank 0 goes (its stdin closes, its parent changes).
Collectives time out after ``PDSERVE_TP_TIMEOUT_S`` (a rank alive but stuck).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from pdserve.common import env
from pdserve.common.config import EngineConfig, ModelConfig
from pdserve.common.context import ForwardContext, get_forward_context
from pdserve.common.engine.rank_packet import broadcast_payload, forward_header
from pdserve.common.loader import ModelSource
from pdserve.common.parallel import RankFailure, RankGroup

logger = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 180.0       # a collective (and the ranks' start) may take this long
_FRAME = struct.Struct(">I")
_exit_on_failure = False
_extensions: list[str] = []


def register_rank_extension(target: str) -> None:
    """Every rank of the engines started from now on builds ``"module:Class"``
    (``Class(rank, store_port, pool, timeout_s)``: ``pool()`` the rank's KV pool, ``store_port``
    the rank group's store on 127.0.0.1) and hands it the messages whose kind is in its
    ``kinds`` (``handle(message)``, on the command loop: it must not block)."""
    if target not in _extensions:
        _extensions.append(target)


def exit_on_rank_failure(on: bool = True) -> None:
    """Workers: a rank's death ends this process (one dead worker to the router)."""
    global _exit_on_failure
    _exit_on_failure = on


def timeout_s() -> float:
    return env.get_float("TP_TIMEOUT_S", DEFAULT_TIMEOUT_S)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: GPU ``base + rank`` of those this process sees (``cuda:base``, or
    ``cuda`` = 0; rank 0 keeps ``device`` as given); the CPU for every rank of a CPU engine."""
    if device.type != "cuda" or rank == 0:
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def write_frame(stream: IO[bytes], message: dict) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    stream.write(_FRAME.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: IO[bytes]) -> dict | None:
    """The next message, or None when the writer is gone."""
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        return None
    (n,) = _FRAME.unpack(head)
    data = stream.read(n)
    return json.loads(data) if len(data) == n else None


def source_to_json(source: ModelSource) -> dict:
    return {"config": dataclasses.asdict(source.config),
            "checkpoint_dir": str(source.checkpoint_dir) if source.checkpoint_dir is not None else None,
            "tokenizer_dir": str(source.tokenizer_dir) if source.tokenizer_dir is not None else None}


def source_from_json(d: dict) -> ModelSource:
    cfg = dict(d["config"], eos_token_ids=tuple(d["config"]["eos_token_ids"]))
    return ModelSource(ModelConfig(**cfg), Path(d["checkpoint_dir"]) if d["checkpoint_dir"] else None,
                       Path(d["tokenizer_dir"]) if d["tokenizer_dir"] else None)


class RankLeader:
    """Rank 0's side: the other ranks' processes, the group, the mirroring (module docstring)."""

    def __init__(self, config: EngineConfig, source: ModelSource, device: torch.device) -> None:
        self.size = config.tensor_parallel_size
        self.timeout_s = timeout_s()
        self.failed: str | None = None
        self.closing = False
        self._paused = 0
        self.counts: collections.Counter[str] = collections.Counter()   # mirrored forwards by mode
        self._lock = threading.Lock()
        self._write = threading.Lock()        # one frame at a time on every pipe, from any thread
        self.group: RankGroup | None = None
        # CPU ranks share this host's cores (oversubscribed intra-op threads spin against each
        # other: 10x slower steps measured on 2 cores); restored on close
        self._threads = torch.get_num_threads()
        threads = max(1, self._threads // self.size) if device.type == "cpu" else self._threads
        torch.set_num_threads(threads)
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, True,
                                   timeout=datetime.timedelta(seconds=self.timeout_s), wait_for_workers=False)
        spec = {"config": dataclasses.asdict(config), "source": source_to_json(source), "size": self.size,
                "store_port": self.store.port, "timeout_s": self.timeout_s, "leader_pid": os.getpid(),
                "threads": threads, "extensions": list(_extensions)}
        self.procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, self.size):
                self.procs.append(self._spawn(dict(spec, rank=rank)))
            for rank, proc in enumerate(self.procs, start=1):
                threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-rank{rank}-watchdog",
                                 daemon=True).start()
            self._wait_joined()
            self.group = RankGroup.create(self.store, 0, self.size, device, self.timeout_s)
        except BaseException:
            self.close()
            raise

    # ---- processes ------------------------------------------------------------------------
    def _spawn(self, spec: dict) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parents[3])       # the directory holding the package
        path = os.environ.get("PYTHONPATH")
        child_env = dict(os.environ, PYTHONPATH=root + (os.pathsep + path if path else ""))
        proc = subprocess.Popen([sys.executable, "-m", "pdserve.common.engine.rank_main"], stdin=subprocess.PIPE,
                                env=child_env)
        assert proc.stdin is not None
        write_frame(proc.stdin, spec)
        return proc

    def _wait_joined(self) -> None:
        keys = [f"joined/{r}" for r in range(1, self.size)]
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check(keys):
            self._raise_if_failed()
            if time.monotonic() > deadline:
                raise RankFailure(f"tensor-parallel ranks did not start within {self.timeout_s:.0f}s "
                                  "(PDSERVE_TP_TIMEOUT_S)")
            time.sleep(0.05)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self.closing:
            self._rank_failed(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")

    def _rank_failed(self, reason: str) -> None:
        with self._lock:
            if self.failed is not None or self.closing:
                return
            self.failed = reason
        logger.error("%s: the engine's %d ranks cannot go on", reason, self.size)
        self._kill_all()
        if _exit_on_failure:
            logger.critical("stopping this worker (one of its ranks is gone)")
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(1)
        if self.group is not None:
            self.group.abort()

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()

    def _raise_if_failed(self) -> None:
        if self.failed is not None:
            raise RankFailure(self.failed)

    def send(self, message: dict) -> None:
        """``message`` to every other rank, in order; RankFailure when one is gone."""
        self._raise_if_failed()
        try:
            with self._write:
                for proc in self.procs:
                    assert proc.stdin is not None
                    write_frame(proc.stdin, message)
        except (BrokenPipeError, OSError) as e:
            raise RankFailure(self.failed or f"a tensor-parallel rank is gone ({e})") from None

    # ---- what every rank runs -------------------------------------------------------------
    def call(self, method: str, *args: Any) -> None:
        """Every other rank runs ``runner.method(*args)`` (rank 0 runs its own right after)."""
        self.send({"k": "call", "m": method, "a": list(args)})

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Rank 0's forwards are not mirrored (every rank runs the same code meanwhile: a capture)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def mirror(self, model: torch.nn.Module) -> None:
        """Mirror ``model``'s eager forwards and its LM head's calls (rank 0's model)."""
        model.register_forward_pre_hook(self._on_forward)
        model.get_submodule("lm_head").register_forward_pre_hook(self._on_logits)

    def forward(self, mode: str, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                rows: torch.Tensor | None = None) -> None:
        """The other ranks run this forward too (``mode``: eager, decode_graph, mixed_graph)."""
        if self._paused:
            return
        assert self.group is not None
        self.counts[mode] += 1
        self.send(forward_header(mode, input_ids, positions, ctx, rows))
        broadcast_payload(self.group, input_ids, positions, ctx, rows)

    def graph_hook(self, mode: str) -> Callable[..., None]:
        """A graph runner's ``before_run``: its replays mirrored as forwards of ``mode``."""
        def hook(input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                 rows: torch.Tensor | None = None) -> None:
            self.forward(mode, input_ids, positions, ctx, rows)
        return hook

    def _on_forward(self, module: torch.nn.Module, args: tuple) -> None:
        input_ids, positions = args
        self.forward("eager", input_ids, positions, get_forward_context())

    def _on_logits(self, module: torch.nn.Module, args: tuple) -> tuple | None:
        if self._paused:
            return None
        assert self.group is not None
        hidden = args[0].contiguous()
        self.send({"k": "logits", "n": hidden.shape[0], "dtype": str(hidden.dtype)})
        self.group.broadcast(hidden)
        return (hidden,)

    def close(self) -> None:
        """Stop the other ranks (they exit on the message, or when their stdin closes)."""
        with self._lock:
            if self.closing:
                return
            self.closing = True
        for proc in self.procs:
            with contextlib.suppress(OSError, ValueError):
                assert proc.stdin is not None
                if self.failed is None:
                    write_frame(proc.stdin, {"k": "exit"})
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.group is not None and self.failed is None:
            self.group.shutdown()
        torch.set_num_threads(self._threads)
