"""The small-batch decode forward: the decoder's dense layers as one chain of weight-preloading,
PDL-launched kernels (pdserve/common/ops/dataflow.py), attention unchanged.

Per layer: ``qkv = preload_linear(x)`` -> qk-norm/RoPE/KV store -> paged attention ->
``o_proj`` partials -> add + post-attention RMSNorm -> ``gate_up`` partials -> SiLU-mul ->
``down`` partials -> add + the next layer's input RMSNorm (the final norm after the last layer).
It computes what ``DecoderForCausalLM.forward`` computes, rounding at the same points (each GEMM
output in the model dtype before its residual add or activation); only the GEMMs' summation
order differs.

Taken for a decode forward (no prompt rows) of at most ``MAX_ROWS`` rows on a GPU with
programmatic dependent launch (compute capability 9.0 or newer: without it the chain is no faster
than the usual path, bench/NOTES.md run 33) when the model ``supports`` it and
``PDSERVE_DATAFLOW_DECODE`` is on (default). Otherwise the model runs its usual forward.
"""
from __future__ import annotations

import dataclasses

import torch

from pdserve.common import env
from pdserve.common.config import ModelConfig
from pdserve.common.context import forward_context, get_forward_context
from pdserve.common.layers.fused_dispatch import use_fused
from pdserve.common.ops.dataflow import (
    BK,
    BN,
    MAX_ROWS,
    add_norm_partials,
    pdl_available,
    preload_linear,
    silu_partials,
    splitk,
)

MAX_PROGRAMS_PER_SM = 4     # beyond this a projection's tiles are not all resident: the preload stops paying


def supports(cfg: ModelConfig, dtype: torch.dtype, num_sms: int) -> bool:
    """Whether the chain's tiling fits this geometry: no biases, half-precision weights, every K a
    multiple of the tile (QKV's K one or two tiles), every projection's tiles resident at once."""
    q = cfg.num_attention_heads * cfg.head_dim
    qkv = q + 2 * cfg.num_key_value_heads * cfg.head_dim
    if dtype not in (torch.bfloat16, torch.float16) or cfg.attention_bias or cfg.o_bias or cfg.mlp_bias:
        return False
    if cfg.hidden_size not in (BK, 2 * BK) or q % BK or cfg.intermediate_size % BK:
        return False
    tiles = {"o": (cfg.hidden_size, q), "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
             "down": (cfg.hidden_size, cfg.intermediate_size)}
    if any(n % BN for n in (qkv, cfg.hidden_size, cfg.intermediate_size)):
        return False
    return all((n // BN) * (k // BK) <= MAX_PROGRAMS_PER_SM * num_sms for n, k in tiles.values())


def applies(model: torch.nn.Module, input_ids: torch.Tensor) -> bool:
    """This forward takes the chain: CUDA with PDL, fused kernels on, a pure decode batch of <= MAX_ROWS."""
    if not input_ids.is_cuda or input_ids.shape[0] > MAX_ROWS or not env.dataflow_decode():
        return False
    if not pdl_available(input_ids.device):
        return False
    if not use_fused(input_ids) or get_forward_context().is_prefill:
        return False
    ok = getattr(model, "_dataflow_ok", None)
    if ok is None:
        sms = torch.cuda.get_device_properties(input_ids.device).multi_processor_count
        ok = model._dataflow_ok = supports(model.config, model.embed_tokens.weight.dtype, sms)
    return ok


def forward(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """input_ids, positions: [B] (decode rows) -> final hidden states [B, H] (after the final norm).
    The qk-norm/RoPE and attention kernels join the chain (launched with PDL) on a GPU that has it;
    elsewhere (the interpreter, tests) every kernel runs with plain launches."""
    with forward_context(dataclasses.replace(get_forward_context(), pdl=pdl_available(input_ids.device))):
        return _layers(model, input_ids, positions)


def _layers(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    layers = model.layers
    residual = model.embed_tokens(input_ids)
    first = layers[0].input_layernorm
    x = first(residual)
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        q, k, v = attn._fused_qk_norm_rope(preload_linear(x, attn.qkv_proj.weight), positions)
        o = attn.attn(q, k, v, kv_stored=True).reshape(-1, attn.q_size)
        post = layer.post_attention_layernorm
        x, residual = add_norm_partials(splitk(o, attn.o_proj.weight), residual, post.weight, post.eps)
        act = silu_partials(splitk(x, layer.mlp.gate_up_proj.weight), x.dtype)
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
        x, residual = add_norm_partials(splitk(act, layer.mlp.down_proj.weight), residual, nxt.weight, nxt.eps)
    return x
