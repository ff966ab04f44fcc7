"""Prefill for another worker: compute a prompt's KV here, stream its first token, ship the KV
into the decode worker's reserved blocks over the pair channel (from the step's launch).

Served by the prefill worker and by a worker of role both (which is then a KV sender as well
as a receiver): each builds one :class:`KvExport` beside its engine, starts the engine thread
with its :attr:`KvExport.hooks`, and hands it to the base servicer as a handoff side (Cancel,
drain, stats). Admission (draining, ids, deadline) is the servicer's, before :meth:`prefill`.
A Prefill is queued and a Cancel answered off the engine's step (``WorkerRuntime.call_now``);
a Prefill call that goes away at any point leaves nothing behind (its request is cancelled here,
its blocks freed once no send reads them).
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.common import telemetry
from pdserve.common.engine.llm_engine import DuplicateRequest
from pdserve.common.grpc_utils.channels import RenewingChannels
from pdserve.common.grpc_utils.convert import finish_reason_to_proto, sampling_params_for_prompt, top_logprobs_to_proto
from pdserve.common.grpc_utils.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    PeerUnavailable,
)
from pdserve.common.kv_transfer import KvSender, KvTransferError, get_transport, rank_fanout, resolve_transport_name
from pdserve.common.kv_transfer.layout import KvLayout, rank_name, routes
from pdserve.common.kv_transfer.rank_agent import RankPlan
from pdserve.common.kv_transfer.rank_fanout import RankReports
from pdserve.common.kv_transfer.transport import Pending, Sender
from pdserve.common.outputs import FinishReason
from pdserve.common.serving.engine_loop import EngineHooks
from pdserve.common.serving.worker_runtime import WorkerRuntime
from pdserve.prefill_worker.state import (
    CancelledBefore,
    FirstTokenResult,
    LaunchedPrefill,
    PrefillAborted,
    PrefillState,
)
from pdserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
PUSH_KV_TIMEOUT_S = 10.0


class KvExport:
    def __init__(self, runtime: WorkerRuntime, state: PrefillState, sender: Sender) -> None:
        self.runtime = runtime
        self.state = state
        self.sender = sender
        self.in_flight = 0
        self._decode_channels = RenewingChannels()      # to decode workers, for PushKV
        self._pair_locks: dict[str, asyncio.Lock] = {}
        self.reports = RankReports(runtime.engine.model_runner.leader)
        self.num_transfers = 0
        self.transfer_bytes = 0

    @classmethod
    def create(cls, runtime: WorkerRuntime, kv_timeout_s: float, transport: str = "auto") -> KvExport:
        """Its state (on the runtime's request tracker) and the KV sender of ``transport`` (a
        registered name, or auto: by the pool's device)."""
        name = resolve_transport_name(transport, runtime.engine.model_runner.kv_cache.device.type)
        # rank 0's sender: a tensor-parallel worker's ranks each ship their own KV heads
        sender = get_transport(name).sender(rank_name(runtime.worker_id, 0, runtime.engine_config.tensor_parallel_size),
                                            kv_timeout_s)
        return cls(runtime, PrefillState(runtime.aio_loop, runtime.requests, runtime.loop, runtime.cancelled), sender)

    @property
    def hooks(self) -> EngineHooks:
        return EngineHooks(self.state.on_step, self.state.expire, self.state.on_launch)

    def close(self) -> None:
        self.sender.close()
        self.reports.close()

    # ---- handoff side (pdserve.common.serving.worker_servicer.Handoff) -----------------------
    def num_in_flight(self) -> int:
        return self.in_flight

    def num_reserved(self) -> int:
        return 0

    def transfer_counts(self) -> tuple[int, int]:
        return self.num_transfers, self.transfer_bytes

    async def cancel(self, request_id: str) -> bool:
        return await self.runtime.call_now(lambda e: self.state.cancel(e, request_id), shielded=True)

    async def cancel_all(self) -> None:
        await self.runtime.call_now(lambda e: [self.state.cancel(e, rid) for rid in list(self.state.pending)],
                                    shielded=True)

    def _decode_stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self._decode_channels.get(address))

    def _validate(self, request) -> None:
        t = request.kv_target
        if not t.decode_address or not t.decode_worker_id:
            raise InvalidArgument("kv_target", "decode_address and decode_worker_id are required")
        block_size = self.runtime.engine_config.block_size
        needed = -(-len(request.token_ids) // block_size)
        if len(t.block_ids) != needed:
            raise InvalidArgument("kv_target.block_ids", f"{len(t.block_ids)} ids for a prompt of {needed} blocks")
        if t.num_cached_tokens % block_size or t.num_cached_tokens >= len(request.token_ids):
            raise InvalidArgument("kv_target.num_cached_tokens",
                                  f"{t.num_cached_tokens} must be a multiple of {block_size} below the prompt's "
                                  f"{len(request.token_ids)} tokens")

    async def prefill(self, request, deadline: float | None):
        """The Prefill rpc of an admitted request: compute the prompt's KV, stream the first
        token, ship the KV. ``deadline``: Unix seconds or None."""
        self._validate(request)
        params = sampling_params_for_prompt(request.params, self.runtime.engine.max_model_len,
                                            len(request.token_ids))
        rid = request.request_id
        telemetry.bind_request(rid)
        loop = asyncio.get_running_loop()
        first, launched = loop.create_future(), loop.create_future()
        try:
            await self.runtime.call_now(lambda e: self.state.start(e, rid, list(request.token_ids), params,
                                                                   deadline, first, launched))
        except DuplicateRequest as e:
            raise AlreadyExists(str(e)) from e
        except CancelledBefore as e:
            raise Cancelled(str(e)) from e
        except asyncio.CancelledError:   # the caller left; the request may have been queued
            self.runtime.cancelled.add(rid)
            self.runtime.loop.call(lambda e: self.state.cancel(e, rid))
            raise
        self.in_flight += 1
        ship = None                  # from its start, the blocks are freed only after it ended
        try:
            ship = asyncio.ensure_future(self.runtime.metrics.observe_send(
                rid, self._ship(request, await self._wait(rid, launched))))
            result = await self._wait(rid, first)
            yield worker_pb2.PrefillResponse(first_token=first_token_to_proto(result))
            if result.finish_reason is not None:
                return               # the router cancels the decode side; the send may still end
            done = await asyncio.shield(ship)
            yield worker_pb2.PrefillResponse(transfer_done=done)
        finally:
            self.in_flight -= 1
            self._release_after(rid, ship)

    async def _wait(self, rid: str, future: asyncio.Future):
        """The request's launch or first token; its end (cancel, deadline) as a gRPC error."""
        try:
            return await future
        except PrefillAborted as e:
            if e.reason == FinishReason.DEADLINE:
                raise DeadlineExceeded(f"request {rid!r} passed its deadline before prefill") from e
            raise Cancelled(f"request {rid!r} was cancelled") from e
        except asyncio.CancelledError:   # the caller left: end the request in the engine
            self.runtime.loop.call(lambda e: self.state.cancel(e, rid))
            raise

    async def _ship(self, request, launched: LaunchedPrefill) -> worker_pb2.TransferDone:
        """PushKV, then send the blocks the decode worker lacks and the first token after them.

        Runs from the prefill step's launch (the send is enqueued behind it on the GPU). One
        transfer per decode worker is announced and enqueued at a time; the wait for the data is
        outside that lock. There is always a block to send (a decode worker's prefix hit never
        covers the prompt's last token).
        """
        t = request.kv_target
        block_size = self.runtime.engine_config.block_size
        first_block = t.num_cached_tokens // block_size
        src, dst = launched.block_table[first_block:], list(t.block_ids)[first_block:]
        decode_tp = t.decode_tensor_parallel_size or 1
        pair = rank_name(t.decode_worker_id, 0, decode_tp)     # route (0, 0): the pair's epoch and secret
        lock = self._pair_locks.setdefault(t.decode_worker_id, asyncio.Lock())
        async with lock:            # PushKV order == send order on the channel(s)
            epoch = self.sender.next_epoch(pair)
            await self._push_kv(request, epoch, dst, pair)
            started = time.perf_counter()
            try:
                pending = await asyncio.to_thread(self._start_send, request, pair, epoch, src, decode_tp, launched)
            except KvTransferError as e:
                raise PeerUnavailable(f"KV transfer to {t.decode_worker_id} failed: {e}", t.decode_address) from e
        try:                        # the next request's PushKV may go out meanwhile
            num_bytes, _ = await asyncio.to_thread(pending.wait)
        except KvTransferError as e:
            raise PeerUnavailable(f"KV transfer to {t.decode_worker_id} failed: {e}", t.decode_address) from e
        elapsed_ms = (time.perf_counter() - started) * 1000
        self.num_transfers += 1
        self.transfer_bytes += num_bytes
        return worker_pb2.TransferDone(bytes=num_bytes, transfer_ms=elapsed_ms, num_blocks=len(src))

    def _start_send(self, request, pair: str, epoch: int, src: list[int], decode_tp: int,
                    launched: LaunchedPrefill) -> Pending:
        """Start the send: on the one channel of a pair of one-rank workers, else every rank of this
        worker ships its KV heads to the decode ranks that hold them (kv_transfer/rank_fanout.py)."""
        t, layout = request.kv_target, self.runtime.kv_layout()
        kv_cache = self.runtime.engine.model_runner.kv_cache
        if decode_tp == 1 and layout.tensor_parallel_size == 1:
            return self.sender.start_send(pair, t.kv_store_address, epoch, kv_cache, src,
                                          ready_event=launched.kv_ready, first_token=launched.first_token)
        if not isinstance(self.sender, KvSender):
            raise KvTransferError(f"this KV transport ({type(self.sender).__name__}) moves no KV between "
                                  "tensor-parallel workers")
        decode = KvLayout(decode_tp, layout.num_kv_heads, layout.head_dim)
        plan = RankPlan(self.runtime.worker_id, layout.tensor_parallel_size, t.decode_worker_id, decode_tp,
                        tuple(routes(layout, decode)), t.kv_store_address, epoch, self.sender.pair_secret(pair),
                        tuple(src), self.sender.timeout)
        return rank_fanout.start_send(self.sender, self.reports, plan, kv_cache, ready_event=launched.kv_ready,
                                      first_token=launched.first_token)

    async def _push_kv(self, request, epoch: int, dst: list[int], pair: str) -> None:
        """Announce the send (the first token follows the blocks on the channel of route (0, 0))."""
        t = request.kv_target
        try:
            await self._decode_stub(t.decode_address).PushKV(worker_pb2.PushKVRequest(
                request_id=request.request_id, prefill_worker_id=self.runtime.worker_id, channel_epoch=epoch,
                num_blocks=len(dst), block_ids=dst, num_bytes=len(dst) * self.runtime.model_block_bytes(),
                first_token_on_channel=True, pair_secret=self.sender.pair_secret(pair),
                prefill_tensor_parallel_size=self.runtime.engine_config.tensor_parallel_size),
                timeout=PUSH_KV_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if e.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                # the receive may have been posted, or the decode worker refused this epoch:
                # either way the pair starts a new epoch
                await asyncio.to_thread(self.sender.mark_broken, pair, f"PushKV {e.code().name}")
            raise PeerUnavailable(f"decode worker {t.decode_worker_id} refused the KV: "
                                  f"{e.code().name}: {e.details()}", t.decode_address) from e

    def _release_after(self, rid: str, transfer: asyncio.Future | None) -> None:
        """Free the request's blocks once no send reads them any more."""
        def release(done: asyncio.Future | None = None) -> None:
            if done is not None and not done.cancelled() and done.exception() is not None:
                logger.info("KV transfer of %s ended without its caller: %s", rid, done.exception())
            self.runtime.loop.call(lambda e: self.state.release(e, rid))
        if transfer is None or transfer.done():
            release()
        else:
            transfer.add_done_callback(release)


def first_token_to_proto(result: FirstTokenResult) -> worker_pb2.FirstToken:
    """The FirstToken message of a prefill's result (top and prompt logprobs when it has them)."""
    msg = worker_pb2.FirstToken(
        token_id=result.token_id, logprob=result.logprob, num_cached_tokens=result.num_cached_tokens,
        finish_reason=finish_reason_to_proto(result.finish_reason), prompt_logprobs=result.prompt_logprobs or [],
        prompt_top_logprobs=top_logprobs_to_proto(result.prompt_top_logprobs or []))
    if result.top_logprobs is not None:
        msg.top_logprobs.CopyFrom(top_logprobs_to_proto([result.top_logprobs])[0])
    return msg
