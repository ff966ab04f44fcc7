"""``--quantization fp8``: the decoder's projections (qkv, o, gate_up, down of every layer) swapped
for Fp8Linear once the weights are loaded, each weight quantized per output channel. The
embedding, the LM head and the norms stay in the model's dtype. A row-parallel projection keeps
its all-reduce (applied before the bias). The small-batch decode chain, which reads bf16
weights, is then off for this model (``DecoderForCausalLM.fp8_weights``).
"""
from __future__ import annotations

from torch import nn

from pdserve.common.layers.fp8_linear import Fp8Linear
from pdserve.common.models.decoder import DecoderForCausalLM, DecoderLayer
from pdserve.common.parallel.linear import RowParallelLinear

__all__ = ["quantize_fp8", "PROJECTIONS", "set_kv_scales"]

PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def _fp8(linear: nn.Module) -> Fp8Linear:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"cannot quantize a {type(linear).__name__} to FP8")
    reduce = None
    if isinstance(linear, RowParallelLinear) and linear.group is not None:
        reduce = linear.group.all_reduce
    return Fp8Linear.from_linear(linear, reduce)


def quantize_fp8(model: DecoderForCausalLM) -> None:
    """Swap every layer's projections for FP8 ones (in place; the bf16 weights are freed)."""
    for layer in model.layers:
        for owner_name, attr in PROJECTIONS:
            owner = getattr(layer, owner_name)
            setattr(owner, attr, _fp8(getattr(owner, attr)))
    model.fp8_weights = True


def set_kv_scales(model: DecoderForCausalLM, scales: dict[str, float]) -> None:
    """A checkpoint's ``model.layers.N.self_attn.k_scale`` / ``v_scale`` onto layer N's paged
    attention (the FP8 KV cache's per-tensor scales); ValueError for a name of no layer."""
    for name, value in scales.items():
        parts = name.removeprefix("model.").split(".")
        if len(parts) != 4 or parts[0] != "layers" or not parts[1].isdigit() or parts[3] not in ("k_scale", "v_scale"):
            raise ValueError(f"KV cache scale {name!r} names no layer's attention")
        if not value > 0:
            raise ValueError(f"KV cache scale {name!r} must be positive, got {value}")
        layer = model.layers[int(parts[1])]
        assert isinstance(layer, DecoderLayer)
        setattr(layer.self_attn.attn, parts[3], value)
