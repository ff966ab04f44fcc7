"""The decode chain: the decoder's dense layers as one chain of weight-preloading, PDL-launched
kernels, attention unchanged.

Per layer: ``qkv`` -> qk-norm/RoPE/KV store -> paged attention -> ``o_proj`` partials -> add +
post-attention RMSNorm -> ``gate_up`` and SiLU-mul -> ``down`` partials -> add + the next layer's
input RMSNorm (the final norm after the last layer). Two kinds of projections, by batch rows:

- small, 1 to ``MAX_ROWS`` rows: Triton register tiles (pdserve/common/ops/dataflow.py):
  ``qkv`` through ``preload_linear`` at <= 16 rows where hidden is one or two tiles, else split-K
  partials added up by the qk-norm/RoPE kernel (``qkv_preloads``); ``gate_up`` as partials added
  up by ``silu_partials``;
- wide, ``MAX_ROWS + 1`` to ``WIDE_ROWS`` rows: Gluon TMA/warp-group-MMA GEMMs
  (pdserve/common/ops/gluon_gemm.py, tiles by pdserve/common/ops/gemm_tiles.py): ``qkv`` written
  whole, ``gate_up`` with SiLU-mul in its epilogue, ``o_proj`` and ``down`` as split-K partials.
  The activations the GEMMs read (normed x, attention output, SiLU-mul output) have
  ``padded_rows`` rows, whole M tiles; rows past M are never written by a row-wise kernel and
  never read into a real row. The residual stream keeps M rows.

It computes what ``DecoderForCausalLM.forward`` computes, rounding at the same points (each GEMM
output in the model dtype before its residual add or activation); only the GEMMs' summation
order differs.

Taken (``takes_chain``) for a decode forward (no prompt rows) of 1 to ``WIDE_ROWS`` rows on a GPU
with programmatic dependent launch (pdserve/common/ops/pdl.py; launched plainly, the same kernels
gain nothing over the usual path), when the model ``supports`` the range's tiling, the fused kernels are on
and ``PDSERVE_DATAFLOW_DECODE`` is on (default); the wide range also needs a Hopper GPU, a Triton
with Gluon and ``PDSERVE_DATAFLOW_WIDE`` on (default). Otherwise the model runs its usual forward.
Import it only where Triton is importable (the decoder does so on CUDA with the fused kernels on).

What the chain gains and where its time goes, as measured: bench/notes/decode_chain.md.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import NamedTuple, Protocol, cast

import torch
from torch import nn

from pdserve.common import env
from pdserve.common.config import ModelConfig
from pdserve.common.context import forward_context, get_forward_context
from pdserve.common.layers.attention import PagedAttention
from pdserve.common.layers.norm import RMSNorm
from pdserve.common.ops.dataflow import (
    BK,
    BN,
    MAX_ROWS,
    PRELOAD_ROWS,
    add_norm_partials,
    preload_linear,
    silu_partials,
    splitk,
)
from pdserve.common.ops.gemm_tiles import OPS, WIDE_ROWS, padded_rows, wide_fits, wide_tiles
from pdserve.common.ops.paged_attention import sm_count
from pdserve.common.ops.pdl import pdl_available

MAX_PROGRAMS_PER_SM = 4     # beyond this a projection's tiles are not all resident: the preload stops paying


class ChainAttention(Protocol):
    """A layer's attention as the chain reads it: the merged ``qkv_proj`` (no bias), ``o_proj``,
    the fused qk-norm/RoPE that also stores K/V, and the paged attention over the cache."""
    qkv_proj: nn.Linear
    o_proj: nn.Linear
    attn: PagedAttention
    num_heads: int
    head_dim: int
    q_size: int

    def fused_qk_norm_rope(self, qkv: torch.Tensor, positions: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class ChainMLP(Protocol):
    """A layer's MLP: the merged ``gate_up_proj`` (SiLU-mul after it) and ``down_proj``."""
    gate_up_proj: nn.Linear
    down_proj: nn.Linear


class ChainLayer(Protocol):
    """A pre-norm decoder layer: RMSNorm, attention, RMSNorm, MLP, each with a residual add."""
    input_layernorm: RMSNorm
    self_attn: ChainAttention
    post_attention_layernorm: RMSNorm
    mlp: ChainMLP


