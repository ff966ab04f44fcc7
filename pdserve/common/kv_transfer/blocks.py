"""Gather / scatter of whole KV blocks of the paged pool
``kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, and the chunking of
a transfer. Both sides cut a transfer into the same ``plan_chunks``, so ``max_message_bytes``
must match on a pair; few large messages are preferred (chosen by measurement: bench/NOTES.md).
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch

from .errors import KvTransferError

#: Largest single message on a pair channel (bytes); the same on both sides of a pair.
DEFAULT_MAX_MESSAGE_BYTES = 512 * 1024 * 1024

BlockIds = Sequence[int] | torch.Tensor


def bytes_per_block(kv_cache: torch.Tensor) -> int:
    """Bytes of one block of all layers (K and V)."""
    return kv_cache[0].numel() * kv_cache.element_size()


def wire_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The pool as the channels move it: an FP8 pool as its bytes (``uint8``, same shape: not
    every collective backend takes float8 tensors), any other pool as it is."""
    if kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return kv_cache.view(torch.uint8)
    return kv_cache


def check_pool(kv_cache: torch.Tensor) -> None:
    """The pool must be a contiguous 6-d ``[num_blocks, layers, 2, block, heads, dim]`` tensor."""
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise KvTransferError(
            "kv_cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise KvTransferError("kv_cache must be contiguous")


def as_id_list(block_ids: BlockIds) -> list[int]:
    if isinstance(block_ids, torch.Tensor):
        return [int(b) for b in block_ids.flatten().tolist()]
    return [int(b) for b in block_ids]


def check_block_ids(block_ids: BlockIds, num_blocks: int) -> list[int]:
    """Validated list of block ids: in ``[0, num_blocks)``, no duplicates."""
    ids = as_id_list(block_ids)
    for b in ids:
        if b < 0 or b >= num_blocks:
            raise KvTransferError(f"block id {b} out of range [0, {num_blocks})")
    if len(set(ids)) != len(ids):
        raise KvTransferError("block ids contain duplicates")
    return ids


def plan_chunks(num_blocks: int, block_bytes: int,
                max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` block slices of at most ``max_message_bytes`` (at least one block);
    deterministic, so both sides compute the same plan."""
    if num_blocks <= 0:
        return []
    per = max(1, int(max_message_bytes) // max(1, int(block_bytes)))
    return [(s, min(s + per, num_blocks)) for s in range(0, num_blocks, per)]


def contiguous_range(ids: Sequence[int]) -> tuple[int, int] | None:
    """``(first, end)`` when ``ids`` is ``first, first+1, ..., end-1``; else None."""
    if not ids:
        return None
    first = ids[0]
    for i, b in enumerate(ids):
        if b != first + i:
            return None
    return first, first + len(ids)


def _index_tensor(ids: BlockIds, device: torch.device) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        return ids.to(device=device, dtype=torch.long, non_blocking=True).flatten()
    idx = torch.tensor(list(ids), dtype=torch.long)
    if device.type == "cuda":
        return idx.pin_memory().to(device, non_blocking=True)
    return idx


def _wide_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` ([n, ...], contiguous) as ``[n, k]`` rows of the widest integer dtype dividing a row,
    so copies move 8-byte elements; bit-exact (only the view's dtype changes)."""
    rows = t.view(t.shape[0], -1)
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = torch.empty(0, dtype=dtype).element_size()
        if (rows.shape[1] * rows.element_size()) % size == 0:
            return rows.view(torch.uint8).view(dtype) if rows.dtype != dtype else rows
    return rows.view(torch.uint8)


def _stream_ctx(stream):
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def gather_blocks(kv_cache: torch.Tensor, block_ids: BlockIds,
                  out: torch.Tensor | None = None,
                  stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """Blocks ``block_ids`` (in order) as ``[len(block_ids), *kv_cache.shape[1:]]``.

    ``out``: optional contiguous staging buffer of the pool's dtype with enough elements;
    ``stream``: CUDA side stream to copy on (the caller orders it after the KV writes).
    """
    n = len(block_ids)
    block_shape = tuple(kv_cache.shape[1:])
    with _stream_ctx(stream):
        idx = _index_tensor(block_ids, kv_cache.device)
        if out is None:
            return torch.index_select(_wide_rows(kv_cache), 0, idx).view(kv_cache.dtype).view(
                n, *block_shape)
        if out.dtype != kv_cache.dtype or out.device != kv_cache.device:
            raise KvTransferError(
                f"staging buffer is {out.dtype} on {out.device}, pool is {kv_cache.dtype} "
                f"on {kv_cache.device}")
        need = n * kv_cache[0].numel()
        if not out.is_contiguous() or out.numel() < need:
            raise KvTransferError(
                f"staging buffer too small or not contiguous ({out.numel()} < {need} elements)")
        view = out.view(-1)[:need].view(n, *block_shape)
        torch.index_select(_wide_rows(kv_cache), 0, idx, out=_wide_rows(view))
        return view


def scatter_blocks(kv_cache: torch.Tensor, block_ids: BlockIds, buffer: torch.Tensor,
                   stream: torch.cuda.Stream | None = None) -> None:
    """Write ``buffer[i]`` ([n, *kv_cache.shape[1:]] elements, pool dtype) into block
    ``block_ids[i]``; ``stream``: CUDA side stream to copy on."""
    n = len(block_ids)
    block_shape = tuple(kv_cache.shape[1:])
    if buffer.numel() != n * kv_cache[0].numel():
        raise KvTransferError(
            f"buffer has {buffer.numel()} elements, {n} blocks need {n * kv_cache[0].numel()}")
    if buffer.dtype != kv_cache.dtype:
        raise KvTransferError(f"buffer dtype {buffer.dtype} != pool dtype {kv_cache.dtype}")
    if n == 0:
        return
    with _stream_ctx(stream):
        idx = _index_tensor(block_ids, kv_cache.device)
        _wide_rows(kv_cache).index_copy_(0, idx, _wide_rows(buffer.reshape(n, *block_shape)))


def head_range(kv_cache: torch.Tensor, heads: tuple[int, int] | None) -> tuple[int, int]:
    """``heads`` checked against the pool's KV heads (None: all of them)."""
    num_heads = kv_cache.shape[4]
    h0, h1 = (0, num_heads) if heads is None else (int(heads[0]), int(heads[1]))
    if not 0 <= h0 < h1 <= num_heads:
        raise KvTransferError(f"KV heads [{h0}, {h1}) outside the pool's [0, {num_heads})")
    return h0, h1


def head_bytes(kv_cache: torch.Tensor, heads: tuple[int, int] | None) -> int:
    """Bytes of KV heads ``heads`` (None: all) of one block of all layers."""
    h0, h1 = head_range(kv_cache, heads)
    return bytes_per_block(kv_cache) // kv_cache.shape[4] * (h1 - h0)


def gather_heads(kv_cache: torch.Tensor, block_ids: BlockIds, heads: tuple[int, int], out: torch.Tensor,
                 stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """KV heads ``heads`` (``[start, end)``) of blocks ``block_ids`` as a contiguous
    ``[n, layers, 2, block_size, end - start, head_dim]`` view of ``out`` (pool dtype, enough
    elements); bit-exact."""
    h0, h1 = head_range(kv_cache, heads)
    n = len(block_ids)
    shape = (n, *kv_cache.shape[1:4], h1 - h0, kv_cache.shape[5])
    need = n * kv_cache[0].numel() // kv_cache.shape[4] * (h1 - h0)
    if out.dtype != kv_cache.dtype or not out.is_contiguous() or out.numel() < need:
        raise KvTransferError(f"staging buffer of {out.numel()} {out.dtype} elements cannot hold {need} "
                              f"{kv_cache.dtype} ones")
    view = out.view(-1)[:need].view(shape)
    with _stream_ctx(stream):
        idx = _index_tensor(block_ids, kv_cache.device)
        view.copy_(torch.index_select(kv_cache, 0, idx)[:, :, :, :, h0:h1])
    return view


def scatter_heads(kv_cache: torch.Tensor, block_ids: BlockIds, heads: tuple[int, int], buffer: torch.Tensor,
                  stream: torch.cuda.Stream | None = None) -> None:
    """Write ``buffer`` (what :func:`gather_heads` made, pool dtype) into KV heads ``heads`` of
    blocks ``block_ids``; the pool's other heads are untouched."""
    h0, h1 = head_range(kv_cache, heads)
    n = len(block_ids)
    shape = (n, *kv_cache.shape[1:4], h1 - h0, kv_cache.shape[5])
    if buffer.dtype != kv_cache.dtype or buffer.numel() != torch.Size(shape).numel():
        raise KvTransferError(f"buffer of {buffer.numel()} {buffer.dtype} elements is not {n} blocks of "
                              f"{h1 - h0} heads of the {kv_cache.dtype} pool")
    if n == 0:
        return
    with _stream_ctx(stream):
        idx = _index_tensor(block_ids, kv_cache.device)
        kv_cache[:, :, :, :, h0:h1].index_copy_(0, idx, buffer.reshape(shape))
