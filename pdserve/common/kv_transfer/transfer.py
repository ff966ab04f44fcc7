"""The KV transfer protocol over pair channels, followed by ``KvSender`` and ``KvReceiver``.

Both sides issue the same messages in PushKV order (the prefill worker never has two PushKV in
flight to one decode worker). ``n`` blocks cross as ``plan_chunks`` messages: consecutive block
ids pool to pool, others through two staging buffers. The first token (8 bytes) may ride at the
end of the last message, so a send can start before the token reaches the host. An FP8 pool
crosses as its bytes (``blocks.wire_view``); its per-tensor scales are the model's on both
sides (the same checkpoint), so only blocks move. Any send
failure bumps the pair's epoch; a newer epoch makes the receiver abort the old channel.
"""
from __future__ import annotations

import logging
import time

import torch

from .blocks import (
    contiguous_range,
    gather_blocks,
    gather_heads,
    head_bytes,
    head_range,
    plan_chunks,
    scatter_blocks,
    scatter_heads,
    wire_view,
)
from .channel import PairChannel

log = logging.getLogger(__name__)


def initial_epoch() -> int:
    """A fresh epoch: microseconds since the Unix epoch, larger than a restarted worker's last."""
    return time.time_ns() // 1000


class FirstTokenRef:
    """Row ``row`` of a step's ``token_ids`` ([B] int64) and ``logprobs`` ([B] fp32 or None),
    on the pool's device; on CUDA written before the step's ``ready_event``."""

    __slots__ = ("token_ids", "logprobs", "row")

    def __init__(self, token_ids: torch.Tensor, logprobs: torch.Tensor | None, row: int) -> None:
        self.token_ids, self.logprobs, self.row = token_ids, logprobs, int(row)

    def message(self) -> torch.Tensor:
        """The 8-byte wire message: ``int32[2]`` = (token id, logprob's fp32 bits)."""
        tok = self.token_ids[self.row:self.row + 1].to(torch.int32)
        if self.logprobs is None:
            lp = torch.zeros(1, dtype=torch.int32, device=tok.device)
        else:
            lp = self.logprobs[self.row:self.row + 1].to(torch.float32).view(torch.int32)
        return torch.cat([tok, lp])


def parse_first_token(msg: torch.Tensor) -> tuple[int, float]:
    """(token id, logprob) from a received ``int32[2]`` first-token message."""
    host = msg.cpu()
    return int(host[0]), float(host[1:2].view(torch.float32)[0])


_TOKEN_BYTES = 8


