"""Rank 0's side of a KV transfer where either worker is tensor-parallel: it orders the other
ranks' shares (rank_agent.py), moves its own routes, and folds every rank's outcome into the one
result the worker's handoff code sees (a ``Pending`` on the prefill side, a Future of
``Received`` on the decode side).

Every route's channel uses the epoch and secret of route (0, 0), which the prefill worker's rank 0
keeps (``KvSender.next_epoch`` / ``pair_secret`` of ``plan.receiver_name(0)``) and PushKV carries;
a failure of any route bumps it (``mark_broken``), so the next transfer builds fresh channels on
every route. The data never passes through rank 0 unless rank 0 owns the heads.
"""
from __future__ import annotations

import datetime
import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
import torch.distributed as dist

from .blocks import head_bytes
from .errors import KvTransferError
from .rank_agent import RECV, SEND, RankPlan, report_key
from .receiver import KvReceiver
from .sender import KvSender, PendingSend
from .transfer import FirstTokenRef
from .transport import Received

_WAITERS = 16       # transfers whose ranks' reports rank 0 awaits at once (more queue)


class RankLink(Protocol):
    """What rank 0 needs of its ranks (``pdserve.common.engine.ranks.RankLeader`` is one):
    ``send`` a message to every other rank, in order; the rank group's store (its ``port``)."""
    store: dist.TCPStore

    def send(self, message: dict) -> None: ...


class RankReports:
    """The other ranks' reports of their transfers, read from the rank group's store (a client
    of its own per waiting thread)."""

    def __init__(self, link: RankLink | None) -> None:
        self.link = link
        self._keys = itertools.count()
        self._local = threading.local()
        self.pool = ThreadPoolExecutor(_WAITERS, thread_name_prefix="kv-rank-reports")

    def order(self, kind: str, plan: RankPlan, ranks: list[int]) -> str:
        """Send ``plan`` to the ranks (all read it; ``ranks`` act) and return its report key."""
        key = f"kv/{kind}/{next(self._keys)}"
        if ranks:
            assert self.link is not None, "a tensor-parallel route without the worker's ranks"
            self.link.send(plan.message(kind, key))
        return key

    def wait(self, key: str, ranks: list[int], timeout: float) -> str:
        """The first error the ranks reported for ``key`` ("" if none), blocking up to
        ``timeout`` s (then an error naming the ranks)."""
        if not ranks:
            return ""
        assert self.link is not None
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = dist.TCPStore("127.0.0.1", self.link.store.port, is_master=False,
                                                         timeout=datetime.timedelta(seconds=timeout))
        keys = [report_key(key, r) for r in ranks]
        try:
            client.wait(keys, datetime.timedelta(seconds=timeout))
        except Exception:  # noqa: BLE001 - a rank that never reports (gone or stuck)
            return f"tensor-parallel rank(s) {ranks} did not finish their KV transfer within {timeout:.0f}s"
        errors = [client.get(k).decode() for k in keys]
        for k in keys:
            client.delete_key(k)
        return next((f"rank {r}: {e}" for r, e in zip(ranks, errors) if e), "")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _ranks_of(plan: RankPlan, side: str) -> list[int]:
    return sorted({(r.src if side == SEND else r.dst) for r in plan.routes} - {0})


