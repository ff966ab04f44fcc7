"""Lab probe (issue 20): the decode step's logits, ``hidden [M, H] @ lm_head [V, H]^T``, by cuBLAS
(the engine's ``F.linear``) against the chain's Gluon GEMM (pdserve/common/ops/gluon_gemm.py)
over a few tile shapes, and the engine's sampler on the logits, at M = 1-256 decode rows.

W-nano's step trace (bench/results/wide_range/step_trace_ff2d3c6.json) spends 0.13-0.21 ms a step
on logits + sampling against a 0.107 ms bytes floor for the Qwen3-0.6B LM head (311 MB): this
says how much of that is the GEMM. Each way checked against ``F.linear`` first; the activation
is given whole M tiles (as the chain gives its GEMMs). The weight (311 MB) overflows L2, so a
replay reads it from DRAM as a decode step does; two copies alternate all the same.

    python -m bench.lm_head_probe --out bench/results/lm_head/lm_head_probe_h100.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.cold_weights import describe, time_ways, weight_copies, write_rows
from bench.common import copy_bandwidth
from pdserve.common.loader import resolve_model
from pdserve.common.ops import gluon_gemm
from pdserve.common.ops.gemm_tiles import Tiles
from pdserve.common.ops.sampling import temperature_sample

TILES = {"g64x128x128s3": Tiles(64, 128, 128, 3), "g64x64x128s4": Tiles(64, 64, 128, 4),
         "g64x64x64s4": Tiles(64, 64, 64, 4), "g64x128x64s4": Tiles(64, 128, 64, 4),
         "g128x64x64s4": Tiles(128, 64, 64, 4), "g128x128x64s3": Tiles(128, 128, 64, 3),
         "g128x64x128s3": Tiles(128, 64, 128, 3)}


def row(w_copies: list[torch.Tensor], m: int, bandwidth: float) -> dict:
    v, h = w_copies[0].shape
    a_pad = torch.randn(-(-m // 128) * 128, h, device="cuda", dtype=torch.bfloat16)
    a = a_pad[:m].clone()
    ref = F.linear(a, w_copies[0])
    ways = {"cublas": lambda i: F.linear(a, w_copies[i])}
    for label, tiles in TILES.items():
        rows = -(-m // tiles.bm) * tiles.bm
        ways[label] = (lambda i, t=tiles, r=rows: gluon_gemm.linear(a_pad[:r], w_copies[i], t, pdl=False)[:m])
    out = {"M": m, "V": v, "H": h, "floor_us": 1e6 * (v * h * 2 + m * v * 2) / bandwidth}
    out.update(time_ways(ways, ref, len(w_copies)))
    temps = torch.full((m,), 0.6, device="cuda")
    out.update(time_ways({"sampler": lambda i: temperature_sample(ref, temps, 7).float()},
                         temperature_sample(ref, temps, 7).float(), 1))
    print(f"M={m:4d} floor {out['floor_us']:.1f}: " + describe(out, ["cublas", *TILES, "sampler"]), flush=True)
    return out


def api_report() -> dict:
    """What the device's Triton offers for clusters (TMA multicast), for the next step's design."""
    import inspect

    import triton
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.hopper import tma
    load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    report = {"triton": triton.__version__, "tma_load_signature": str(inspect.signature(load)),
              "hopper_has_cluster": hasattr(hopper, "cluster"),
              "hopper_names": sorted(n for n in dir(hopper) if not n.startswith("_"))}
    print(report, flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--batches", default="1,16,32,64,96,128,192,256")
    p.add_argument("--out", default="bench/results/lm_head/lm_head_probe.json")
    args = p.parse_args(argv)
    cfg = resolve_model(args.model).config
    api = api_report()
    bandwidth = copy_bandwidth()
    w_copies = weight_copies(cfg.vocab_size, cfg.hidden_size, 1 << 20)
    rows = [row(w_copies, int(m), bandwidth) for m in args.batches.split(",")]
    rows.append({"api": api, "copy_bandwidth_GBps": bandwidth / 1e9})
    write_rows(args.out, args.model, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
