"""What rank 0 sends the other ranks of a tensor-parallel engine for one forward: a small JSON
header through the command pipe, and the step's integer tensors (token ids, positions, slot
mapping, context lengths, block tables, ...) packed into one int64 tensor and broadcast over the
rank group (one collective, on the device: the token ids may have been filled there from the
previous step's samples, unread by the host)."""
from __future__ import annotations

import torch

from pdserve.common.context import ForwardContext
from pdserve.common.parallel import RankGroup

_CTX_FIELDS = ("slot_mapping", "context_lens", "block_tables", "cu_seqlens_q", "chunk_context_lens",
               "chunk_block_tables")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."))
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {name!r}")
    return dtype


def forward_header(mode: str, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                   rows: torch.Tensor | None) -> dict:
    """The header of a forward (``mode``: how the ranks run it, the same everywhere): what the
    other ranks need to receive its tensors (sent first: they wait on the pipe, then join the
    broadcast)."""
    tensors = [input_ids, positions, *(getattr(ctx, f) for f in _CTX_FIELDS), rows]
    return {"k": "forward", "mode": mode, "prefill": ctx.is_prefill, "max_seqlen_q": ctx.max_seqlen_q,
            "nd": ctx.num_decode_tokens, "max_context_len": ctx.max_context_len,
            "shapes": [list(t.shape) if t is not None else None for t in tensors],
            "dtypes": [str(t.dtype) if t is not None else None for t in tensors]}


def broadcast_payload(group: RankGroup, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                      rows: torch.Tensor | None) -> None:
    """Rank 0's half of the broadcast ``forward_header`` announced."""
    tensors = [input_ids, positions, *(getattr(ctx, f) for f in _CTX_FIELDS), rows]
    group.broadcast(torch.cat([t.reshape(-1).to(torch.int64) for t in tensors if t is not None]))


def receive_forward(group: RankGroup, header: dict, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext, torch.Tensor | None]:
    """The other ranks' half: ``(input_ids, positions, ctx, rows)`` as rank 0 had them."""
    shapes, dtypes = header["shapes"], header["dtypes"]
    sizes = [int(torch.Size(s).numel()) for s in shapes if s is not None]
    payload = group.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=device))
    parts = iter(payload.split(sizes))
    out: list[torch.Tensor | None] = []
    for shape, dtype in zip(shapes, dtypes):
        out.append(None if shape is None else next(parts).view(shape).to(_dtype(dtype)))
    input_ids, positions, *ctx_tensors, rows = out
    assert input_ids is not None and positions is not None
    fields = dict(zip(_CTX_FIELDS, ctx_tensors))
    ctx = ForwardContext(is_prefill=bool(header["prefill"]), max_seqlen_q=int(header["max_seqlen_q"]),
                         num_decode_tokens=int(header["nd"]), max_context_len=header["max_context_len"],
                         **fields)  # type: ignore[arg-type]
    return input_ids, positions, ctx, rows
