"""The scripted worker's gRPC servicer: ``Worker`` + ``InfoService`` with no model behind it.

It keeps the contract of protos/pdserve/v1/worker.proto (reservations under a lease, PushKV that
checks the reserved block ids and moves no bytes, Submit, Subscribe, Cancel, deadlines, stop
conditions, GetStats, StreamKvEvents) with engine steps on a fixed or modelled schedule.
Every method runs on the server's event loop thread.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import time

import grpc

from pdserve.common.grpc_utils import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    NotFound,
    Unavailable,
    client_channel,
)
from pdserve.loadtest.scripted_state import BlockPool, ModelledParts, Outbox, Req, script_logprob, script_token
from pdserve.v1 import common_pb2, common_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger("scripted_worker")
FR = common_pb2
ROLES = {"prefill": FR.ROLE_PREFILL, "decode": FR.ROLE_DECODE, "both": FR.ROLE_BOTH}
# At most this many overdue engine steps are run at once (then the schedule restarts from now).
MAX_CATCH_UP = 64
# KV event messages queued for one slow subscriber before further ones are dropped (it sees the
# gap in KvEvents.seq and re-subscribes for a snapshot).
KV_QUEUE_MAX = 4096


class ScriptedWorker(worker_pb2_grpc.WorkerServicer, common_pb2_grpc.InfoServiceServicer):
    """One scripted worker of role ``args.role``; ``parts`` (optional) replace the fixed timings and pool."""

    def __init__(self, args: argparse.Namespace, parts: ModelledParts | None = None) -> None:
        self.args = args
        self.role = ROLES[args.role]
        self.worker_id = args.worker_id or f"scripted-{args.role}-{args.port}"
        self.bs = args.block_size
        self.eos = tuple(int(e) for e in args.eos_ids.split(",") if e)
        self.cost = self.gpu = self.channels = None
        if parts is not None:
            self.pool, self.cost, self.gpu, self.channels = parts.pool, parts.cost, parts.gpu, parts.channels
        else:
            self.pool = BlockPool(args.num_blocks, args.block_size)
        self.kv_seq = 0
        self.draining = False
        self.reqs: dict[str, Req] = {}           # decode side: reserved or active
        self.prefilling: dict[str, Req] = {}     # prefill side
        self.subs: dict[str, Outbox] = {}
        self.kv_subs: list[asyncio.Queue] = []
        self.finals: dict[str, list[worker_pb2.SequenceOutput]] = {}
        self.wake = asyncio.Event()
        self.step = 0
        self.peers: dict[str, worker_pb2_grpc.WorkerStub] = {}

    # ---- helpers ----------------------------------------------------------------------
    def _need(self, *roles: int) -> None:
        if self.role not in roles:
            raise FailedPrecondition(f"role {common_pb2.Role.Name(self.role)} does not serve this rpc")

    @staticmethod
    def _deadline(ms: int) -> float | None:
        return ms / 1000.0 if ms else None

    def _check_new(self, rid: str, router_id: str, deadline: float | None) -> None:
        if self.draining:
            raise Unavailable(f"worker {self.worker_id} is draining")
        if self.args.fail_submits:
            self.args.fail_submits -= 1
            raise Unavailable("scripted failure (--fail-submits)")
        if rid in self.reqs:
            raise AlreadyExists(f"request {rid} is live here")
        if router_id not in self.subs:
            raise FailedPrecondition(f"router {router_id!r} has no open Subscribe stream")
        if deadline is not None and time.time() > deadline:
            raise DeadlineExceeded(f"request {rid}: deadline already passed")

    def _publish_kv(self) -> None:
        stored, evicted = self.pool.take_events()
        if stored or evicted:
            self.kv_seq += 1
            ev = worker_pb2.KvEvents(stored=stored, evicted=evicted, worker_id=self.worker_id, seq=self.kv_seq)
            drop = self.args.kv_drop_every
            for q in self.kv_subs:
                if (drop and self.kv_seq % drop == 0) or q.full():
                    continue                      # lost: the subscriber sees a gap in seq
                q.put_nowait(ev)

    def _end(self, req: Req, reason: common_pb2.FinishReason, error: str = "",
             sink: dict[str, list] | None = None, emit: bool = True) -> None:
        """Free the request; with ``emit`` its last output goes to ``sink`` (default: the next step)."""
        self.reqs.pop(req.rid, None)
        self.pool.release(req.blocks)
        if emit:
            out = worker_pb2.SequenceOutput(request_id=req.rid, finish_reason=reason, error=error,
                                            num_prompt_tokens=len(req.prompt), num_cached_tokens=req.cached)
            (self.finals if sink is None else sink).setdefault(req.router_id, []).append(out)
            self.wake.set()

    def _stop_reason(self, req: Req, tok: int) -> common_pb2.FinishReason:
        p = req.params
        if tok in p.stop_token_ids or (tok in self.eos and not p.ignore_eos):
            return FR.FINISH_REASON_STOP
        if req.generated >= (p.max_tokens or self.args.default_max_tokens) \
                or len(req.prompt) + req.generated >= self.args.max_model_len:
            return FR.FINISH_REASON_LENGTH
        return FR.FINISH_REASON_UNSPECIFIED

    # ---- engine loop ------------------------------------------------------------------
    async def run_engine(self) -> None:
        """Steps every step_ms from the first request on (modelled with ModelledParts.cost), one token
        per request and step. With --catch-up (the default) steps that came due while the process
        was late run at once (at most MAX_CATCH_UP), each request's tokens in one SequenceOutput;
        with --no-catch-up the next step is step_ms after the previous step's work."""
        loop = asyncio.get_running_loop()
        step_s = self.args.step_ms / 1000.0
        next_at: float | None = None
        while True:
            if not self.reqs and not self.finals:
                self.wake.clear()
                await self.wake.wait()
                next_at = None
            if self.cost is not None:
                step_s = self._modelled_step_s()
            if next_at is None:
                next_at = loop.time() + step_s
            delay = next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            now_l = loop.time()
            late = int((now_l - next_at) / step_s) if self.args.catch_up else 0
            n = 1 + min(max(late, 0), MAX_CATCH_UP - 1)
            first_at = next_at                        # when the first of these n steps was due
            next_at = next_at + n * step_s if late < MAX_CATCH_UP else now_l + step_s
            self.step += n
            by_router = self.finals
            self.finals = {}
            now = time.time()
            for req in list(self.reqs.values()):
                if req.deadline is not None and now > req.deadline:
                    self._end(req, FR.FINISH_REASON_DEADLINE, sink=by_router)
                elif req.phase == "reserved":
                    if req.lease_expires is not None and now > req.lease_expires:
                        self._end(req, FR.FINISH_REASON_ERROR, "reservation lease expired", sink=by_router)
                else:
                    # steps due at first_at + j * step_s that came after the request joined
                    k = n if req.active_since <= first_at else n - int((req.active_since - first_at) / step_s) - 1
                    self._decode(req, max(1, k), self.subs.get(req.router_id))
            for router_id, outs in by_router.items():
                box = self.subs.get(router_id)
                if box is not None:
                    for out in outs:
                        box.add_output(out)
            self._publish_kv()
            if not self.args.catch_up:        # --no-catch-up: step_ms after the work
                next_at = loop.time() + step_s

    def _modelled_step_s(self) -> float:
        if self.cost is None:
            raise RuntimeError("a modelled step time needs ModelledParts.cost")
        active = [r for r in self.reqs.values() if r.phase == "active"]
        ctx = sum(len(r.prompt) + r.generated for r in active)
        return self.cost.decode_ms(max(1, len(active)), ctx) / 1000.0

    def _decode(self, req: Req, n: int, box: Outbox | None) -> None:
        """Up to ``n`` steps of one request (fewer when it finishes), as one output into ``box``."""
        num_prompt = num_cached = 0
        if not req.first_sent:
            req.first_sent = True
            num_prompt, num_cached = len(req.prompt), req.cached
            if req.generated == 0:   # Submit: this step was the local prefill
                self.pool.commit(req.blocks, req.chain)
        toks: list[int] = []
        lps: list[float] | None = [] if req.params.logprobs else None
        reason = FR.FINISH_REASON_UNSPECIFIED
        error = ""
        for _ in range(n):
            i = req.generated
            tok = req.token(i, self.args.vocab, self.eos)
            req.generated += 1
            toks.append(tok)
            if lps is not None:
                lps.append(script_logprob(i))
            reason = self._stop_reason(req, tok)
            if not reason and not self.pool.grow(req.blocks, len(req.prompt) + req.generated):
                reason = FR.FINISH_REASON_ERROR
                error = "out of KV blocks"
            if reason:
                break
        if reason:
            self._end(req, reason, emit=False)
        if box is not None:
            box.add(req.rid, toks, lps, reason, error, num_prompt, num_cached)

    # ---- decode / both ----------------------------------------------------------------
    async def Reserve(self, request, context):
        self._need(FR.ROLE_DECODE, FR.ROLE_BOTH)
        deadline = self._deadline(request.deadline_unix_ms)
        self._check_new(request.request_id, request.router_id, deadline)
        blocks, cached, chain = self.pool.allocate(list(request.token_ids))
        lease = (request.lease_ms or self.args.lease_ms) / 1000.0
        lease_expires = time.time() + lease
        req = Req(request.request_id, list(request.token_ids), request.params, request.router_id, deadline,
                  blocks, chain, cached, "reserved", lease_expires)
        self.reqs[req.rid] = req
        self.wake.set()
        return worker_pb2.ReserveResponse(
            block_ids=blocks, num_cached_tokens=cached, kv_store_address=f"{self.args.advertise}:{self.args.port + 1}",
            worker_id=self.worker_id, lease_expires_unix_ms=int(lease_expires * 1000))

    async def PushKV(self, request, context):
        self._need(FR.ROLE_DECODE, FR.ROLE_BOTH)
        req = self.reqs.get(request.request_id)
        if req is None or req.phase != "reserved":
            raise NotFound(f"request {request.request_id} has no live reservation here")
        expected = req.blocks[req.cached // self.bs:]
        if list(request.block_ids) != expected or request.num_blocks != len(expected):
            raise FailedPrecondition(f"block_ids {list(request.block_ids)[:8]} do not match the reservation")
        req.phase, req.lease_expires, req.generated = "active", None, 1   # the first token counts
        req.active_since = asyncio.get_running_loop().time()
        self.pool.commit(req.blocks, req.chain)
        self._publish_kv()
        self.wake.set()
        return worker_pb2.PushKVResponse()

    async def Submit(self, request, context):
        self._need(FR.ROLE_DECODE, FR.ROLE_BOTH)
        deadline = self._deadline(request.deadline_unix_ms)
        self._check_new(request.request_id, request.router_id, deadline)
        blocks, cached, chain = self.pool.allocate(list(request.token_ids))
        self.reqs[request.request_id] = Req(request.request_id, list(request.token_ids), request.params,
                                            request.router_id, deadline, blocks, chain, cached, "active",
                                            active_since=asyncio.get_running_loop().time())
        self.wake.set()
        return worker_pb2.SubmitResponse(worker_id=self.worker_id)

    async def Subscribe(self, request, context):
        """Initial metadata once the subscription is registered; a router's second Subscribe replaces
        its first; a closed stream cancels that router's requests."""
        self._need(FR.ROLE_DECODE, FR.ROLE_BOTH)
        router_id = request.router_id
        box = Outbox()
        old = self.subs.get(router_id)
        self.subs[router_id] = box
        if old is not None:
            old.close()
        await context.send_initial_metadata(())
        try:
            while True:
                await box.ready.wait()
                if box.closed:
                    return
                yield box.take(self.step)     # everything since the last send, merged per request
        finally:
            if self.subs.get(router_id) is box:
                del self.subs[router_id]
                for req in [r for r in self.reqs.values() if r.router_id == router_id]:
                    self._end(req, FR.FINISH_REASON_CANCELLED, emit=False)
                self.finals.pop(router_id, None)

    # ---- prefill ----------------------------------------------------------------------
    def _peer(self, address: str) -> worker_pb2_grpc.WorkerStub:
        if address not in self.peers:
            self.peers[address] = worker_pb2_grpc.WorkerStub(client_channel(address))
        return self.peers[address]

    async def Prefill(self, request, context):
        self._need(FR.ROLE_PREFILL, FR.ROLE_BOTH)
        rid, ids, target = request.request_id, list(request.token_ids), request.kv_target
        if not request.HasField("kv_target") or not target.decode_address:
            raise FailedPrecondition("kv_target is required")
        if self.draining:
            raise Unavailable(f"worker {self.worker_id} is draining")
        if rid in self.prefilling:
            raise AlreadyExists(f"request {rid} is being prefilled here")
        deadline = self._deadline(request.deadline_unix_ms)
        blocks, cached, chain = self.pool.allocate(ids)
        req = Req(rid, ids, request.params, "", deadline, blocks, chain, cached, "active")
        self.prefilling[rid] = req
        try:
            await self._prefill_wait(req, deadline)
            if req.cancelled.is_set():
                await context.abort(grpc.StatusCode.CANCELLED, f"request {rid} cancelled")
            if deadline is not None and time.time() >= deadline:
                raise DeadlineExceeded(f"request {rid}: deadline passed during prefill")
            self.pool.commit(blocks, chain)
            self._publish_kv()
            tok = script_token(ids, 0, self.args.vocab, self.eos)
            req.generated = 1
            reason = self._stop_reason(req, tok)
            yield worker_pb2.PrefillResponse(first_token=worker_pb2.FirstToken(
                token_id=tok, logprob=script_logprob(0) if request.params.logprobs else 0.0,
                num_cached_tokens=cached, finish_reason=reason))
            if reason:
                return
            send = list(target.block_ids[target.num_cached_tokens // self.bs:])
            started = time.monotonic()
            if self.channels is not None:
                self.channels.begin(target.decode_address)
            try:
                await self._peer(target.decode_address).PushKV(worker_pb2.PushKVRequest(
                    request_id=rid, prefill_worker_id=self.worker_id, channel_epoch=1, first_token_id=tok,
                    first_token_logprob=script_logprob(0) if request.params.logprobs else 0.0,
                    num_blocks=len(send), block_ids=send, num_bytes=0), timeout=5.0, wait_for_ready=False)
            finally:
                if self.channels is not None:
                    self.channels.end(target.decode_address)
            yield worker_pb2.PrefillResponse(transfer_done=worker_pb2.TransferDone(
                bytes=0, transfer_ms=(time.monotonic() - started) * 1000, num_blocks=len(send)))
        finally:
            self.prefilling.pop(rid, None)
            self.pool.release(req.blocks)

    async def _prefill_wait(self, req: Req, deadline: float | None) -> None:
        """The prompt's compute time: fixed (--prefill-ms), or modelled on the prefill GPU (ModelledParts)."""
        wait = self.args.prefill_ms / 1000.0 if self.gpu is None else None
        if deadline is not None:
            left = max(0.0, deadline - time.time())
            wait = left if wait is None else min(wait, left)
        done = [asyncio.ensure_future(req.cancelled.wait())]
        if self.gpu is not None:
            done.append(self.gpu.submit(len(req.prompt) - req.cached))
        _, pending = await asyncio.wait(done, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        for f in pending:
            f.cancel()

    async def drain(self, grace_s: float) -> None:
        """SIGTERM: refuse new requests; wait (up to grace_s) for those in flight."""
        self.draining = True
        end = time.monotonic() + grace_s
        while (self.reqs or self.prefilling) and time.monotonic() < end:
            await asyncio.sleep(0.05)

    # ---- all roles --------------------------------------------------------------------
    async def Cancel(self, request, context):
        found = False
        pre = self.prefilling.get(request.request_id)
        if pre is not None:
            pre.cancelled.set()
            found = True
        req = self.reqs.get(request.request_id)
        if req is not None:
            self._end(req, FR.FINISH_REASON_CANCELLED)
            found = True
        return worker_pb2.CancelResponse(found=found)

    async def GetStats(self, request, context):
        return worker_pb2.WorkerStats(
            **self.pool.counts(), num_waiting=0,
            num_running=sum(1 for r in self.reqs.values() if r.phase == "active") + len(self.prefilling),
            num_reserved=sum(1 for r in self.reqs.values() if r.phase == "reserved"),
            prefix_cache_hit_tokens=self.pool.hit_tokens, prefix_cache_query_tokens=self.pool.query_tokens,
            num_preemptions=0, role=self.role, worker_id=self.worker_id,
            num_waiting_prefill_tokens=self.gpu.waiting_tokens() if self.gpu is not None else 0,
            num_running_context_tokens=sum(len(r.prompt) + r.generated for r in self.reqs.values()
                                           if r.phase == "active"),
            num_open_kv_channels=self.channels.num_open if self.channels is not None else 0,
            num_kv_channels_opened=self.channels.num_opened if self.channels is not None else 0)

    async def StreamKvEvents(self, request, context):
        q: asyncio.Queue = asyncio.Queue(maxsize=KV_QUEUE_MAX)
        self.kv_subs.append(q)
        try:
            yield worker_pb2.KvEvents(stored=list(self.pool.by_hash), snapshot=True, worker_id=self.worker_id,
                                      seq=self.kv_seq, num_total_blocks=self.args.num_blocks)
            while True:
                yield await q.get()
        finally:
            self.kv_subs.remove(q)

    async def Info(self, request, context):
        return common_pb2.ServerInfo(
            protocol_version="v1", role=self.role, model=self.args.model, dtype="float32", block_size=self.bs,
            max_model_len=self.args.max_model_len, num_kv_blocks=self.args.num_blocks, worker_id=self.worker_id,
            version="scripted", vocab_size=self.args.vocab)
