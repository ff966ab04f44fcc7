"""The decode side of the KV handoff: reservations, KV receives and local submits, through
:class:`pdserve.decode_worker.state.DecodeState`; a handoff side of the base servicer (Cancel,
drain, stats). Engine-side failures come out as the domain errors the interceptor maps to
statuses.

Reserve, Submit, PushKV, Cancel and lease renewals are answered off the engine's step
(``WorkerRuntime.call_now``: under the engine's state lock, taken between steps or while a step
computes), so none waits behind a long prefill step; what must happen between steps (admitting a
request whose KV landed, ending a request of the running batch) is queued for the engine thread.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from pdserve.common.engine.handoff import OutOfBlocks
from pdserve.common.engine.llm_engine import DuplicateRequest, LLMEngine
from pdserve.common.grpc_utils.errors import AlreadyExists, Cancelled, FailedPrecondition, NotFound, ResourceExhausted
from pdserve.common.kv_transfer import KvReceiver, KvTransferError, rank_fanout
from pdserve.common.kv_transfer.layout import KvLayout, routes
from pdserve.common.kv_transfer.rank_agent import RankPlan
from pdserve.common.kv_transfer.rank_fanout import RankReports
from pdserve.common.kv_transfer.transport import Receiver
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.serving.engine_loop import EngineHooks
from pdserve.common.serving.worker_runtime import WorkerRuntime
from pdserve.decode_worker.state import BadTransfer, CancelledBefore, DecodeState, NoSuchRequest, resolve_receive

logger = logging.getLogger(__name__)
T = TypeVar("T")


class KvImport:
    def __init__(self, runtime: WorkerRuntime, state: DecodeState, receiver: Receiver,
                 kv_store_address: str) -> None:
        self.runtime = runtime
        self.state = state
        self.receiver = receiver            # rank 0's, named layout.rank_name(worker id, 0, its ranks)
        self.reports = RankReports(runtime.engine.model_runner.leader)
        self.kv_store_address = kv_store_address
        self._background: set[asyncio.Future] = set()

    @property
    def hooks(self) -> EngineHooks:
        return EngineHooks(self.state.on_step, self.state.expire)

    def close(self) -> None:
        self.receiver.close()
        self.reports.close()

    async def _now(self, fn: Callable[[LLMEngine], T], request_id: str = "") -> T:
        """``fn`` under the state lock, off the step. A caller that goes away (its rpc
        cancelled or past its deadline) leaves nothing behind: ``request_id`` is then
        cancelled here as if the router had sent Cancel."""
        try:
            return await self.runtime.call_now(fn)
        except OutOfBlocks as e:
            raise ResourceExhausted(str(e)) from e
        except DuplicateRequest as e:
            raise AlreadyExists(str(e)) from e
        except NoSuchRequest as e:
            raise NotFound(str(e.args[0])) from e
        except BadTransfer as e:
            raise FailedPrecondition(str(e)) from e
        except CancelledBefore as e:
            raise Cancelled(str(e)) from e
        except asyncio.CancelledError:
            if request_id:
                self.runtime.cancelled.add(request_id)
                task = asyncio.ensure_future(self.cancel(request_id))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            raise

    # ---- admission paths ------------------------------------------------------------------
    async def reserve(self, request_id: str, token_ids: list[int], params: SamplingParams, lease_ms: int,
                      deadline: float | None, router_id: str, tpot_slo_ms: float = 0.0) -> tuple[list[int], int, int]:
        """Blocks for a prompt whose KV comes from a prefill worker: (block ids, cached tokens,
        lease expiry in Unix ms)."""
        block_ids, cached = await self._now(lambda e: self.state.reserve(
            e, request_id, token_ids, params, lease_ms, deadline, router_id, tpot_slo_ms), request_id)
        lease_ms = lease_ms or self.state.default_lease_ms
        return block_ids, cached, int(time.time() * 1000) + lease_ms

    async def submit(self, request_id: str, token_ids: list[int], params: SamplingParams,
                     deadline: float | None, router_id: str, tpot_slo_ms: float = 0.0) -> None:
        """A request prefilled here (no transfer)."""
        await self._now(lambda e: self.state.submit(e, request_id, token_ids, params, deadline, router_id,
                                                    tpot_slo_ms), request_id)

    async def renew(self, router_id: str, request_ids: list[str]) -> list[str]:
        """Extend the leases of a router's reservations; the ids no longer held here."""
        return await self._now(lambda e: self.state.renew(e, router_id, request_ids))

    async def push_kv(self, request_id: str, block_ids: list[int], first_token: int, logprob: float,
                      prefill_worker_id: str, epoch: int, on_channel: bool, secret: str,
                      prefill_tp: int = 1) -> None:
        """Post the receive of a reservation's blocks; the request joins the batch when they land.
        A PushKV that does not match its reservation ends it (FAILED_PRECONDITION, blocks freed).
        The move to RECEIVING and the post are one step under the state lock: a PushKV whose
        caller gave up never leaves a reservation receiving with no receive posted. ``prefill_tp``:
        the prefill worker's ranks; when either side has several, each rank receives its KV heads
        from the ranks that hold them (kv_transfer/rank_fanout.py)."""
        await self._now(lambda e: self._start_receive(e, request_id, block_ids, first_token, logprob,
                                                      prefill_worker_id, epoch, on_channel, secret, prefill_tp))

    def _post(self, prefill_worker_id: str, epoch: int, block_ids: list[int], on_channel: bool, secret: str,
              prefill_tp: int) -> Future:
        """Post the receive: on the one channel of a pair of one-rank workers, else on every route."""
        layout = self.runtime.kv_layout()
        if prefill_tp == 1 and layout.tensor_parallel_size == 1:
            return self.receiver.post(prefill_worker_id, epoch, block_ids, with_first_token=on_channel, secret=secret)
        if not isinstance(self.receiver, KvReceiver):
            raise KvTransferError(f"this KV transport ({type(self.receiver).__name__}) moves no KV between "
                                  "tensor-parallel workers")
        plan = RankPlan(prefill_worker_id, prefill_tp, self.runtime.worker_id, layout.tensor_parallel_size,
                        tuple(routes(KvLayout(prefill_tp, layout.num_kv_heads, layout.head_dim), layout)),
                        self.receiver.store_address, epoch, secret, tuple(block_ids), self.receiver.timeout)
        return rank_fanout.post(self.receiver, self.reports, plan, with_first_token=on_channel)

    def _start_receive(self, engine: LLMEngine, request_id: str, block_ids: list[int], first_token: int,
                       logprob: float, prefill_worker_id: str, epoch: int, on_channel: bool, secret: str,
                       prefill_tp: int = 1) -> None:
        """Under the state lock: move the reservation to RECEIVING and post its receive, or end it
        if the PushKV does not match it (BadTransfer re-raised) or the post is refused."""
        try:
            self.state.start_receive(engine, request_id, block_ids)
        except BadTransfer as e:
            self.state.refuse_push(engine, request_id, str(e))
            raise
        loop = self.runtime.loop
        if not block_ids:
            loop.call(lambda e: self.state.finish_receive(e, request_id, first_token, logprob, None, None))
            return
        try:
            future = self._post(prefill_worker_id, epoch, block_ids, on_channel, secret, prefill_tp)
        except KvTransferError as e:   # nothing was posted: the reservation ends here
            self.runtime.metrics.kv_failures.labels("recv").inc()
            self.state.finish_receive(engine, request_id, first_token, logprob, None, e)
            raise FailedPrecondition(str(e)) from e
        future.add_done_callback(self.runtime.metrics.watch_receive(request_id))
        future.add_done_callback(lambda f: resolve_receive(loop, self.state, request_id, first_token, logprob, f))

    async def refuse_push(self, request_id: str, error: str) -> bool:
        """A PushKV refused before anything was posted (a bad field): end the request's
        reservation, freeing its blocks; False when it had none (or is past it)."""
        return await self.runtime.call_now(lambda e: self.state.refuse_push(e, request_id, error), shielded=True)

    async def cancel_router(self, router_id: str) -> int:
        """End every request of a router that left; how many there were."""
        return await self.runtime.call_now(lambda e: self.state.cancel_router(e, router_id), shielded=True)

    # ---- handoff side (pdserve.common.serving.worker_servicer.Handoff) -----------------------
    def num_in_flight(self) -> int:
        return len(self.state.tracked)

    def num_reserved(self) -> int:
        return self.state.num_reserved()

    def transfer_counts(self) -> tuple[int, int]:
        return self.state.num_transfers, self.state.transfer_bytes

    async def cancel(self, request_id: str) -> bool:
        return await self.runtime.call_now(lambda e: self.state.cancel(e, request_id), shielded=True)

    async def cancel_all(self) -> None:
        await self.runtime.call_now(lambda e: [self.state.cancel(e, rid) for rid in list(self.state.tracked)],
                                    shielded=True)
