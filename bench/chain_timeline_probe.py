"""Lab probe (issue 20): where the dense half of a decode layer spends its time, kernel by kernel.

The chain's wide range with the product's tiles (``bench.dataflow_layer_probe``'s ``wide``) and the
engine's cuBLAS way, 8 layers in one CUDA graph with the weights in DRAM, checked against the
float32 reference first. One replay is recorded by torch.profiler (CUPTI: each kernel's start and
end on the GPU). For the kernels of the middle layers (2-7): the duration, the gap from the end
of the kernel before (negative: programmatic dependent launch started it earlier) and the
increment, its end minus the previous kernel's end, which is what it adds to the layer; beside,
each GEMM's weight bytes at the copy bandwidth. The replay is also timed without the profiler.
With ``--hot`` the 8 layers share one layer's weights (31.5 MB, held in the 50 MB L2 across the
replay): what the chain costs when its weights need no DRAM reads.

    python -m bench.chain_timeline_probe --batches 64,128,256 --out bench/results/wide_range/chain_timeline.json
"""
from __future__ import annotations

import argparse

import torch

from bench import dataflow_layer_probe as lp
from bench.common import capture_graph, copy_bandwidth, graph_time, profile_kernels, write_result
from pdserve.common.ops.gemm_tiles import padded_rows, wide_tiles

MIDDLE = range(2, 7)    # layers whose kernels are summarised (the first and last meet the graph's ends)


def _kernels(fn) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of the GPU kernels of one replay of ``fn`` captured in a graph."""
    graph = capture_graph(fn)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    return profile_kernels(graph.replay)


def summarise(kernels: list[tuple[str, float, float]], layers: int) -> dict:
    """Per kernel position in a layer, over the middle layers: mean duration, gap and increment (us)."""
    per_layer = len(kernels) // layers
    assert per_layer * layers == len(kernels), (len(kernels), layers)
    rows = []
    for pos in range(per_layer):
        durs, gaps, incs = [], [], []
        for layer in MIDDLE:
            i = layer * per_layer + pos
            name, start, end = kernels[i]
            prev_end = kernels[i - 1][2]
            durs.append(end - start)
            gaps.append(start - prev_end)
            incs.append(end - prev_end)
        rows.append({"kernel": kernels[MIDDLE[0] * per_layer + pos][0][:60], "dur_us": sum(durs) / len(durs),
                     "gap_us": sum(gaps) / len(gaps), "increment_us": sum(incs) / len(incs)})
    span = (kernels[MIDDLE[-1] * per_layer + per_layer - 1][2] - kernels[MIDDLE[0] * per_layer - 1][2]) / len(MIDDLE)
    return {"kernels_per_layer": per_layer, "layer_us": span, "kernels": rows}


def measure(m: int, layers: list[dict]) -> list[dict]:
    attn = torch.randn(m, lp.QDIM, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, lp.H, device="cuda", dtype=torch.bfloat16)
    ref_qkv, ref_res = lp.reference(attn, res, layers[0])
    bufs = torch.zeros(padded_rows(m), lp.QDIM, device="cuda", dtype=torch.bfloat16)
    bufs[:m] = attn
    lp._TILES.clear()
    lp._TILES.update({op: wide_tiles(op, m) for op in lp.WIDE_OPS})
    out = []
    for way, layer_fn, b in (("wide", lp.wide_layer, bufs), ("engine", lp.engine_layer, None)):
        qkv, r = layer_fn(attn, res, layers[0], b, True)
        errs = (lp.rel_err(qkv, ref_qkv), lp.rel_err(r, ref_res))
        assert max(errs) < 1e-2, f"{way} M={m}: relative errors {errs}"

        def fn(layer_fn=layer_fn, b=b):
            return [layer_fn(attn, res, lw, b, True) for lw in layers]
        row = {"M": m, "way": way, "rel_err": max(errs), **summarise(_kernels(fn), len(layers)),
               "graph_us_per_layer": 1e6 * graph_time(fn, replays=20) / len(layers)}
        out.append(row)
        print(f"M={m:4d} {way:6s}: {row['layer_us']:.1f} us a layer under the profiler, "
              f"{row['graph_us_per_layer']:.1f} without", flush=True)
        for k in row["kernels"]:
            print(f"    {k['kernel'][:44]:44s} dur {k['dur_us']:6.2f}  gap {k['gap_us']:6.2f}  "
                  f"adds {k['increment_us']:6.2f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="64,128,256")
    p.add_argument("--hot", action="store_true",
                   help="one layer's weights for all 8 layers, held in L2: the chain without DRAM weight reads")
    p.add_argument("--out", default="bench/results/wide_range/chain_timeline.json")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    layers = lp.make_layers(1) * 8 if a.hot else lp.make_layers(8)
    bandwidth = copy_bandwidth()
    floors = {op: 1e6 * layers[0][key].numel() * 2 / bandwidth
              for op, key in (("o_proj", "o"), ("gate_up", "gate_up"), ("down", "down"), ("qkv", "qkv"))}
    print("weight bytes at the copy bandwidth (us):", {k: round(v, 2) for k, v in floors.items()})
    rows = [r for m in a.batches.split(",") for r in measure(int(m), layers)]
    write_result(a.out, {"copy_bandwidth_GBps": bandwidth / 1e9, "weight_floor_us": floors, "hot": a.hot,
                         "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
