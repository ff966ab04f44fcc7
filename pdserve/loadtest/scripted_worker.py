"""A scripted pdserve worker: the real gRPC ``Worker`` + ``InfoService``, no model behind it.

    python -m pdserve.loadtest.scripted_worker --port 50053 --role both --vocab 49152 --block-size 16 --step-ms 5

Token ``i`` of a request (the first token is i = 0) is ``script_token(prompt_ids, i, vocab)``:
``(crc32(prompt ids as uint32) + i) % vocab``, stepping over the EOS ids, so a test knows the
output in advance. Engine steps run on a fixed schedule, every ``--step-ms`` while a request is
active, one token per request and step; steps that came due while the process was late (CPU
contention) run at once (``--catch-up``, the default; ``PDSERVE_SCRIPTED_CATCH_UP=0`` or
``--no-catch-up`` for the old schedule, step_ms after each step's work). Outputs go to each
router's Subscribe stream as decode_worker sends them: one ``StepOutputs`` with everything that
came since the stream's last send, one ``SequenceOutput`` per request (one token each while the
router keeps up; several merged when it does not). It keeps the contract of
protos/pdserve/v1/worker.proto: KV block accounting with a hash-chained prefix cache
(pdserve.common.hashing), reservations under a lease, PushKV that checks the reserved block ids
(no bytes move), Submit, Subscribe (initial metadata sent once the subscription is registered;
a second Subscribe of a router replaces the first; a closed stream cancels that router's
requests), Cancel (an admitted request ends with FINISH_REASON_CANCELLED on the stream),
deadlines (FINISH_REASON_DEADLINE), stop_token_ids / EOS / max_tokens / max_model_len,
GetStats, and StreamKvEvents (snapshot first, then numbered messages: ``KvEvents.seq``). Used by
the router tests and the router-overhead benchmark.

``ModelledParts`` replace the fixed timings with a model: a pool with true hits, evictions and
events, prefill time from the uncached tokens on a FIFO prefill GPU, decode steps timed from
their batch, pair channels counted. The lab's scale simulation (bench/sim/worker.py) builds
them. On SIGTERM every worker drains: health NOT_SERVING, new requests refused (UNAVAILABLE),
those in flight finish within the grace period.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.common.grpc_utils import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
    Service,
    Unavailable,
    build_server,
    client_channel,
    serve,
)
from pdserve.common.hashing import block_hash_chain
from pdserve.v1 import common_pb2, common_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger("scripted_worker")
FR = common_pb2
ROLES = {"prefill": FR.ROLE_PREFILL, "decode": FR.ROLE_DECODE, "both": FR.ROLE_BOTH}
# At most this many overdue engine steps are run at once (then the schedule restarts from now).
MAX_CATCH_UP = 64
# KV event messages queued for one slow subscriber before further ones are dropped (it sees the
# gap in KvEvents.seq and re-subscribes for a snapshot).
KV_QUEUE_MAX = 4096


def script_token(prompt_ids, i: int, vocab: int, eos_ids=(2,)) -> int:
    """The scripted token number ``i`` (0 = first) for a prompt."""
    t = (zlib.crc32(array("I", prompt_ids).tobytes()) + i) % vocab
    while t in eos_ids:
        t = (t + 1) % vocab
    return t


def script_logprob(i: int) -> float:
    return -0.05 - (i % 10) / 10.0


class Outbox:
    """One router's outputs not yet sent on its Subscribe stream, merged per request.

    The engine adds to it every step; the Subscribe stream takes everything there is whenever
    it can send (so steps that came while a send waited on the router go out as one
    StepOutputs with one SequenceOutput per request, as decode_worker's coalescing does), and
    builds the protobuf only then.
    """

    __slots__ = ("pending", "ready", "closed")

    def __init__(self) -> None:
        # request id -> [token_ids, logprobs, finish_reason, error, num_prompt_tokens, num_cached_tokens]
        self.pending: dict[str, list] = {}
        self.ready = asyncio.Event()
        self.closed = False

    def add(self, rid: str, token_ids: list[int], logprobs: list[float] | None, finish: int = 0,
            error: str = "", num_prompt: int = 0, num_cached: int = 0) -> None:
        e = self.pending.get(rid)
        if e is None:
            self.pending[rid] = [token_ids, logprobs or [], finish, error, num_prompt, num_cached]
        else:
            e[0] = e[0] + token_ids
            if logprobs:
                e[1] = e[1] + logprobs
            if finish:
                e[2], e[3] = finish, error
            if num_prompt:
                e[4], e[5] = num_prompt, num_cached
        self.ready.set()

    def add_output(self, out: worker_pb2.SequenceOutput) -> None:
        self.add(out.request_id, list(out.token_ids), list(out.logprobs), out.finish_reason, out.error,
                 out.num_prompt_tokens, out.num_cached_tokens)

    def take(self, step: int) -> worker_pb2.StepOutputs:
        pending, self.pending = self.pending, {}
        self.ready.clear()
        SO = worker_pb2.SequenceOutput
        return worker_pb2.StepOutputs(step=step, outputs=[
            SO(request_id=rid, token_ids=e[0], logprobs=e[1], finish_reason=e[2], error=e[3],
               num_prompt_tokens=e[4], num_cached_tokens=e[5]) for rid, e in pending.items()])

    def close(self) -> None:
        self.closed = True
        self.ready.set()


class BlockPool:
    """KV blocks with reference counts and a hash-chained prefix cache (LRU eviction)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.ref = [0] * num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        self.by_hash: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.stored: list[int] = []
        self.evicted: list[int] = []
        self.hit_tokens = self.query_tokens = 0

    def _take(self) -> int:
        b, _ = self.free.popitem(last=False)
        h = self.hash[b]
        if h is not None:
            self.hash[b] = None
            del self.by_hash[h]
            self.evicted.append(h)
        self.ref[b] = 1
        return b

    def allocate(self, ids: list[int]) -> tuple[list[int], int, list[int]]:
        """Blocks for a prompt (reusing cached prefix blocks): (block ids, cached tokens, hash chain)."""
        chain = block_hash_chain(ids, self.bs)
        blocks: list[int] = []
        for h in chain:
            b = self.by_hash.get(h)
            if b is None:
                break
            blocks.append(b)
        needed = -(-len(ids) // self.bs) - len(blocks)
        if needed > len(self.free) - sum(1 for b in blocks if self.ref[b] == 0):
            raise ResourceExhausted(f"no free KV blocks ({needed} needed, {len(self.free)} free)")
        for b in blocks:
            self.ref[b] += 1
            self.free.pop(b, None)
        cached = len(blocks) * self.bs
        blocks += [self._take() for _ in range(needed)]
        self.hit_tokens += cached
        self.query_tokens += len(ids)
        return blocks, cached, chain

    def commit(self, blocks: list[int], chain: list[int]) -> None:
        """The prompt's KV is computed/landed: its full blocks become reusable prefix blocks."""
        for b, h in zip(blocks, chain):
            if self.hash[b] is None and h not in self.by_hash:
                self.hash[b] = h
                self.by_hash[h] = b
                self.stored.append(h)

    def grow(self, blocks: list[int], num_tokens: int) -> bool:
        while len(blocks) * self.bs < num_tokens:
            if not self.free:
                return False
            blocks.append(self._take())
        return True

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
                if self.hash[b] is None:  # uncached blocks are reused first
                    self.free.move_to_end(b, last=False)
        blocks.clear()

    def take_events(self) -> tuple[list[int], list[int]]:
        stored, evicted, self.stored, self.evicted = self.stored, self.evicted, [], []
        return stored, evicted

    def counts(self) -> dict[str, int]:
        used = sum(1 for r in self.ref if r > 0)
        cached = len(self.by_hash)
        free = sum(1 for b in self.free if self.hash[b] is None)
        return dict(num_used_blocks=used, num_cached_blocks=cached, num_free_blocks=free,
                    num_total_blocks=len(self.ref))


@dataclass
class Req:
    rid: str
    prompt: list[int]
    params: common_pb2.SamplingParams
    router_id: str
    deadline: float | None           # Unix seconds
    blocks: list[int]
    chain: list[int]
    cached: int
    phase: str                       # "reserved" | "active"
    lease_expires: float | None = None
    generated: int = 0
    first_sent: bool = False
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    active_since: float = 0.0        # loop time it joined the engine (decodes from the next step on)
    crc: int = -1                    # crc32 of the prompt (script_token's base), computed once

    def token(self, i: int, vocab: int, eos_ids) -> int:
        if self.crc < 0:
            self.crc = zlib.crc32(array("I", self.prompt).tobytes())
        t = (self.crc + i) % vocab
        while t in eos_ids:
            t = (t + 1) % vocab
        return t


@dataclass
class ModelledParts:
    """A modelled backend for ScriptedWorker. ``pool``: BlockPool's interface; ``cost``:
    ``decode_ms(batch, context_tokens)``; ``gpu``: ``submit(tokens)`` -> awaitable, ``run()``,
    ``waiting_tokens()``; ``channels``: ``begin(addr)``, ``end(addr)``, ``num_open``."""
    pool: Any
    cost: Any
    gpu: Any
    channels: Any


class ScriptedWorker(worker_pb2_grpc.WorkerServicer, common_pb2_grpc.InfoServiceServicer):
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
        """Steps on a fixed schedule (every step_ms from the first request on, not step_ms after
        the previous step's work). With --catch-up (the default), steps that were due while the
        process was late (CPU contention, a slow send) are run at once, as a GPU engine that kept
        stepping would have: each request gets one token per step it was in (at most
        MAX_CATCH_UP steps), in one SequenceOutput."""
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
            if not self.args.catch_up:        # the old drifting schedule: step_ms after the work
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


def parse_args(argv: list[str] | None = None,
               add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The worker's flags, plus those ``add_arguments`` adds (a modelled backend's)."""
    p = argparse.ArgumentParser(prog="python -m pdserve.loadtest.scripted_worker", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--advertise", default="127.0.0.1", help="host in the kv_store_address it reports")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--role", choices=sorted(ROLES), default="both")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="model name reported by Info")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--step-ms", type=float, default=5.0, help="engine step interval")
    p.add_argument("--prefill-ms", type=float, default=None, help="simulated prefill time (default: --step-ms)")
    p.add_argument("--lease-ms", type=int, default=30_000, help="default reservation lease")
    p.add_argument("--default-max-tokens", type=int, default=64, help="max_tokens when a request sends 0")
    p.add_argument("--eos-ids", default="2", help="comma list of EOS ids (never scripted; stop unless ignore_eos)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--fail-submits", type=int, default=0,
                   help="fail the first N Submit/Reserve calls with UNAVAILABLE (-1 = all), for failover tests")
    p.add_argument("--catch-up", action=argparse.BooleanOptionalAction,
                   default=os.environ.get("PDSERVE_SCRIPTED_CATCH_UP", "1") != "0",
                   help="run the engine steps that came due while the process was late (CPU contention) at once, "
                        "as a GPU engine that kept stepping would (env PDSERVE_SCRIPTED_CATCH_UP=0: off)")
    p.add_argument("--kv-drop-every", type=int, default=0,
                   help="drop every Nth KV event message (tests the router's gap repair)")
    p.add_argument("--drain-grace-s", type=float, default=1.0, help="on SIGTERM: time for requests in flight")
    p.add_argument("--log-level", default="WARNING")
    if add_arguments is not None:
        add_arguments(p)
    args = p.parse_args(argv)
    if args.prefill_ms is None:
        args.prefill_ms = args.step_ms
    return args


async def _main(args: argparse.Namespace, parts: ModelledParts | None) -> None:
    worker = ScriptedWorker(args, parts)
    server = build_server(f"{args.host}:{args.port}", [
        Service(worker_pb2.DESCRIPTOR.services_by_name["Worker"], worker_pb2_grpc.add_WorkerServicer_to_server, worker),
        Service(common_pb2.DESCRIPTOR.services_by_name["InfoService"],
                common_pb2_grpc.add_InfoServiceServicer_to_server, worker),
    ])
    tasks = [asyncio.create_task(worker.run_engine())]
    if worker.gpu is not None:
        tasks.append(asyncio.create_task(worker.gpu.run()))
    try:
        await serve(server, grace_s=args.drain_grace_s, drain=worker.drain)
    finally:
        for t in tasks:
            t.cancel()


def main(argv: list[str] | None = None,
         add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
         make_parts: Callable[[argparse.Namespace], ModelledParts] | None = None) -> int:
    """Run one worker; ``add_arguments`` / ``make_parts`` plug in a modelled backend."""
    args = parse_args(argv, add_arguments)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_main(args, make_parts(args) if make_parts is not None else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
