"""The router's client of one worker: channel, identity, health, load, output and KV streams.

A supervisor task per worker: while the worker is down it probes ``Info`` (backoff
RECONNECT_MIN_S .. RECONNECT_MAX_S); once the identity is accepted by the registry it opens the
``Subscribe`` stream (decode/both) and marks the worker up; while up it polls ``GetStats``
every STATS_INTERVAL_S (the load figure; a failed poll with UNAVAILABLE or DEADLINE_EXCEEDED
marks it down). The request flow marks it down too on UNAVAILABLE, and a broken Subscribe
stream does. The ``StreamKvEvents`` consumer (feeds the prefix index) runs while the registry
says the index needs it (``kv_wanted``: the worker has a peer of its kind; see
:meth:`pdserve.router.workers.WorkerRegistry.update_kv_wanted`); when the index finds a gap in the
stream's sequence numbers (or a view larger than the worker's pool) the stream is re-opened,
and its snapshot repairs the view. A worker is marked up only while its health says SERVING
(a draining worker stays down once a refused request marked it so).

Draining: a decode worker whose health turns NOT_SERVING (SIGTERM) gets no new requests, but its
Subscribe stream stays open while requests of this router are in flight on it, so they finish
within the worker's grace period; it is marked down once they are done or the stream ends.

Cancel is retried in the background until the worker answers (pdserve.router.cancels), or
until the worker is known gone: down (a decode worker cancels this router's requests itself when
the Subscribe stream closes, a prefill worker when the Prefill call ends) or restarted (a new
worker id holds nothing). The leases of reservations whose requests wait for their prefill are
renewed, batched per worker (``leases``: pdserve.router.leases).

The load figures (this router's own, counted live, and the other router replicas', from each
GetStats answer) are :class:`~pdserve.router.worker_load.WorkerLoad`'s, a base of WorkerClient.
Every call uses ``wait_for_ready=False`` and a timeout, so a dead worker fails fast.

The request rpcs (:meth:`WorkerClient.reserve`, :meth:`~WorkerClient.submit`,
:meth:`~WorkerClient.prefill`, :meth:`~WorkerClient.cancel`) take and return domain types
(pdserve.common.worker_types, pdserve.common.outputs), converted by
pdserve.common.grpc_utils.convert: this module, pdserve.router.prefill_call and the servicers
are the router's only protobuf edge. Their rpc errors are raised as ``grpc.aio.AioRpcError`` (the attempt maps them).
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from collections.abc import Set as AbstractSet

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2_grpc

from pdserve.common.grpc_utils import Unavailable, client_channel
from pdserve.common.grpc_utils.channels import RenewingChannels
from pdserve.common.grpc_utils.convert import reservation_from_proto, worker_info_from_proto, worker_stats_from_proto
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.worker_types import DECODE_ROLES, Reservation, Role, WorkerInfo, WorkerStats
from pdserve.router.cancels import cancel_until_answered
from pdserve.router.leases import LeaseKeeper
from pdserve.router.prefill_call import PrefillRequest, PrefillStream, wire_params
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.settings import (
    CANCEL_TIMEOUT_S,
    KV_RESUBSCRIBE_S,
    NO_BDP_OPTIONS,
    RECONNECT_MAX_S,
    RECONNECT_MIN_S,
    STATS_INTERVAL_S,
    STATS_MISSES_DOWN,
    RouterSettings,
)
from pdserve.router.subscription import SUBSCRIBE_CHANNEL_OPTIONS, Subscription
from pdserve.router.worker_health import not_serving, watch_until_not_serving
from pdserve.router.worker_load import WorkerLoad
from pdserve.v1 import common_pb2, common_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

DRAINING = "is draining"         # in the UNAVAILABLE a draining worker answers new requests with

DOWN_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
LOADING = "loading its model"    # last_error while a starting worker loads its model


class WorkerClient(WorkerLoad):
    def __init__(self, address: str, expected_roles: AbstractSet[Role], settings: RouterSettings,
                 prefix_index: PrefixIndex, check_info: Callable[[WorkerClient, WorkerInfo], str | None],
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.key = address
        self.address = address
        self.expected_roles = set(expected_roles)
        self.settings = settings
        self.prefix_index = prefix_index
        self.check_info = check_info
        self.on_change = on_change
        self.channels = RenewingChannels(options=NO_BDP_OPTIONS)   # new ones after a certificate rotation
        self._bind_stubs()
        self.sub_channel: grpc.aio.Channel | None = None     # the Subscribe stream's own connection
        self.info: WorkerInfo | None = None
        self.stats: WorkerStats | None = None
        self.subscription: Subscription | None = None
        self.up = False
        self.retired = False            # left DNS: no new requests; closed once idle
        self.draining = False           # health NOT_SERVING: no new requests; its streams go on
        self.closed = False
        self.dns_source: str | None = None  # the dns:/// target that found it (None: static)
        self.last_error = ""
        super().__init__()              # the load fields (pdserve.router.worker_load)
        self.num_kv_resyncs = 0         # KV event streams re-opened after a gap
        self._task: asyncio.Task | None = None
        self._kv_task: asyncio.Task | None = None
        self._health_task: asyncio.Task | None = None
        self._kv_unimplemented = False
        self.kv_wanted = False          # whether the prefix index needs this worker's KV events
        self.stats_misses = 0           # GetStats timeouts in a row
        self.first_attempt = asyncio.Event()
        self.leases = LeaseKeeper(self.key, self.renew_leases, settings.worker_timeout_s)

    # ---- identity ---------------------------------------------------------------------
    @property
    def role(self) -> Role | None:
        return self.info.role if self.info is not None else None

    @property
    def worker_id(self) -> str:
        return self.info.worker_id if self.info is not None else ""

    @property
    def can_decode(self) -> bool:
        return self.role in DECODE_ROLES

    @property
    def usable(self) -> bool:
        return self.up and not self.retired and not self.draining

    def describe(self) -> str:
        role = self.role.value if self.role is not None else "?"
        return f"{self.key} ({self.worker_id or '?'}, {role})"

    def _bind_stubs(self) -> None:
        self.channel = self.channels.get(self.address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.info_stub = common_pb2_grpc.InfoServiceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"worker-{self.key}")

    async def close(self) -> None:
        self.closed = True
        for task in (self._task, self._kv_task):
            if task is not None:
                task.cancel()
        self.leases.close()
        self.mark_down("closed", quiet=True)
        await self.channels.close()
        if self.sub_channel is not None:
            await self.sub_channel.close(grace=None)

    async def _supervise(self) -> None:
        backoff = RECONNECT_MIN_S
        while True:
            if not self.up:
                ok = await self._connect()
                self.first_attempt.set()
                if not ok:
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RECONNECT_MAX_S)
                    continue
                backoff = RECONNECT_MIN_S
            await asyncio.sleep(STATS_INTERVAL_S)
            if self.channels.renew_if_rotated():
                self._bind_stubs()
            if self.draining and (self.subscription is None or self.subscription.num_requests == 0):
                self.mark_down("drained: its streams ended")
            if self.up:
                await self._poll_stats()

    async def _connect(self) -> bool:
        timeout = self.settings.worker_timeout_s
        try:
            info = worker_info_from_proto(await self.info_stub.Info(common_pb2.InfoRequest(), timeout=timeout,
                                                                    wait_for_ready=False))
        except grpc.aio.AioRpcError as e:
            # the normal start of a worker, said once: it answers "loading", or is too busy
            # loading to answer in time before it was ever up
            if ((e.code() == grpc.StatusCode.UNAVAILABLE and LOADING in (e.details() or ""))
                    or (e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self.info is None)):
                if self.last_error != LOADING:
                    log.info("waiting for worker %s to load its model", self.key)
                self.last_error = LOADING
            else:
                self._note_error(f"Info: {e.code().name}: {e.details()}")
            return False
        problem = self.check_info(self, info)
        if problem:
            self._note_error(problem, level=logging.ERROR)
            return False
        if not await self._serving(timeout):
            return False
        self.info = info
        if self.can_decode:
            if self.sub_channel is None:
                self.sub_channel = client_channel(self.address, options=SUBSCRIBE_CHANNEL_OPTIONS)
            stub = worker_pb2_grpc.WorkerStub(self.sub_channel)
            request = worker_pb2.SubscribeRequest(router_id=self.settings.router_id)
            sub = Subscription(self.key, functools.partial(stub.Subscribe, request, wait_for_ready=False),
                               self.mark_down)
            try:
                await sub.start()
            except Unavailable as e:
                self._note_error(str(e))
                return False
            self.subscription = sub
        self.up = True
        self.draining = False
        self.last_error = ""
        self._health_task = asyncio.create_task(self._watch_health(), name=f"health-{self.key}")
        if self.kv_wanted:
            self._start_kv_events()
        log.info("worker %s is up (block_size %d, max_model_len %d, %d KV blocks)", self.describe(),
                 info.block_size, info.max_model_len, info.num_kv_blocks)
        self.on_change()
        return True

    async def _serving(self, timeout: float) -> bool:
        """Whether the worker's health says SERVING (pdserve.router.worker_health)."""
        problem = await not_serving(self.health_stub, timeout)
        if problem is not None:
            self._note_error(problem)
        return problem is None

    async def _watch_health(self) -> None:
        """While up: the worker's health stream; NOT_SERVING (SIGTERM: draining) stops new
        requests at once, before one is refused there (:meth:`begin_drain`)."""
        if await watch_until_not_serving(self.health_stub, self.key, lambda: self.up):
            self.begin_drain("health: NOT_SERVING (draining)")

    def _note_error(self, message: str, level: int = logging.INFO) -> None:
        if message != self.last_error:
            log.log(level, "worker %s: %s", self.key, message)
        self.last_error = message

    async def _poll_stats(self) -> None:
        own_tokens, own_prompt = self.inflight_tokens, self.inflight_prompt_tokens
        try:
            self.stats = worker_stats_from_proto(await self.stub.GetStats(
                worker_pb2.GetStatsRequest(), timeout=self.settings.worker_timeout_s, wait_for_ready=False))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.stats_misses += 1
                if self.stats_misses < STATS_MISSES_DOWN:
                    log.info("worker %s: GetStats timed out (%d in a row)", self.key, self.stats_misses)
                    return
            if e.code() in DOWN_CODES:
                self.mark_down(f"GetStats: {e.code().name}: {e.details()}"
                               + (f" ({self.stats_misses} times in a row)" if self.stats_misses > 1 else ""))
            return
        self.stats_misses = 0
        self._note_others(self.stats, own_tokens, own_prompt)
        if self.kv_wanted and not self._kv_unimplemented and (self._kv_task is None or self._kv_task.done()):
            self._start_kv_events()

    def begin_drain(self, reason: str) -> None:
        """The worker drains (SIGTERM): no new requests here; this router's requests in flight on
        its output stream go on until they end or the worker closes the stream (its grace
        period), then it is marked down. Without such requests, down at once."""
        if not self.up or self.draining:
            return
        sub = self.subscription
        if sub is None or not sub.open or sub.num_requests == 0:
            self.mark_down(reason)
            return
        self.draining = True
        log.warning("worker %s is draining (%s): no new requests; its %d streams here go on", self.describe(),
                    reason, sub.num_requests)
        self.on_change()

    def mark_down(self, reason: str, quiet: bool = False) -> None:
        """Stop routing here; requests on its output stream get UNAVAILABLE; reconnect later."""
        was_up, self.up = self.up, False
        self.draining = False
        self.stats_misses = 0
        if self._health_task is not None and self._health_task is not asyncio.current_task():
            self._health_task.cancel()
        self._health_task = None
        if self.subscription is not None:
            sub, self.subscription = self.subscription, None
            sub.close(reason)
        self._stop_kv_events()
        if was_up:
            log.log(logging.INFO if quiet else logging.WARNING, "worker %s is down: %s", self.describe(), reason)
            self.on_change()

    # ---- prefix-cache events ----------------------------------------------------------
    def set_kv_wanted(self, wanted: bool) -> None:
        """Start or stop consuming the worker's KV events (a stream starts with a snapshot,
        so a late start misses nothing)."""
        if wanted == self.kv_wanted:
            return
        self.kv_wanted = wanted
        if not wanted:
            self._stop_kv_events()
        elif self.up and not self._kv_unimplemented and (self._kv_task is None or self._kv_task.done()):
            self._start_kv_events()

    def _stop_kv_events(self) -> None:
        if self._kv_task is not None:
            self._kv_task.cancel()
            self._kv_task = None
        self.prefix_index.remove_worker(self.key)

    def _start_kv_events(self) -> None:
        self._kv_task = asyncio.create_task(self._kv_events(), name=f"kv-events-{self.key}")

    async def _kv_events(self) -> None:
        """Feed the index from the worker's stream; re-open the stream (a new snapshot) when
        the index says the view cannot be trusted, at most every KV_RESUBSCRIBE_S."""
        capacity = self.info.num_kv_blocks if self.info is not None else 0
        while True:
            call = self.stub.StreamKvEvents(worker_pb2.KvEventsRequest(), wait_for_ready=False)
            try:
                async for ev in call:
                    if not self.prefix_index.apply(self.key, ev.stored, ev.evicted, ev.snapshot, ev.seq,
                                                   ev.num_total_blocks or capacity):
                        break
                else:
                    break                    # the stream ended
            except asyncio.CancelledError:
                call.cancel()
                raise
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self._kv_unimplemented = True
                log.debug("StreamKvEvents of %s ended: %s", self.key, e.code().name)
                break
            call.cancel()
            self.num_kv_resyncs += 1
            log.info("worker %s: KV events lost or inconsistent; re-subscribing for a snapshot", self.key)
            await asyncio.sleep(KV_RESUBSCRIBE_S)
        self.prefix_index.remove_worker(self.key)

    # ---- request rpcs -----------------------------------------------------------------
    # reserve / submit start the rpc before they return (its send is the next thing the loop
    # runs): the caller does its own work, then awaits the answer.
    def reserve(self, request_id: str, token_ids, params: SamplingParams, lease_ms: int, deadline_unix_ms: int,
                router_id: str, timeout: float, tpot_slo_ms: float = 0.0,
                kv_cache_dtype: str = "", prefill_tensor_parallel_size: int = 0, prefill_num_kv_heads: int = 0,
                prefill_head_dim: int = 0) -> grpc.aio.UnaryUnaryCall:
        """Reserve KV blocks for the prompt ``token_ids`` (a list or the client's repeated field):
        the call (cancellable); :meth:`reservation` of its answer is the Reservation.
        ``tpot_slo_ms``: the request's own TPOT objective for the worker's guard (0 = the worker's);
        ``kv_cache_dtype``, ``prefill_*``: the KV layout of the prefill worker that ships the KV ("", 0: unknown)."""
        req = worker_pb2.ReserveRequest(request_id=request_id, token_ids=token_ids, params=wire_params(params),
                                        lease_ms=lease_ms, deadline_unix_ms=deadline_unix_ms, router_id=router_id,
                                        tpot_slo_ms=tpot_slo_ms, kv_cache_dtype=kv_cache_dtype,
                                        prefill_tensor_parallel_size=prefill_tensor_parallel_size,
                                        prefill_num_kv_heads=prefill_num_kv_heads, prefill_head_dim=prefill_head_dim)
        return self.stub.Reserve(req, timeout=timeout, wait_for_ready=False)

    @staticmethod
    def reservation(reply: worker_pb2.ReserveResponse) -> Reservation:
        return reservation_from_proto(reply)

    def submit(self, request_id: str, token_ids, params: SamplingParams, deadline_unix_ms: int, router_id: str,
               timeout: float, tpot_slo_ms: float = 0.0) -> grpc.aio.UnaryUnaryCall:
        """Queue the request on this worker (it prefills it); its outputs come on the Subscribe stream.
        ``tpot_slo_ms`` as in :meth:`reserve`."""
        req = worker_pb2.SubmitRequest(request_id=request_id, token_ids=token_ids, params=wire_params(params),
                                       deadline_unix_ms=deadline_unix_ms, router_id=router_id, tpot_slo_ms=tpot_slo_ms)
        return self.stub.Submit(req, timeout=timeout, wait_for_ready=False)

    def prefill(self, req: PrefillRequest, target: Reservation, decode_worker_id: str, decode_address: str,
                timeout: float | None, logprobs: bool) -> PrefillStream:
        """Start ``req`` (from :func:`prefill_request`) here, its KV going to ``target`` on the
        decode worker at ``decode_address``."""
        kv = req.kv_target
        kv.decode_worker_id = target.worker_id or decode_worker_id
        kv.kv_store_address = target.kv_store_address
        kv.decode_address = decode_address
        kv.block_ids.extend(target.block_ids)
        kv.num_cached_tokens = target.num_cached_tokens
        kv.decode_tensor_parallel_size = target.tensor_parallel_size
        return PrefillStream(self.stub.Prefill(req, timeout=timeout, wait_for_ready=False), req.request_id, logprobs)

    async def cancel(self, request_id: str) -> None:
        """Cancel the request here, tried again until the worker answers (see the module doc):
        run in the background, it never raises."""
        self.leases.release(request_id)
        worker_id = self.worker_id

        def gone() -> bool:
            return self.closed or not self.up or bool(worker_id and self.worker_id and self.worker_id != worker_id)

        await cancel_until_answered(lambda: self.stub.Cancel(worker_pb2.CancelRequest(request_id=request_id),
                                                             timeout=CANCEL_TIMEOUT_S, wait_for_ready=False),
                                    request_id, self.key, gone)

    async def renew_leases(self, request_ids: list[str], timeout: float) -> list[str]:
        """Renew the leases of this router's reservations ``request_ids`` here: the ids the worker
        no longer holds (the rpc's errors raised)."""
        reply = await self.stub.RenewLeases(
            worker_pb2.RenewLeasesRequest(router_id=self.settings.router_id, request_ids=request_ids),
            timeout=timeout, wait_for_ready=False)
        return list(reply.lost)