def _trailer_elems(kv_cache: torch.Tensor) -> int:
    """Pool elements that hold the 8 first-token bytes at the end of a message."""
    return -(-_TOKEN_BYTES // kv_cache.element_size())


def _staging(slots: list, slot: int, need: int, kv_cache: torch.Tensor) -> torch.Tensor:
    buf = slots[slot]
    if buf is None or buf.numel() < need:
        buf = torch.empty(need, dtype=kv_cache.dtype, device=kv_cache.device)
        slots[slot] = buf
    return buf


def _enqueue_send_on(ch: PairChannel, kv_cache: torch.Tensor, ids: list[int],
                     max_message_bytes: int, deadline: float,
                     ready_event: torch.cuda.Event | None = None,
                     staging: list | None = None,
                     first_token: FirstTokenRef | None = None,
                     heads: tuple[int, int] | None = None) -> list:
    """Start sending blocks ``ids`` of ``kv_cache`` (``first_token`` at the end); the caller must
    ``ch.synchronize`` the returned operations. ``staging``: two reusable buffer slots;
    ``heads``: only these KV heads ``[start, end)`` of each block (None: all)."""
    kv_cache = wire_view(kv_cache)
    heads, sliced, block_elems = _slice(kv_cache, heads)
    block_bytes = block_elems * kv_cache.element_size()
    chunks = plan_chunks(len(ids), block_bytes, max_message_bytes)
    stream = ch.stream
    if stream is not None:
        if ready_event is not None:
            stream.wait_event(ready_event)
        else:
            stream.wait_stream(torch.cuda.current_stream(kv_cache.device))
    slots: list = staging if staging is not None else [None, None]
    last: list = [None, None]   # the last send from each staging buffer
    ops: list = []              # all must be waited: a dropped Gloo Work cancels its send
    ctx = torch.cuda.stream(stream) if stream is not None else _Null()
    with ctx:  # staging buffers are allocated on (and freed in the order of) the side stream
        for i, (s, e) in enumerate(chunks):
            sub = ids[s:e]
            slot = i % 2
            token = first_token if i == len(chunks) - 1 else None
            rng = contiguous_range(sub)
            if rng is not None and token is None and not sliced:
                ops.append(ch.isend(kv_cache[rng[0]:rng[1]], tag=i))
                continue
            if last[slot] is not None:  # the buffer is free once its last send is done
                ch.wait(last[slot], deadline)
            extra = _trailer_elems(kv_cache) if token is not None else 0
            need = len(sub) * block_elems
            buf = _staging(slots, slot, need + extra, kv_cache)
            if sliced:
                gather_heads(kv_cache, sub, heads, buf, stream=stream)
            else:
                gather_blocks(kv_cache, sub, out=buf, stream=stream)
            msg = buf[:need + extra]
            if token is not None:
                msg[need:].view(torch.uint8)[:_TOKEN_BYTES].copy_(token.message().view(torch.uint8))
            last[slot] = ch.isend(msg, tag=i)
            ops.append(last[slot])
    return ops


def _recv_blocks_on(ch: PairChannel, kv_cache: torch.Tensor, ids: list[int],
                    max_message_bytes: int, deadline: float,
                    staging: list | None = None, with_first_token: bool = False,
                    heads: tuple[int, int] | None = None) -> tuple[int, tuple[int, float] | None]:
    """Receive blocks ``ids`` into ``kv_cache`` (only its KV heads ``heads``, ``[start, end)``,
    when given); returns ``(num_bytes, (token, logprob) or None)``. On return the data landed
    (CPU) or its scatter is enqueued on ``ch.stream`` (CUDA)."""
    kv_cache = wire_view(kv_cache)
    heads, sliced, block_elems = _slice(kv_cache, heads)
    block_bytes = block_elems * kv_cache.element_size()
    chunks = plan_chunks(len(ids), block_bytes, max_message_bytes)
    stream = ch.stream
    slots: list = staging if staging is not None else [None, None]
    posted: list = [None] * len(chunks)   # (work, buffer or None)

    extra = _trailer_elems(kv_cache) if with_first_token else 0

    def post(i: int) -> None:
        s, e = chunks[i]
        sub = ids[s:e]
        rng = contiguous_range(sub)
        trailer = extra if i == len(chunks) - 1 else 0
        if rng is not None and not trailer and not sliced:
            posted[i] = (ch.irecv(kv_cache[rng[0]:rng[1]], tag=i), None)
        else:
            buf = _staging(slots, i % 2, len(sub) * block_elems + trailer, kv_cache)
            view = buf[:len(sub) * block_elems + trailer]
            posted[i] = (ch.irecv(view, tag=i), view)

    token_msg = None
    ctx = torch.cuda.stream(stream) if stream is not None else _Null()
    with ctx:
        for i in range(min(2, len(chunks))):
            post(i)
        for i, (s, e) in enumerate(chunks):
            work, view = posted[i]
            ch.wait(work, deadline)
            if view is not None:
                need = (e - s) * block_elems
                if sliced:
                    scatter_heads(kv_cache, ids[s:e], heads, view[:need], stream=stream)
                else:
                    scatter_blocks(kv_cache, ids[s:e], view[:need], stream=stream)
                if extra and i == len(chunks) - 1:
                    token_msg = view[need:].view(torch.uint8)[:_TOKEN_BYTES].clone().view(torch.int32)
            if i + 2 < len(chunks):
                post(i + 2)   # reuses slot i % 2: ordered after the scatter above
        ch.synchronize([p[0] for p in posted], deadline)
        first = parse_first_token(token_msg) if token_msg is not None else None
    return len(ids) * block_bytes, first


def _slice(kv_cache: torch.Tensor, heads: tuple[int, int] | None) -> tuple[tuple[int, int], bool, int]:
    """``(heads, sliced, elements a block of them has)``: ``sliced`` unless all heads move."""
    h0, h1 = head_range(kv_cache, heads)
    return (h0, h1), (h1 - h0) != kv_cache.shape[4], head_bytes(kv_cache, heads) // kv_cache.element_size()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

