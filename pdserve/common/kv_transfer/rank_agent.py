"""A tensor-parallel rank's share of KV transfers between workers (ranks 1..N-1; rank 0's share
and the orchestration are in rank_fanout.py).

Rank 0 writes one ``kv_send`` or ``kv_recv`` message per transfer on every rank's command pipe
(pdserve/common/engine/ranks.py), in PushKV order: a :class:`RankPlan` (the two layouts'
routes, the epoch and secret of the pair, the block ids). Each rank moves the routes of its own
rank over pair channels of its own (its ``KvSender`` / ``KvReceiver``, named by
``layout.rank_name``): sends on one thread of their own, receives on the receiver's threads, so
the command loop goes on following forwards meanwhile and a transfer never waits for a step (nor
a step for a transfer). The rank reports each transfer's end in the rank group's store under
``{key}/{rank}``: "" once its data crossed (landed, on the receiving side), else the error.
"""
from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .layout import Route, rank_name
from .receiver import KvReceiver
from .sender import KvSender

log = logging.getLogger(__name__)
SEND, RECV = "kv_send", "kv_recv"


@dataclass(frozen=True)
class RankPlan:
    """One request's KV between a prefill worker of ``prefill_tp`` ranks and a decode worker of
    ``decode_tp``, over ``routes`` (layout.routes), on the pair's ``epoch`` and ``secret``, into
    the decode worker's ``block_ids`` (``src_ids`` on the prefill side; empty on the decode side),
    through the decode worker's store at ``store_address``; ``timeout`` bounds each channel's
    rendezvous and transfer (s)."""
    prefill_id: str
    prefill_tp: int
    decode_id: str
    decode_tp: int
    routes: tuple[Route, ...]
    store_address: str
    epoch: int
    secret: str
    block_ids: tuple[int, ...]
    timeout: float

    def sender_name(self, rank: int) -> str:
        return rank_name(self.prefill_id, rank, self.prefill_tp)

    def receiver_name(self, rank: int) -> str:
        return rank_name(self.decode_id, rank, self.decode_tp)

    def sends_of(self, rank: int) -> list[Route]:
        return [r for r in self.routes if r.src == rank]

    def receives_of(self, rank: int) -> list[Route]:
        return [r for r in self.routes if r.dst == rank]

    def message(self, kind: str, key: str) -> dict:
        """The command-pipe message of this plan (JSON-able; :meth:`from_message` reads it)."""
        return {"k": kind, "key": key, "p": [self.prefill_id, self.prefill_tp], "d": [self.decode_id, self.decode_tp],
                "routes": [[r.src, r.dst, *r.src_heads, *r.dst_heads] for r in self.routes],
                "store": self.store_address, "epoch": self.epoch, "secret": self.secret,
                "ids": list(self.block_ids), "timeout": self.timeout}

    @classmethod
    def from_message(cls, m: dict) -> RankPlan:
        routes = tuple(Route(int(a), int(b), (int(c), int(d)), (int(e), int(f))) for a, b, c, d, e, f in m["routes"])
        return cls(str(m["p"][0]), int(m["p"][1]), str(m["d"][0]), int(m["d"][1]), routes, str(m["store"]),
                   int(m["epoch"]), str(m["secret"]), tuple(int(b) for b in m["ids"]), float(m["timeout"]))


def report_key(key: str, rank: int) -> str:
    return f"{key}/{rank}"


class RankKvAgent:
    """Rank ``rank``'s side of the transfers (module docstring): ``handle`` takes the messages of
    :attr:`kinds`; ``pool()`` is the rank's KV pool (allocated before any transfer); reports go
    to the rank group's store on ``127.0.0.1:store_port``."""
    kinds = (SEND, RECV)

    def __init__(self, rank: int, store_port: int, pool: Callable[[], torch.Tensor], timeout_s: float) -> None:
        self.rank = rank
        self.pool = pool
        self._store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self._store_lock = threading.Lock()
        self._sends = ThreadPoolExecutor(1, thread_name_prefix=f"kv-rank{rank}-send")   # in order
        self._senders: dict[str, KvSender] = {}
        self._receivers: dict[str, KvReceiver] = {}

    def handle(self, message: dict) -> None:
        plan, key = RankPlan.from_message(message), str(message["key"])
        if message["k"] == SEND:
            if plan.sends_of(self.rank):
                self._sends.submit(self._send, plan, key)
        elif plan.receives_of(self.rank):
            self._receive(plan, key)

    def _report(self, key: str, error: str) -> None:
        with self._store_lock:
            self._store.set(report_key(key, self.rank), error)

    def _send(self, plan: RankPlan, key: str) -> None:
        name = plan.sender_name(self.rank)
        sender = self._senders.get(name)
        if sender is None:
            sender = self._senders[name] = KvSender(name, timeout=plan.timeout, pair_secrets=True)
        pending, error = [], ""
        try:
            for route in plan.sends_of(self.rank):
                dst = plan.receiver_name(route.dst)
                with sender.lock(dst):
                    sender.adopt_epoch(dst, plan.epoch, plan.secret)
                    pending.append(sender.start_send(dst, plan.store_address, plan.epoch, self.pool(),
                                                     list(plan.block_ids), heads=route.src_heads))
        except Exception as e:  # noqa: BLE001 - reported to rank 0
            error = str(e) or repr(e)
        for p in pending:       # every started send is waited (a dropped Gloo work cancels it)
            try:
                p.wait()
            except Exception as e:  # noqa: BLE001 - reported to rank 0
                error = error or str(e) or repr(e)
        self._report(key, error)

    def _receive(self, plan: RankPlan, key: str) -> None:
        name = plan.receiver_name(self.rank)
        receiver = self._receivers.get(name)
        if receiver is None:
            receiver = self._receivers[name] = KvReceiver(self.pool(), name, plan.store_address, timeout=plan.timeout)
        try:
            futures = [receiver.post(plan.sender_name(r.src), plan.epoch, list(plan.block_ids), secret=plan.secret,
                                     heads=r.dst_heads) for r in plan.receives_of(self.rank)]
        except Exception as e:  # noqa: BLE001 - reported to rank 0
            self._report(key, str(e) or repr(e))
            return
        when_all(futures, lambda error: self._report(key, error))

    def close(self) -> None:
        self._sends.shutdown(wait=False, cancel_futures=True)
        for sender in self._senders.values():
            sender.close()
        for receiver in self._receivers.values():
            receiver.close()


def when_all(futures: list[Future], done: Callable[[str], None]) -> None:
    """``done("")`` once every receive future landed (its CUDA event waited), ``done(error)``
    once they all ended and one failed; called on the thread that ends the last."""
    left = [len(futures)]
    errors: list[str] = []
    lock = threading.Lock()

    def one(f: Future) -> None:
        error = ""
        try:
            received = f.result()
            if received.event is not None:
                received.event.synchronize()
        except Exception as e:  # noqa: BLE001 - collected
            error = str(e) or repr(e)
        with lock:
            if error:
                errors.append(error)
            left[0] -= 1
            last = left[0] == 0
        if last:
            done(errors[0] if errors else "")
    if not futures:
        done("")
    for f in futures:
        f.add_done_callback(one)
