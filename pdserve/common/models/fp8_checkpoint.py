"""FP8 checkpoints as published on the hub, read into the model's dtype.

Two formats, told apart by ``config.json``'s ``quantization_config``:

* ``quant_method: fp8`` (Qwen3-8B-FP8 and the like): e4m3 ``*.weight`` with ``*.weight_scale_inv``,
  one fp32 scale per ``weight_block_size`` block (``[128, 128]``): ``w = q * scale[block]``;
* ``quant_method: compressed-tensors`` (llm-compressor's FP8 / FP8_DYNAMIC): e4m3 ``*.weight``
  with ``*.weight_scale``, per output channel (``[N, 1]``) or per tensor; ``*.input_scale`` of
  static activation schemes is dropped (activations are scaled per token at run time), and
  ``*.k_scale`` / ``*.v_scale`` (a kv_cache_scheme) become the layer's FP8 KV cache scales.

Each FP8 weight is dequantized as it meets its scale and handed on in the model's dtype; with
``--quantization fp8`` the model then quantizes it again in the checkpoint's own scheme
(``weight_scheme``; models/quantize.py): per channel, the same numbers; in 128x128 tiles, the same
e4m3 values and (to the model dtype's rounding) the same scales wherever the checkpoint's tiles are
the model's (each tile's largest value at +-448, as ``scale = amax / 448`` makes it; the merged
qkv and gate_up tile as their parts do when each part's rows are a multiple of 128). Other block
shapes are rounded onto 128x128 tiles. Errors: a format or block shape this reader does not know,
a weight without its scale.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

__all__ = ["read_quant_config", "weight_scheme", "dequantized"]

KNOWN_METHODS = ("fp8", "compressed-tensors")
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
_DROPPED_SUFFIXES = (".input_scale",)
_KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")


def read_quant_config(checkpoint_dir: Path) -> dict | None:
    """``quantization_config`` of the checkpoint's ``config.json`` (None when it has none);
    ValueError for a quantization method other than FP8's."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text()).get("quantization_config")
    if not cfg:
        return None
    method = cfg.get("quant_method")
    if method not in KNOWN_METHODS:
        raise ValueError(f"checkpoint quantization {method!r} is not supported (known: {', '.join(KNOWN_METHODS)})")
    if method == "fp8" and cfg.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 checkpoint format {cfg.get('fmt')!r} is not supported (e4m3 only)")
    return cfg


def weight_scheme(cfg: dict | None) -> str | None:
    """The FP8 weight scheme (models/quantize.py) that serves a checkpoint of ``cfg`` as published:
    "block" for block-scaled ``quant_method: fp8``, "channel" for per-channel or per-tensor scales;
    None for a checkpoint that is not FP8 (the default scheme applies)."""
    if cfg is None:
        return None
    return "block" if cfg.get("quant_method") == "fp8" and cfg.get("weight_block_size") else "channel"


def _block_dequant(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    n, k = q.shape
    bn, bk = block
    if scale.shape != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"block scales of shape {tuple(scale.shape)} do not tile a [{n}, {k}] weight in {block}")
    full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (q.float() * full).to(dtype)


def _dequant(q: torch.Tensor, scale: torch.Tensor, cfg: dict, dtype: torch.dtype) -> torch.Tensor:
    if cfg.get("quant_method") == "fp8" and cfg.get("weight_block_size"):
        bn, bk = cfg["weight_block_size"]
        return _block_dequant(q, scale, (int(bn), int(bk)), dtype)
    s = scale.float()
    if s.numel() == 1:
        s = s.reshape(1, 1)
    elif s.shape not in ((q.shape[0], 1), (q.shape[0],)):
        raise ValueError(f"weight scale of shape {tuple(scale.shape)} for a weight of {tuple(q.shape)}")
    return (q.float() * s.reshape(-1, 1)).to(dtype)


def dequantized(weights: Iterable[tuple[str, torch.Tensor]], cfg: dict | None, dtype: torch.dtype,
                kv_scales: dict[str, float]) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` (HF name, tensor) with every FP8 weight dequantized to ``dtype`` once its scale
    has come (either order), scale and input-scale tensors consumed; ``kv_scales`` receives each
    ``*.k_scale`` / ``*.v_scale`` (name -> float). ``cfg`` None: the weights pass unchanged."""
    if cfg is None:
        yield from weights
        return
    pending: dict[str, torch.Tensor] = {}       # weight name -> fp8 weight or its scale, waiting for the other
    for name, tensor in weights:
        if name.endswith(_DROPPED_SUFFIXES):
            continue
        if name.endswith(_KV_SCALE_SUFFIXES):
            kv_scales[name] = float(tensor.float().reshape(-1)[0])
            continue
        scale_of = next((name[: -len(s)] + ".weight" for s in _SCALE_SUFFIXES if name.endswith(s)), None)
        key = scale_of or name
        if scale_of is None and tensor.dtype != torch.float8_e4m3fn:
            yield name, tensor
            continue
        other = pending.pop(key, None)
        if other is None:
            pending[key] = tensor
            continue
        q, scale = (other, tensor) if scale_of else (tensor, other)
        yield key, _dequant(q, scale, cfg, dtype)
    if pending:
        raise ValueError(f"FP8 checkpoint: weights or scales without their pair: {sorted(pending)[:4]}")
