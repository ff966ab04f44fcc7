"""The paged-attention layer (pdserve/common/layers/attention.py) on the torch backend."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.common.context import ForwardContext, forward_context
from pdserve.common.layers.attention import PagedAttention


def test_decode_writes_into_out_and_prefill_refuses_it():
    """``PagedAttention(out=...)``: a decode step writes the given tensor (the decode chain's
    padded rows); a prefill step has no such path and says so."""
    torch.manual_seed(0)
    attn = PagedAttention(4, 2, 16, "torch")
    attn.k_cache, attn.v_cache = torch.randn(2, 2, 8, 2, 16).unbind(0)       # 2 blocks of 8 tokens
    q = torch.randn(3, 4, 16)
    ctx = ForwardContext(is_prefill=False, slot_mapping=torch.tensor([0, 1, 8], dtype=torch.int32),
                         context_lens=torch.tensor([4, 8, 3], dtype=torch.int32),
                         block_tables=torch.tensor([[0], [0], [1]], dtype=torch.int32), max_context_len=8)
    with forward_context(ctx):
        ref = attn(q, q[:, :2], q[:, :2], kv_stored=True)
        buf = torch.full((5, 4, 16), float("nan"))
        got = attn(q, q[:, :2], q[:, :2], kv_stored=True, out=buf[:3])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(buf[:3], ref) and buf[3:].isnan().all()
    cache = attn.k_cache.clone()
    with forward_context(dataclasses.replace(ctx, is_prefill=True, cu_seqlens_q=torch.tensor([0, 3]))):
        with pytest.raises(ValueError, match="decode steps only"):
            attn(q, q[:, :2], q[:, :2], out=buf[:3])
    assert torch.equal(attn.k_cache, cache)                   # refused before K/V were stored
