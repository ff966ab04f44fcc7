"""Where W-nano's time goes, step by step (one GPU): GPU busy time vs GPU idle gaps per step,
grouped by batch size, with the host's time per step, against each step's bytes-over-bandwidth floor.

Every ``ModelRunner.launch`` (prefill and decode) is bracketed by two CUDA timing events; after
the run, ``busy`` = start→end of a step on the GPU and ``gap`` = end of one step → start of the
next (the GPU waiting for the host). Triton compiles inside the timed run are listed with their
time (a kernel variant the start-up warm-up did not meet), and so are Python GC pauses;
``--cprofile-prefill-steps`` profiles the host inside the run's own prefill launches. The floor
of a decode step is (weights + the batch's KV bytes) / the copy bandwidth measured in the same run.

    python -m bench.step_trace --out bench/results/step_trace_h100.json
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import logging
import pstats
import time

import torch

from bench.common import copy_bandwidth, write_result
from bench.run_probes import (
    PrefillKernelTimeline,
    allocator_counts,
    pinned_allocs,
    track_compiles,
    track_gc,
    untrack_compiles,
)
from bench.workloads import w_nano
from pdserve.common.engine import LLM, SamplingParams

logger = logging.getLogger(__name__)
BUCKETS = (1, 8, 16, 32, 64, 128, 192, 256, 512)


def instrument(llm: LLM, prefill_profiler: cProfile.Profile | None = None,
               prefill_pinned: list | None = None, timeline: PrefillKernelTimeline | None = None) -> list[list]:
    """Wrap ``launch`` (and the logits, and the engine step); returns the list it appends
    [is_prefill, batch, kv_tokens, start, end, logits_event, host_launch_s, host_step_s] to.
    ``prefill_profiler`` (a ``cProfile.Profile``): enabled around each prefill step's launch;
    ``prefill_pinned``: gets, per prefill launch, the pinned host blocks it created and their time."""
    engine = llm.engine
    mr = engine.model_runner
    original, original_logits, original_step = mr.launch, mr.model.compute_logits, engine.step
    records: list[list] = []
    logits_at: list = [None]

    def compute_logits(hidden):
        logits_at[0] = torch.cuda.Event(enable_timing=True)
        logits_at[0].record()
        return original_logits(hidden)

    def launch(seqs, is_prefill, *args, **kwargs):
        if timeline is not None:
            timeline.on_launch(is_prefill)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        kv_tokens = sum(s.num_tokens for s in seqs) if not is_prefill else sum(
            s.num_tokens - s.num_cached_tokens for s in seqs)
        t0 = time.perf_counter()
        start.record()
        profiled = is_prefill and prefill_profiler is not None
        pinned_before = pinned_allocs() if is_prefill and prefill_pinned is not None else None
        if profiled:
            prefill_profiler.enable()
        try:
            out = original(seqs, is_prefill, *args, **kwargs)
        finally:
            if profiled:
                prefill_profiler.disable()
        end.record()
        if pinned_before is not None:
            count, us = pinned_allocs()
            prefill_pinned.append({"blocks": count - pinned_before[0], "alloc_ms": (us - pinned_before[1]) / 1e3,
                                   "host_launch_ms": 1e3 * (time.perf_counter() - t0)})
        records.append([is_prefill, len(seqs), kv_tokens, start, end, logits_at[0], time.perf_counter() - t0, 0.0])
        return out

    def step():
        t0 = time.perf_counter()
        out = original_step()
        if records:
            records[-1][7] += time.perf_counter() - t0
        return out

    mr.launch, mr.model.compute_logits, engine.step = launch, compute_logits, step
    return records


def time_host_calls(llm: LLM) -> dict[str, list[float]]:
    """Wrap the host-side pieces of a step (batch preparation, forward launch, logits, sampler,
    KV-store hook) with wall-clock timers; returns name -> list of seconds, one per call."""
    mr = llm.engine.model_runner
    sink: dict[str, list[float]] = {}
    from pdserve.common.engine import model_runner
    targets = [(mr, "prepare_prefill"), (mr, "prepare_decode"), (mr, "_sampling_batch"),
               (mr.model, "forward"), (mr, "sampler"), (mr, "_forward_prefill"), (mr.model, "compute_logits"),
               (model_runner, "LaunchedStep")]
    for obj, name in targets:
        original = getattr(obj, name)

        def timed(*args, _original=original, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                sink.setdefault(_name, []).append(time.perf_counter() - t0)
        setattr(obj, name, timed)
    return sink


def summarize(records: list[tuple], weight_bytes: int, kv_bytes: int, bandwidth: float) -> dict:
    torch.cuda.synchronize()
    rows: dict[str, dict] = {}
    for i, (is_prefill, batch, kv_tokens, start, end, logits, host_launch, host_step) in enumerate(records):
        busy = start.elapsed_time(end) / 1e3
        head = logits.elapsed_time(end) / 1e3
        gap = end.elapsed_time(records[i + 1][3]) / 1e3 if i + 1 < len(records) else 0.0
        if is_prefill:
            key = "prefill"
            floor = 0.0
        else:
            top = next(b for b in BUCKETS if batch <= b)
            key = f"decode<= {top}"
            floor = (weight_bytes + kv_tokens * kv_bytes) / bandwidth
        r = rows.setdefault(key, {"steps": 0, "busy_s": 0.0, "gap_s": 0.0, "floor_s": 0.0, "tokens": 0,
                                  "logits_sampling_s": 0.0, "host_launch_s": 0.0, "host_step_s": 0.0})
        r["steps"] += 1
        r["logits_sampling_s"] += head
        r["host_launch_s"] += host_launch
        r["host_step_s"] += host_step
        r["busy_s"] += busy
        r["gap_s"] += gap
        r["floor_s"] += floor
        r["tokens"] += kv_tokens if is_prefill else batch
    for r in rows.values():
        r["busy_ms_per_step"] = 1e3 * r["busy_s"] / r["steps"]
        r["gap_ms_per_step"] = 1e3 * r["gap_s"] / r["steps"]
        r["busy_over_floor"] = r["busy_s"] / r["floor_s"] if r["floor_s"] else None
        for k in ("logits_sampling", "host_launch", "host_step"):
            r[f"{k}_ms_per_step"] = 1e3 * r[f"{k}_s"] / r["steps"]
    total = {k: sum(r[k] for r in rows.values()) for k in ("busy_s", "gap_s", "floor_s", "steps")}
    return {"by_batch": dict(sorted(rows.items())), "total": total}


def _prefill_batch(shift: int, max_tokens: int = 16384) -> list[list[int]]:
    """W-nano's first prompts up to ``max_tokens`` in all (one prefill step), token ids shifted
    by ``shift`` so that a batch shifted differently is no prefix-cache hit."""
    prompts, total = [], 0
    for prompt in w_nano().prompts:
        if total + len(prompt) > max_tokens:
            break
        prompts.append([t + shift for t in prompt])
        total += len(prompt)
    return prompts


def profile_prefill(llm: LLM, rows: int = 20) -> str:
    """torch.profiler table (CUDA time) of one W-nano-sized prefill batch (~16k tokens)."""
    from torch.profiler import ProfilerActivity, profile
    prompts = _prefill_batch(0)
    params = SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([[t + 1 for t in p] for p in prompts], params, use_tqdm=False)
        torch.cuda.synchronize()
    return (prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows) + "\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def cprofile_prefill(llm: LLM, rows: int = 30) -> str:
    """cProfile (host, Python) of one W-nano-sized prefill batch, by own time."""
    prompts = _prefill_batch(2)
    params = SamplingParams(temperature=0.6, max_tokens=1, ignore_eos=True)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def profile_decode(llm: LLM, batch: int, context: int, rows: int = 25) -> str:
    """torch.profiler table (CUDA time per kernel) of eager decode steps at (batch, context):
    the kernels a graph replays, each with its own duration."""
    from torch.profiler import ProfilerActivity, profile

    from bench.decode_step import build_batch
    from pdserve.common.context import forward_context
    seqs = build_batch(llm, batch, context)
    mr = llm.engine.model_runner
    input_ids, positions, ctx = mr.prepare_decode(seqs)
    with torch.inference_mode(), forward_context(ctx):
        for _ in range(3):
            mr.model.compute_logits(mr.model(input_ids, positions))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                mr.model.compute_logits(mr.model(input_ids, positions))
            torch.cuda.synchronize()
    for s in seqs:
        llm.engine.block_manager.deallocate(s)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--profile-prefill", action="store_true", help="also a profiler table of one prefill batch")
    p.add_argument("--profile-decode", default="", help="batch:context of an eager decode step to profile")
    p.add_argument("--host-calls", action="store_true",
                   help="also time the host pieces of each step (prepare, forward launch, sampler)")
    p.add_argument("--cprofile-prefill-steps", action="store_true",
                   help="also cProfile the host inside W-nano's own prefill launches (as they run, overlapped)")
    p.add_argument("--prefill-timeline", action="store_true",
                   help="also profile the GPU's kernels over the prefill phase (idle between kernels)")
    p.add_argument("--out", default="bench/results/step_trace.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bandwidth = copy_bandwidth()
    llm = LLM(args.model, block_size=args.block_size, max_num_seqs=512, max_model_len=4096,
              max_num_batched_tokens=16384)
    llm.generate([[1, 2, 3, 4] * 8] * 4, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
    in_run_profiler = cProfile.Profile() if args.cprofile_prefill_steps else None
    prefill_pinned: list[dict] = []
    timeline = PrefillKernelTimeline() if args.prefill_timeline else None
    records = instrument(llm, in_run_profiler, prefill_pinned, timeline)
    host_calls = time_host_calls(llm) if args.host_calls else {}
    work = w_nano()
    torch.cuda.synchronize()
    counts_before = allocator_counts()
    compiles = track_compiles()
    gc_stats = track_gc()
    start = time.perf_counter()
    if timeline is not None:
        timeline.start()
    llm.generate(work.prompts, work.params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    counts = {k: v - counts_before.get(k, 0) for k, v in allocator_counts().items()}
    gc.callbacks.remove(gc_stats.pop("callback"))
    untrack_compiles()
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model_runner.model.parameters())
    kv_bytes = llm.engine.model_runner.block_bytes // llm.engine.config.block_size
    result = {"copy_bandwidth_GBps": bandwidth / 1e9, "config": vars(args), "wall_s": elapsed,
              "output_tok_s": work.num_output_tokens / elapsed,
              "allocator_events_during_run": counts, "triton_compiles_during_run": list(compiles),
              "gc_during_run": gc_stats, "prefill_pinned_allocs": prefill_pinned,
              "prefill_kernel_timeline": timeline.summary() if timeline is not None else None,
              "host_calls_ms": {k: {"calls": len(v), "mean": 1e3 * sum(v) / len(v), "max": 1e3 * max(v),
                                    "first10": [round(1e3 * x, 3) for x in v[:10]]}
                                for k, v in host_calls.items()},
              **summarize(records, weight_bytes, kv_bytes, bandwidth)}
    print("allocator events during the run:", counts)
    print("Python GC during the run:", gc_stats)
    print("pinned host blocks created in each prefill launch:", prefill_pinned)
    if timeline is not None:
        print("prefill phase kernel timeline:", result["prefill_kernel_timeline"])
    print(f"Triton compiles during the run: {len(compiles)}, {sum(c['s'] or 0 for c in compiles):.3f} s")
    for c in compiles[:20]:
        print(f"  {c['s']} s {c['kernel'][:200]}")
    for k, v in result["host_calls_ms"].items():
        print(f"host {k:>16s}: {v['calls']:5d} calls, mean {v['mean']:.3f} ms, max {v['max']:.3f} ms, "
              f"first {v['first10']}")
    if in_run_profiler is not None:
        text = io.StringIO()
        pstats.Stats(in_run_profiler, stream=text).sort_stats("tottime").print_stats(35)
        pstats.Stats(in_run_profiler, stream=text).sort_stats("cumulative").print_stats(30)
        result["prefill_steps_in_run_cprofile"] = text.getvalue()
        print(result["prefill_steps_in_run_cprofile"])
    del llm.engine.model_runner.launch        # the profiles below run without the trace's wrapper
    if args.profile_prefill:
        result["prefill_profile"] = profile_prefill(llm)
        print(result["prefill_profile"])
        result["prefill_cprofile"] = cprofile_prefill(llm)
        print(result["prefill_cprofile"])
    if args.profile_decode:
        b, c = (int(x) for x in args.profile_decode.split(":"))
        result["decode_profile"] = profile_decode(llm, b, c)
        print(result["decode_profile"])
    write_result(args.out, result)
    print(f"wall {elapsed:.2f} s ({result['output_tok_s']:.0f} tok/s); GPU busy {result['total']['busy_s']:.2f} s, "
          f"idle gaps {result['total']['gap_s']:.2f} s, decode floor {result['total']['floor_s']:.2f} s")
    for key, r in result["by_batch"].items():
        print(f"{key:>12s} steps {r['steps']:5d} busy {r['busy_ms_per_step']:7.3f} ms"
              f" gap {r['gap_ms_per_step']:6.3f} ms"
              f" logits+sampling {r['logits_sampling_ms_per_step']:6.3f} ms"
              f" host launch {r['host_launch_ms_per_step']:6.3f}"
              f" ms host step {r['host_step_ms_per_step']:6.3f} ms"
              + (f" busy/floor {r['busy_over_floor']:.2f}" if r["busy_over_floor"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
