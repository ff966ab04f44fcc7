"""The tensor-parallel rank group: one process per rank, a torch.distributed process group (NCCL
between GPUs, Gloo between CPU processes) made from a TCPStore without a global
``init_process_group`` (so one process may hold several groups: engines, KV pair channels), and
the collectives the sharded layers need. Every collective has the group's timeout, so a rank
that stops answering ends its peers' collectives with an error instead of a hang; a rank that
dies is noticed sooner by the engine's watchdog (pdserve/common/engine/ranks.py)."""
from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class RankFailure(RuntimeError):
    """A rank of a tensor-parallel group died or stopped answering: the group is unusable."""


class RankGroup:
    """``size`` ranks on one host; this process is ``rank``, its tensors live on ``device``."""

    def __init__(self, rank: int, size: int, device: torch.device, pg: Any, timeout_s: float) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.pg = pg
        self.timeout_s = timeout_s

    @classmethod
    def create(cls, store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float) -> RankGroup:
        """Join the group (every rank calls this with the same store); returns once all joined
        and one all-reduce went through (NCCL communicators made before any CUDA graph capture)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        pg: Any
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type == "cuda":
            os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(dist.PrefixStore("tp", store), rank, size, opts)
            eager = getattr(pg, "eager_connect_single_device", None)
            if eager is not None:
                eager(device)
        else:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, size, timeout)
        group = cls(rank, size, device, pg, timeout_s)
        group.all_reduce(torch.ones(1, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        logger.info("tensor-parallel rank %d of %d joined (%s, %s)", rank, size,
                    "nccl" if device.type == "cuda" else "gloo", device)
        return group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        self.pg.allreduce([x], dist.AllreduceOptions()).wait()     # the default op: SUM
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` ([..., n], the same shape everywhere), concatenated in rank order
        along the last dimension: ``[..., size * n]``."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``t`` into every rank's ``t`` (same shape and dtype), in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.pg.broadcast([t], opts).wait()
        return t

    def min_int(self, value: int) -> int:
        """The smallest ``value`` of all ranks (e.g. the KV blocks that fit on every rank)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self.pg.allreduce([t], opts).wait()
        return int(t.item())

    def shutdown(self) -> None:
        """Release the communicators (NCCL) once no collective is coming; best effort."""
        fn = getattr(self.pg, "shutdown", None)
        if fn is not None and self.device.type == "cuda":
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - best effort
                logger.debug("process group shutdown failed: %s", e)

    def abort(self) -> None:
        """Best effort: break the group so that collectives in flight end (NCCL); Gloo's end
        when a peer's connections close."""
        abort_process_group(self.pg)


def abort_process_group(pg: Any) -> None:
    """Best effort: the first of ``pg``'s ``abort``, ``_abort`` and ``shutdown`` that it has and
    that does not raise (failures are logged at debug level)."""
    for name in ("abort", "_abort", "shutdown"):
        fn = getattr(pg, name, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except Exception as e:  # noqa: BLE001 - best effort
            logger.debug("process group %s failed: %s", name, e)


def tp_size(group: RankGroup | None) -> int:
    return group.size if group is not None else 1


def tp_rank(group: RankGroup | None) -> int:
    return group.rank if group is not None else 0
