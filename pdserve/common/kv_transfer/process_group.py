"""The torch.distributed process-group details under a pair channel: NCCL options (the CTA
cap), abort, timeouts, and the fine timer slack of the completion poll loop."""
from __future__ import annotations

import datetime
import logging
import threading

import torch.distributed as dist

from pdserve.common.parallel.group import abort_process_group

log = logging.getLogger(__name__)


def seconds(value: float) -> datetime.timedelta:
    """A process-group timeout of ``value`` seconds (at least 1 ms)."""
    return datetime.timedelta(seconds=max(0.001, float(value)))


def nccl_available() -> bool:
    return hasattr(dist, "ProcessGroupNCCL") and dist.is_nccl_available()


def cap_ctas(opts, max_ctas: int) -> None:
    """At most ``max_ctas`` CTAs for the communicator: its buffers are per CTA (on nvidia-h200-x2,
    NCCL 2.28: 261 / 517 MiB per pair channel on the sending / receiving GPU by default, 37 / 69 MiB
    with 4; bench/NOTES.md)."""
    config = getattr(opts, "config", None)
    if config is None or not hasattr(config, "max_ctas"):
        log.warning("this torch cannot cap NCCL CTAs per communicator: pair channels use NCCL's default")
        return
    config.max_ctas = max_ctas
    if getattr(config, "min_ctas", 0) > max_ctas:
        config.min_ctas = max_ctas


POLL_SLEEP_S = 10e-6
_slack = threading.local()


def fine_timer_slack() -> None:
    """Linux: 1 us timer slack for this thread's short sleeps (once per thread)."""
    if getattr(_slack, "done", False):
        return
    _slack.done = True
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)   # PR_SET_TIMERSLACK, ns
    except Exception:  # noqa: BLE001 - not Linux: the default slack only costs latency
        pass


def abort_pg(pg, is_cuda: bool) -> None:
    """Best-effort abort of an NCCL group (its kernels and connections); Gloo needs nothing."""
    if not is_cuda:
        return  # Gloo: dropping the last reference closes its connections
    abort_process_group(pg)
