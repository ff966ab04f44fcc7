"""The scripted worker's state: its scripted output, a router's outbox, the KV block pool, a request.

Token ``i`` of a request (the first token is i = 0) is ``script_token(prompt_ids, i, vocab)``:
``(crc32(prompt ids as uint32) + i) % vocab``, stepping over the EOS ids, so a test knows the
output in advance. ``ModelledParts`` replace the fixed timings with a model (bench/sim/worker.py
builds them). All of it lives on the worker's event loop thread.
"""
from __future__ import annotations

import asyncio
import zlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.grpc_utils import ResourceExhausted
from pdserve.common.hashing import block_hash_chain
from pdserve.v1 import common_pb2, worker_pb2


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
