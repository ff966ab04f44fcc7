"""Lab probe (issue 20): the engine's own decode step, layer by layer and kernel by kernel.

Builds the engine (Qwen3-0.6B preset by default, dummy weights), fills a decode batch of B rows at
context C (as ``bench.decode_step`` does), times the captured CUDA graph's replay (median of 30,
CUDA events) and records one replay under torch.profiler. The layers are cut at each decode
attention kernel; for the kernels from one attention to the next, over the middle layers 8-19,
it reports each kernel's mean duration and increment (its end minus the previous kernel's end:
what it adds to the step under programmatic dependent launch) and the layer's total. Unlike
``bench.chain_timeline_probe`` (the dense half rebuilt from the product's kernels), this is the
graph the engine replays, embedding to final norm, whatever path the model takes.

``--o-down-tiles bm,bn,bk,stages,splits`` replaces the wide range's ``o_proj`` and ``down`` tiles
(gemm_tiles.wide_tiles) at every batch, for tile experiments.

    python -m bench.layer_timeline --batches 64,128,192,256 --out bench/results/layer_timeline.json
"""
from __future__ import annotations

import argparse

from bench.common import profile_kernels, write_result
from bench.decode_step import build_batch, time_step
from pdserve.common.engine import LLM
from pdserve.common.ops.gemm_tiles import Tiles

MIDDLE = slice(8, 20)       # attention kernels bounding the layers summarised


def _override_tiles(spec: str) -> None:
    from pdserve.common.models import dataflow_decode
    bm, bn, bk, stages, splits = (int(x) for x in spec.split(","))
    wide_tiles = dataflow_decode.wide_tiles

    def tiles(op: str, rows: int) -> Tiles:
        return Tiles(bm, bn, bk, stages, splits=splits) if op in ("o_proj", "down") else wide_tiles(op, rows)
    dataflow_decode.wide_tiles = tiles


def summarise(ks: list[tuple[str, float, float]]) -> dict:
    """Per kernel position after attention, over the middle layers: mean duration and increment."""
    attn = [i for i, k in enumerate(ks) if "decode" in k[0] and "split" in k[0]]
    rows: dict[int, list] = {}
    bounds = attn[MIDDLE]
    for a0, a1 in zip(bounds, bounds[1:]):
        for j in range(a0, a1):
            name, start, end = ks[j]
            row = rows.setdefault(j - a0, [name[:48], [], []])
            row[1].append(end - start)
            row[2].append(end - ks[j - 1][2])
    kernels = [{"kernel": n, "dur_us": sum(d) / len(d), "increment_us": sum(i) / len(i)} for n, d, i in rows.values()]
    return {"kernels": len(ks), "kernels_per_layer": len(kernels), "kernels_of_a_layer": kernels,
            "layer_us": sum(k["increment_us"] for k in kernels)}


def measure(llm: LLM, batch: int, context: int) -> dict:
    mr = llm.engine.model_runner
    seqs = build_batch(llm, batch, context)
    step_ms = 1e3 * time_step(llm, seqs, iters=30)["median_s"]       # the graph replayed, CUDA events
    ids, pos, ctx = mr.prepare_decode(seqs)
    graph = mr.graph_runner
    assert graph is not None
    result = {"batch": batch, "context": context, "step_median_ms": step_ms,
              **summarise(profile_kernels(lambda: graph.run(ids, pos, ctx)))}
    for s in seqs:
        llm.engine.block_manager.deallocate(s)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--batches", default="64,128,192,256")
    p.add_argument("--context", type=int, default=1200)
    p.add_argument("--o-down-tiles", default="", help="bm,bn,bk,stages,splits for o_proj and down")
    p.add_argument("--out", default="bench/results/layer_timeline.json")
    args = p.parse_args(argv)
    if args.o_down_tiles:
        _override_tiles(args.o_down_tiles)
    llm = LLM(args.model, block_size=256, max_num_seqs=512, max_model_len=4096)
    points = [measure(llm, int(b), args.context) for b in args.batches.split(",")]
    for pt in points:
        print(f"b={pt['batch']} ctx={pt['context']}: step {pt['step_median_ms']:.3f} ms, "
              f"{pt['kernels_per_layer']} kernels a layer, {pt['layer_us']:.1f} us a layer (profiled)")
        for k in pt["kernels_of_a_layer"]:
            print(f"  {k['kernel']:48s} {k['dur_us']:7.2f} {k['increment_us']:7.2f}")
    write_result(args.out, {"model": args.model, "o_down_tiles": args.o_down_tiles, "points": points})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
