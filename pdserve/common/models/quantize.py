"""``--quantization fp8``: the decoder's projections (qkv, o, gate_up, down of every layer) swapped
for FP8 ones once the weights are loaded, in one of three weight schemes (activations are scaled
at run time, per token or per token and 128-wide group):

* ``block1x128``: Fp8BlockLinear, a weight scale per output channel and 128-wide K block,
  activations per 1x128 group (``torch._scaled_mm``'s 1x128 x 1x128 recipe on Hopper); the least
  error of the three on every projection of the embedded SmolLM2-135M (bench/notes/fp8.md), not
  yet run on a GPU, so not the default;
* ``block``: Fp8BlockLinear, a weight scale per 128x128 tile, activations per 1x128 group, as
  DeepSeek-V3 and the Qwen3-*-FP8 checkpoints;
* ``channel`` (the default for a bf16/fp32 checkpoint, the scheme measured on the GPU): Fp8Linear,
  a weight scale per output channel, activations per token.

A published FP8 checkpoint keeps its own scheme (models/fp8_checkpoint.py ``weight_scheme``): a
block-scaled one is read back into the same e4m3 values and tile scales, a per-channel one into
the same per-channel numbers. The embedding, the LM head and the norms stay in the model's dtype.
A row-parallel projection keeps its all-reduce (applied before the bias). The small-batch decode
chain, which reads bf16 weights, is then off for this model (``DecoderForCausalLM.fp8_weights``).
"""
from __future__ import annotations

from torch import nn

from pdserve.common.layers.fp8_block_linear import BLOCK, Fp8BlockLinear
from pdserve.common.layers.fp8_linear import Fp8Linear
from pdserve.common.models.decoder import DecoderForCausalLM, DecoderLayer
from pdserve.common.parallel.linear import RowParallelLinear

__all__ = ["quantize_fp8", "PROJECTIONS", "WEIGHT_SCHEMES", "DEFAULT_WEIGHT_SCHEME", "set_kv_scales"]

PROJECTIONS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))
WEIGHT_SCHEMES = ("block1x128", "block", "channel")
DEFAULT_WEIGHT_SCHEME = "channel"


def _fp8(linear: nn.Module, scheme: str) -> nn.Module:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"cannot quantize a {type(linear).__name__} to FP8")
    reduce = None
    if isinstance(linear, RowParallelLinear) and linear.group is not None:
        reduce = linear.group.all_reduce
    if scheme == "channel":
        return Fp8Linear.from_linear(linear, reduce)
    return Fp8BlockLinear.from_linear(linear, reduce, tile_rows=1 if scheme == "block1x128" else BLOCK)


def quantize_fp8(model: DecoderForCausalLM, scheme: str = DEFAULT_WEIGHT_SCHEME) -> None:
    """Swap every layer's projections for FP8 ones of ``scheme`` (one of WEIGHT_SCHEMES; in place,
    the bf16 weights freed); ValueError for another scheme."""
    if scheme not in WEIGHT_SCHEMES:
        raise ValueError(f"FP8 weight scheme must be one of {', '.join(WEIGHT_SCHEMES)}, got {scheme!r}")
    for layer in model.layers:
        for owner_name, attr in PROJECTIONS:
            owner = getattr(layer, owner_name)
            setattr(owner, attr, _fp8(getattr(owner, attr), scheme))
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
