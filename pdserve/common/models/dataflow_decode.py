"""The small-batch decode forward: the decoder's dense layers as one chain of weight-preloading,
PDL-launched kernels (pdserve/common/ops/dataflow.py), attention unchanged.

Per layer: ``qkv`` (``preload_linear`` at <= 16 rows where hidden is one or two tiles, else split-K
partials, ``qkv_preloads``) -> qk-norm/RoPE/KV store (adding partials up) -> paged attention ->
``o_proj`` partials -> add + post-attention RMSNorm -> ``gate_up`` partials -> SiLU-mul ->
``down`` partials -> add + the next layer's input RMSNorm (the final norm after the last layer).
It computes what ``DecoderForCausalLM.forward`` computes, rounding at the same points (each GEMM
output in the model dtype before its residual add or activation); only the GEMMs' summation
order differs.

Taken (``takes_chain``) for a decode forward (no prompt rows) of 1 to ``MAX_ROWS`` rows on a GPU
with programmatic dependent launch (pdserve/common/ops/pdl.py; with the same kernels launched
plainly the chain is no faster than the usual path, measured on an H100 with PDL switched off:
bench/NOTES.md run 33), when the model ``supports`` it, the fused kernels are on and
``PDSERVE_DATAFLOW_DECODE`` is on (default). Otherwise the model runs its usual forward.
Import it only where Triton is importable (the decoder does so on CUDA with the fused kernels on).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, cast

import torch

from pdserve.common import env
from pdserve.common.config import ModelConfig
from pdserve.common.context import forward_context, get_forward_context
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
from pdserve.common.ops.paged_attention import sm_count
from pdserve.common.ops.pdl import pdl_available

if TYPE_CHECKING:
    from pdserve.common.models.decoder import DecoderForCausalLM, DecoderLayer

MAX_PROGRAMS_PER_SM = 4     # beyond this a projection's tiles are not all resident: the preload stops paying


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


def takes_chain(rows: int, is_prefill: bool, pdl: bool, enabled: bool, supported: bool) -> bool:
    """The rule, on plain values: a pure decode batch of 1..MAX_ROWS rows, PDL, switched on, a
    supported model."""
    return 1 <= rows <= MAX_ROWS and not is_prefill and pdl and enabled and supported


def qkv_preloads(rows: int, hidden: int) -> bool:
    """QKV through ``preload_linear`` (each program holds its whole K: 0.01-0.06 ms a step faster at
    <= 16 rows on the Qwen3-0.6B geometry, bench/NOTES.md run 39), else split over K."""
    return rows <= PRELOAD_ROWS and hidden in (BK, 2 * BK)


def applies(model: DecoderForCausalLM, input_ids: torch.Tensor) -> bool:
    """``takes_chain`` for this forward (the caller checked CUDA and the fused kernels)."""
    rows = input_ids.shape[0]
    if not 1 <= rows <= MAX_ROWS:                                  # cheap checks first
        return False
    sms = sm_count(input_ids.device)
    return takes_chain(rows, get_forward_context().is_prefill, pdl_available(input_ids.device),
                       env.dataflow_decode(), supports(model.config, model.embed_tokens.weight.dtype, sms))


def forward(model: DecoderForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """input_ids, positions: [B] (decode rows) -> final hidden states [B, H] (after the final norm).
    The qk-norm/RoPE and attention kernels join the chain (launched with PDL) on a GPU that has it;
    elsewhere (the interpreter, tests) every kernel runs with plain launches."""
    with forward_context(dataclasses.replace(get_forward_context(), pdl=pdl_available(input_ids.device))):
        return _layers(model, input_ids, positions)


def _layers(model: DecoderForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    layers = cast("list[DecoderLayer]", list(model.layers))
    residual = model.embed_tokens(input_ids)
    x = layers[0].input_layernorm(residual)
    qkv_proj = preload_linear if qkv_preloads(input_ids.shape[0], model.config.hidden_size) else splitk
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        q, k, v = attn.fused_qk_norm_rope(qkv_proj(x, attn.qkv_proj.weight), positions)
        o = attn.attn(q, k, v, kv_stored=True).reshape(-1, attn.q_size)
        post = layer.post_attention_layernorm
        x, residual = add_norm_partials(splitk(o, attn.o_proj.weight), residual, post.weight, post.eps)
        act = silu_partials(splitk(x, layer.mlp.gate_up_proj.weight), x.dtype)
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
        x, residual = add_norm_partials(splitk(act, layer.mlp.down_proj.weight), residual, nxt.weight, nxt.eps)
    return x