class ChainModel(Protocol):
    """What a model offers to take the chain (pdserve.common.models.decoder's model does):
    embeddings, ``layers`` of :class:`ChainLayer` and a final RMSNorm."""
    config: ModelConfig
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: RMSNorm


@functools.lru_cache(maxsize=16)
def supports(cfg: ModelConfig, dtype: torch.dtype, num_sms: int) -> bool:
    """Whether the chain's tiling fits this geometry: no biases, half-precision weights, every K a
    multiple of the tile, every projection's programs resident at once."""
    q = cfg.num_attention_heads * cfg.head_dim
    qkv = q + 2 * cfg.num_key_value_heads * cfg.head_dim
    if dtype not in (torch.bfloat16, torch.float16) or cfg.attention_bias or cfg.o_bias or cfg.mlp_bias:
        return False
    if cfg.hidden_size % BK or q % BK or cfg.intermediate_size % BK:
        return False
    if any(n % BN for n in (qkv, cfg.hidden_size, cfg.intermediate_size)):
        return False
    programs = {"qkv": qkv // BN * (cfg.hidden_size // BK), "o": cfg.hidden_size // BN * (q // BK),
                "gate_up": 2 * cfg.intermediate_size // BN * (cfg.hidden_size // BK),
                "down": cfg.hidden_size // BN * (cfg.intermediate_size // BK)}
    return all(p <= MAX_PROGRAMS_PER_SM * num_sms for p in programs.values())


@functools.lru_cache(maxsize=16)
def supports_wide(cfg: ModelConfig, dtype: torch.dtype) -> bool:
    """Whether the wide range's Gluon tiles fit this geometry: no biases, half-precision weights,
    every projection small enough and tiled exactly (``gemm_tiles.wide_fits``)."""
    if dtype not in (torch.bfloat16, torch.float16) or cfg.attention_bias or cfg.o_bias or cfg.mlp_bias:
        return False
    q = cfg.num_attention_heads * cfg.head_dim
    qkv = q + 2 * cfg.num_key_value_heads * cfg.head_dim
    return wide_fits(q, qkv, cfg.hidden_size, cfg.intermediate_size)


@functools.lru_cache(maxsize=8)
def wide_available(device: torch.device) -> bool:
    """The Gluon kernels can run here: a CUDA GPU of compute capability 9.x (warp-group MMA and
    TMA as Hopper has them) and a Triton whose Gluon has what pdserve/common/ops/gluon_gemm.py
    uses (an older Triton without it, or with another API, means the usual forward)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return gluon_importable()


def gluon_importable() -> bool:
    """Whether pdserve/common/ops/gluon_gemm.py imports (its Gluon names exist in this Triton)."""
    try:
        importlib.import_module("pdserve.common.ops.gluon_gemm")
    except (ImportError, AttributeError):
        return False
    return True


def takes_chain(rows: int, is_prefill: bool, pdl: bool, enabled: bool, supported: bool) -> bool:
    """The rule, on plain values: a pure decode batch of 1..WIDE_ROWS rows, PDL, switched on
    (``PDSERVE_DATAFLOW_DECODE``), a model that supports the tiling of the rows' range
    (``supports`` up to MAX_ROWS; beyond, ``supports_wide`` on a GPU where ``wide_available``
    with ``PDSERVE_DATAFLOW_WIDE`` on)."""
    return 1 <= rows <= WIDE_ROWS and not is_prefill and pdl and enabled and supported


def qkv_preloads(rows: int, hidden: int) -> bool:
    """QKV through ``preload_linear`` (each program holds its whole K) at <= PRELOAD_ROWS rows when
    hidden is one or two K tiles, else split over K (bench/notes/decode_chain.md, "Small range")."""
    return rows <= PRELOAD_ROWS and hidden in (BK, 2 * BK)


def applies(model: ChainModel, input_ids: torch.Tensor) -> bool:
    """``takes_chain`` for this forward (the caller checked CUDA and the fused kernels)."""
    rows, device, dtype = input_ids.shape[0], input_ids.device, model.embed_tokens.weight.dtype
    if not 1 <= rows <= WIDE_ROWS:                                 # cheap checks first
        return False
    if rows <= MAX_ROWS:
        supported = supports(model.config, dtype, sm_count(device))
    else:
        supported = env.dataflow_wide() and wide_available(device) and supports_wide(model.config, dtype)
    return takes_chain(rows, get_forward_context().is_prefill, pdl_available(device), env.dataflow_decode(),
                       supported)


def forward(model: ChainModel, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """input_ids, positions: [B] (decode rows) -> final hidden states [B, H] (after the final norm).
    The qk-norm/RoPE and attention kernels join the chain (launched with PDL) on a GPU that has it;
    elsewhere (the interpreter, tests) every kernel runs with plain launches."""
    with forward_context(dataclasses.replace(get_forward_context(), pdl=pdl_available(input_ids.device))):
        return _layers(model, input_ids, positions)


class Projections(NamedTuple):
    """A layer's four projections for one batch size, on activations of R rows (R = M on the small
    range, ``padded_rows(M)`` on the wide one). ``qkv``: x [R, H] -> QKV [R, N] or its fp32
    partials [S, M, N] (what ``fused_qk_norm_rope`` takes, after the first M rows); ``o_proj`` /
    ``down``: -> fp32 partials [S, R, H] (what ``add_norm_partials`` takes); ``gate_up_act``:
    x -> silu(gate) * up [R, I]."""
    qkv: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    o_proj: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    gate_up_act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _small_projections(rows: int, hidden: int) -> Projections:
    """1..MAX_ROWS rows: the Triton register-tile kernels (pdserve/common/ops/dataflow.py)."""
    qkv = preload_linear if qkv_preloads(rows, hidden) else splitk
    return Projections(qkv, splitk, lambda x, w: silu_partials(splitk(x, w), x.dtype), splitk)


def _wide_projections(rows: int, pdl: bool) -> Projections:
    """MAX_ROWS + 1..WIDE_ROWS rows: the Gluon GEMMs with ``gemm_tiles.wide_tiles``."""
    from pdserve.common.ops import gluon_gemm  # imports Gluon: Hopper only
    t = {op: wide_tiles(op, rows) for op in OPS}
    return Projections(lambda x, w: gluon_gemm.linear(x, w, t["qkv"], pdl),
                       lambda x, w: gluon_gemm.splitk(x, w, t["o_proj"], pdl),
                       lambda x, w: gluon_gemm.silu_linear(x, w, t["gate_up"], pdl),
                       lambda x, w: gluon_gemm.splitk(x, w, t["down"], pdl))


def _layers(model: ChainModel, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    layers = cast("list[ChainLayer]", list(model.layers))
    m = input_ids.shape[0]
    small = m <= MAX_ROWS
    proj = (_small_projections(m, model.config.hidden_size) if small
            else _wide_projections(m, get_forward_context().pdl))
    rows = m if small else padded_rows(m)             # the activations' rows: whole Gluon M tiles
    residual = model.embed_tokens(input_ids)
    x = _with_rows(layers[0].input_layernorm(residual), rows)
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        qkv = proj.qkv(x, attn.qkv_proj.weight)
        q, k, v = attn.fused_qk_norm_rope(qkv if rows == m else qkv[:m], positions)
        o = _attention(attn, q, k, v, rows)
        post = layer.post_attention_layernorm
        x, residual = add_norm_partials(proj.o_proj(o, attn.o_proj.weight), residual, post.weight, post.eps, rows)
        act = proj.gate_up_act(x, layer.mlp.gate_up_proj.weight)
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
        x, residual = add_norm_partials(proj.down(act, layer.mlp.down_proj.weight), residual, nxt.weight, nxt.eps,
                                        rows)
    return x[:m]


def _attention(attn: ChainAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int) -> torch.Tensor:
    """Decode attention of q [M, Hq, D] (K/V already stored) -> [rows, Hq * D], written into the
    first M rows of a tensor of ``rows`` rows when rows > M."""
    m = q.shape[0]
    if rows == m:
        return attn.attn(q, k, v, kv_stored=True).reshape(m, attn.q_size)
    out = q.new_empty(rows, attn.num_heads, attn.head_dim)
    written = attn.attn(q, k, v, kv_stored=True, out=out[:m])
    if written.data_ptr() != out.data_ptr():                  # a backend that did not write into out
        out[:m].copy_(written)
    return out.view(rows, attn.q_size)


def _with_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x: [M, H] -> [rows, H] holding x in its first M rows (the rest unwritten)."""
    if rows == x.shape[0]:
        return x
    out = x.new_empty(rows, x.shape[1])
    out[:x.shape[0]].copy_(x)
    return out
