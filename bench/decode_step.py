"""Decode-step microbenchmark: one full decode step (all layers, CUDA graph) at batch 256 and
context ~600, as achieved HBM bandwidth over the copy bandwidth measured in the same run;
plus a host-side profile of the engine loop (``--profile``) to see what the CPU costs per step.

    python -m bench.decode_step --out bench/results/decode_step.json [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random

import torch

from bench.common import copy_bandwidth, write_result
from pdserve.common.engine import LLM, SamplingParams
from pdserve.common.engine.sequence import Sequence


def build_batch(llm: LLM, batch: int, context: int) -> list[Sequence]:
    return build_ragged_batch(llm, [context] * batch)


def build_ragged_batch(llm: LLM, contexts: list[int]) -> list[Sequence]:
    """Decode rows with ``contexts[i]`` tokens of context each, their KV blocks filled at random."""
    eng = llm.engine
    rng = random.Random(0)
    seqs = []
    for c in contexts:
        s = Sequence([rng.randrange(10000) for _ in range(c)], SamplingParams(max_tokens=8),
                     eng.config.block_size)
        eng.block_manager.allocate(s, register=False)
        s.num_cached_tokens = s.num_tokens - 1
        seqs.append(s)
    used = max(b for s in seqs for b in s.block_table) + 1
    eng.model_runner.kv_cache[:used].normal_()          # never time on zeros
    return seqs


def time_step(llm: LLM, seqs: list[Sequence], iters: int = 50) -> dict:
    mr = llm.engine.model_runner
    input_ids, positions, ctx = mr.prepare_decode(seqs)
    graph = mr.graph_runner
    assert graph is not None and graph.can_run(len(seqs))
    for _ in range(5):
        graph.run(input_ids, positions, ctx)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.run(input_ids, positions, ctx)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    times.sort()
    return {"median_s": times[len(times) // 2], "min_s": times[0]}


def profile_engine(llm: LLM, num_seqs: int, max_tokens: int) -> str:
    rng = random.Random(1)
    prompts = [[rng.randrange(10000) for _ in range(rng.randint(100, 1024))] for _ in range(num_seqs)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    return out.getvalue()


def grid_point(llm: LLM, batch: int, context: int, weight_bytes: int, bandwidth: float) -> dict:
    """One more (batch, context) point: step time against its bytes-over-bandwidth floor."""
    seqs = build_batch(llm, batch, context)
    t = time_step(llm, seqs, iters=20)
    for s in seqs:
        llm.engine.block_manager.deallocate(s)
    mr = llm.engine.model_runner
    need = weight_bytes + batch * context * (mr.block_bytes // llm.engine.config.block_size)
    floor = need / bandwidth
    print(f"  b={batch:4d} ctx={context:5d}: {1000 * t['median_s']:.3f} ms, floor {1000 * floor:.3f} ms, "
          f"over floor {1000 * (t['median_s'] - floor):.3f} ms")
    return {"batch": batch, "context": context, "step": t, "floor_s": floor,
            "fraction_of_copy_bandwidth": floor / t["median_s"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=600)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--grid", default="", help="more batch:context points timed the same way, e.g. 128:1200,8:1800")
    p.add_argument("--out", default="bench/results/decode_step.json")
    args = p.parse_args(argv)
    bandwidth = copy_bandwidth()
    llm = LLM(args.model, block_size=args.block_size, max_num_seqs=512, max_model_len=4096)
    seqs = build_batch(llm, args.batch, args.context)
    t = time_step(llm, seqs)
    mr = llm.engine.model_runner
    weight_bytes = sum(p.numel() * p.element_size() for p in mr.model.parameters())
    kv_bytes = args.batch * args.context * (mr.block_bytes // args.block_size)
    need = weight_bytes + kv_bytes
    achieved = need / t["median_s"]
    result = {"batch": args.batch, "context": args.context, "block_size": args.block_size, "step": t,
              "bytes_read_min": need, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
              "achieved_GBps": achieved / 1e9, "copy_bandwidth_GBps": bandwidth / 1e9,
              "fraction_of_copy_bandwidth": achieved / bandwidth}
    for s in seqs:
        llm.engine.block_manager.deallocate(s)
    print(f"decode step b={args.batch} ctx={args.context}: {1000 * t['median_s']:.3f} ms, "
          f"{achieved / 1e9:.0f} GB/s = {100 * achieved / bandwidth:.1f}% of copy ({bandwidth / 1e9:.0f} GB/s)")
    result["grid"] = [grid_point(llm, int(b), int(c), weight_bytes, bandwidth)
                      for b, c in (x.split(":") for x in args.grid.split(",") if x)]
    if args.profile:
        text = profile_engine(llm, 256, 128)
        result["profile_top"] = text
        print(text)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