class FanoutSend:
    """A started tensor-parallel send (the ``Pending`` protocol): ``wait`` ends once every rank's
    routes crossed, or raises ``KvTransferError`` with the route (0, 0) epoch bumped."""

    def __init__(self, sender: KvSender, reports: RankReports, plan: RankPlan, key: str, own: list[PendingSend],
                 error: str, num_bytes: int) -> None:
        self._sender, self._reports, self._plan, self._key = sender, reports, plan, key
        self._own, self._error, self.num_bytes = own, error, num_bytes
        self._t0 = time.perf_counter()
        self._result: tuple[int, float] | None = None
        self._done = threading.Lock()

    def wait(self) -> tuple[int, float]:
        with self._done:
            if self._result is None:
                error = self._error
                for p in self._own:
                    try:
                        p.wait()
                    except KvTransferError as e:
                        error = error or str(e)
                timeout = 2 * self._plan.timeout + 5
                error = self._reports.wait(self._key, _ranks_of(self._plan, SEND), timeout) or error
                if error:
                    self._error = error
                    self._sender.mark_broken(self._plan.receiver_name(0), f"tensor-parallel send failed: {error}")
                    raise KvTransferError(f"KV send {self._plan.prefill_id}->{self._plan.decode_id} epoch "
                                          f"{self._plan.epoch} failed: {error}")
                self._result = (self.num_bytes, time.perf_counter() - self._t0)
            return self._result


def _route_bytes(kv_cache: torch.Tensor, plan: RankPlan) -> int:
    """Bytes every route moves (a KV head's share of a block times the heads shipped)."""
    return len(plan.block_ids) * head_bytes(kv_cache, (0, 1)) * sum(r.num_heads for r in plan.routes)


def start_send(sender: KvSender, reports: RankReports, plan: RankPlan, kv_cache: torch.Tensor, *,
               ready_event: torch.cuda.Event | None = None, first_token: FirstTokenRef | None = None) -> FanoutSend:
    """Prefill rank 0: order the other ranks' sends, start its own (the first token rides on
    route (0, 0)); ``plan.block_ids`` are this pool's blocks. Call after PushKV, under the pair's
    lock (PushKV order == send order on every route). Failures surface from ``wait``."""
    key = reports.order(SEND, plan, _ranks_of(plan, SEND))
    own, error = [], ""
    try:
        for route in plan.sends_of(0):
            dst = plan.receiver_name(route.dst)
            with sender.lock(dst):
                if route.dst != 0:
                    sender.adopt_epoch(dst, plan.epoch, plan.secret)
                own.append(sender.start_send(dst, plan.store_address, plan.epoch, kv_cache, list(plan.block_ids),
                                             ready_event=ready_event, heads=route.src_heads,
                                             first_token=first_token if route.dst == 0 else None))
    except KvTransferError as e:
        error = str(e)
    return FanoutSend(sender, reports, plan, key, own, error, _route_bytes(kv_cache, plan))


def post(receiver: KvReceiver, reports: RankReports, plan: RankPlan, *, with_first_token: bool) -> Future:
    """Decode rank 0: post its own receives (the first token rides on route (0, 0)), then order
    the other ranks'; ``plan.block_ids`` are this pool's blocks. A Future of ``Received`` (its
    event already waited: ``event`` None) once every rank's heads landed, or of
    ``KvTransferError``. A refused post of rank 0 raises ``KvTransferError`` at once (nothing
    ordered)."""
    own = [receiver.post(plan.sender_name(r.src), plan.epoch, list(plan.block_ids), secret=plan.secret,
                         heads=r.dst_heads, with_first_token=with_first_token and r.src == 0)
           for r in plan.receives_of(0)]
    ranks = _ranks_of(plan, RECV)
    key = reports.order(RECV, plan, ranks)
    result: Future = Future()
    result.set_running_or_notify_cancel()
    num_bytes = _route_bytes(receiver.kv_cache, plan)

    def wait_all() -> None:
        error, first = "", None
        for f in own:
            try:
                received = f.result()
                if received.event is not None:
                    received.event.synchronize()
                first = first or received.first_token
            except Exception as e:  # noqa: BLE001 - folded into the result
                error = error or str(e) or repr(e)
        error = reports.wait(key, ranks, 2 * plan.timeout + 5) or error
        if error:
            result.set_exception(KvTransferError(f"KV receive from {plan.prefill_id} epoch {plan.epoch} failed: "
                                                 f"{error}"))
        else:
            result.set_result(Received(num_bytes, None, first))
    reports.pool.submit(wait_all)
    return result
