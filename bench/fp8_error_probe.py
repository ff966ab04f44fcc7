"""Where FP8 weights cost the embedded SmolLM2-135M its perplexity (CPU lab, bench/notes/fp8.md).

Each variant swaps the decoder's projections for an emulation of the GPU's FP8 GEMM: both operands
rounded to e4m3 under their scales, products summed in fp32 per 128-wide K block and each block's
partial scaled by its activation and weight scales (what the block-scaled Hopper kernels do; with
one scale along K it is the row-wise ``torch._scaled_mm``). Weight scales: ``channel`` ([N, 1]),
``block`` (128x128 tiles), ``rowgroup`` (1x128: per output channel and 128-wide K block, the
``torch._scaled_mm`` 1x128 x 1x128 recipe), ``none`` (exact); activation scales: ``token``
([M, 1]), ``group`` (1x128 per token), ``none``. ``--only`` names the projections quantized (the rest exact). Scored
by the engine's own forward on the first ``--tokens`` tokens of tests/data/kjv_genesis.txt
against float32. ``--layer-error`` instead prints, per projection type and scheme, the relative
error of the FP8 product on the float32 model's own inputs (one forward; no compounding across
layers, none of perplexity's sensitivity to single rounding flips).

    python -m bench.fp8_error_probe [--tokens 512] [--window 512] [--variants NAME ...] [--layer-error]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from pdserve.common.engine import LLM
from pdserve.common.engine.perplexity import perplexity
from pdserve.common.models.quantize import PROJECTIONS
from pdserve.common.ops.fp8 import FP8_MAX, quantize_fp8

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "kjv_genesis.txt"
BLOCK = 128
ALL = ("qkv", "o", "gate_up", "down")
# name -> (weight scales, activation scales, projections quantized)
VARIANTS = {
    "w8a8 channel/token": ("channel", "token", ALL),
    "w8 channel only": ("channel", "none", ALL),
    "a8 token only": ("none", "token", ALL),
    **{f"w8a8 channel/token {p} only": ("channel", "token", (p,)) for p in ALL},
    "w8a8 channel/token not down": ("channel", "token", ("qkv", "o", "gate_up")),
    "w8 block only": ("block", "none", ALL),
    "a8 group only": ("none", "group", ALL),
    "w8a8 channel/group": ("channel", "group", ALL),
    "w8a8 block/token": ("block", "token", ALL),
    "w8a8 block/group": ("block", "group", ALL),
    "w8a8 block/group not down": ("block", "group", ("qkv", "o", "gate_up")),
    "w8 rowgroup only": ("rowgroup", "none", ALL),
    "w8a8 rowgroup/group": ("rowgroup", "group", ALL),
}


def _scales(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """fp32 scales mapping each ``rows`` x ``cols`` tile's absolute maximum of ``t`` to FP8_MAX,
    shape [ceil(R / rows), ceil(C / cols)] (a ragged last tile scaled on its own values)."""
    r, c = t.shape
    pad = torch.zeros(-(-r // rows) * rows, -(-c // cols) * cols, dtype=torch.float32)
    pad[:r, :c] = t.abs().float()
    tiles = pad.reshape(pad.shape[0] // rows, rows, pad.shape[1] // cols, cols)
    return (tiles.amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)


def _expand(scale: torch.Tensor, rows: int, cols: int, shape: torch.Size) -> torch.Tensor:
    return scale.repeat_interleave(rows, 0)[:shape[0]].repeat_interleave(cols, 1)[:, :shape[1]]


def _quantize(t: torch.Tensor, scheme: str, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values as fp32, their scales expanded to t's shape); ``scheme`` "none" keeps t exact."""
    if scheme == "none":
        return t.float(), torch.ones_like(t, dtype=torch.float32)
    rows = 1 if per_row else BLOCK
    cols = t.shape[1] if scheme in ("channel", "token") else BLOCK    # block, group, rowgroup: 128 wide
    s = _expand(_scales(t, rows, cols), rows, cols, t.shape)
    return quantize_fp8(t, s).float(), s


class EmulatedFp8Linear(nn.Module):
    """``linear``'s product as an FP8 GEMM with the given weight and activation scales (see the
    module docstring); bias added after, in the activations' dtype."""

    def __init__(self, linear: nn.Linear, weight_scheme: str, act_scheme: str) -> None:
        super().__init__()
        self.act_scheme, self.bias = act_scheme, linear.bias
        per_row = weight_scheme in ("channel", "rowgroup")
        self.wq, self.ws = _quantize(linear.weight.detach(), weight_scheme, per_row=per_row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        xq, xs = _quantize(rows, self.act_scheme, per_row=True)
        y = torch.zeros(rows.shape[0], self.wq.shape[0], dtype=torch.float32)
        for k in range(0, rows.shape[1], BLOCK):       # fp32 partial per K block, then its scales
            part = xq[:, k:k + BLOCK] @ self.wq[:, k:k + BLOCK].t()
            y += part * xs[:, k:k + 1] * self.ws[:, k].reshape(1, -1)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], -1)


def _set_projections(model, originals: dict, variant: tuple | None) -> None:
    """Every layer's projections back to ``originals``, then the variant's ones emulated."""
    for (i, owner, attr), linear in originals.items():
        quantized = variant is not None and attr.removesuffix("_proj") in variant[2]
        mod = EmulatedFp8Linear(linear, variant[0], variant[1]) if variant and quantized else linear
        setattr(getattr(model.layers[i], owner), attr, mod)


SCHEMES = (("channel", "token"), ("channel", "group"), ("block", "group"), ("rowgroup", "group"),
           ("channel", "none"), ("block", "none"), ("rowgroup", "none"), ("none", "token"), ("none", "group"))


@torch.inference_mode()
def layer_errors(runner, model, originals: dict, ids: list[int]) -> None:
    """Each scheme's ||y_fp8 - y|| / ||y|| per projection type, summed over layers, on the inputs
    every projection saw in one float32 forward of ``ids``."""
    inputs: dict = {}

    def keep(key):
        def hook(module, args, output) -> None:
            inputs.setdefault(key, args[0].detach().clone())
        return hook
    hooks = [lin.register_forward_hook(keep(key)) for key, lin in originals.items()]
    perplexity(runner, ids, len(ids))
    for h in hooks:
        h.remove()
    print(f"{'weights/activations':22s}" + "".join(f"{p:>10s}" for p in ALL))
    for w, a in SCHEMES:
        num, den = dict.fromkeys(ALL, 0.0), dict.fromkeys(ALL, 0.0)
        for key, lin in originals.items():
            x, kind = inputs[key], key[2].removesuffix("_proj")
            y = lin(x)
            num[kind] += float((EmulatedFp8Linear(lin, w, a)(x) - y).pow(2).sum())
            den[kind] += float(y.pow(2).sum())
        print(f"{w + '/' + a:22s}" + "".join(f"{(num[p] / den[p]) ** 0.5:10.4f}" for p in ALL), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), help="names from VARIANTS")
    p.add_argument("--layer-error", action="store_true", help="per-projection error instead of perplexity")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from pdserve.common.default_model import ensure_default_model
    ids = AutoTokenizer.from_pretrained(ensure_default_model())(TEXT.read_text())["input_ids"][:args.tokens]
    llm = LLM("default", device="cpu", dtype="float32", num_kv_blocks=args.window // 16 + 1, warmup=False)
    runner = llm.engine.model_runner
    model = runner.model
    originals = {(i, o, a): getattr(getattr(layer, o), a)
                 for i, layer in enumerate(model.layers) for o, a in PROJECTIONS}
    if args.layer_error:
        layer_errors(runner, model, originals, ids[:args.window])
        return 0
    ref = perplexity(runner, ids, args.window)
    print(f"{'float32':36s} {ref:8.4f}   ({len(ids)} tokens, window {args.window})", flush=True)
    for name in args.variants:
        t0 = time.perf_counter()
        _set_projections(model, originals, VARIANTS[name])
        ppl = perplexity(runner, ids, args.window)
        print(f"{name:36s} {ppl:8.4f} {ppl / ref - 1:+7.2%}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    _set_projections(model, originals, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
