"""Mixed-step microbenchmark (chunked prefill): what one step costs with B decode rows and a
prompt chunk of C tokens, against a decode-only step of the same B (CUDA graph) and a
prefill-only step of the same chunk, on one GPU.

    python -m bench.chunked_step --model qwen3-8b --batch 16 32 64 --chunk 256 512 1024 2048 \
        --context 3000 --out bench/results/chunked_step.json

``mixed_ms`` is the engine's way (one forward: decode rows through decode attention, the chunk
through prefill attention); ``decode_ms + prefill_ms`` is the alternative of two launches in
the step (a graph decode forward and a separate prefill forward). Each figure is the median of
``--iters`` steps timed with CUDA events around launch + result, the host's preparation
included, on random KV (never zeros), after the clocks have been brought up; ``mixed_host_ms``
is the host's time to launch a mixed step (prepare + every kernel launch): where it is close to
``mixed_ms`` the step is bound by the host, not the GPU.
"""
from __future__ import annotations

import argparse
import logging
import random
import time

import torch

from bench.common import write_result
from bench.decode_step import build_batch
from pdserve.common.engine import LLM, SamplingParams
from pdserve.common.engine.sequence import Sequence

logger = logging.getLogger(__name__)


def _chunk_seq(llm: LLM, prefix: int, chunk: int, seed: int) -> Sequence:
    eng = llm.engine
    rng = random.Random(seed)
    s = Sequence([rng.randrange(10000) for _ in range(prefix + chunk)], SamplingParams(max_tokens=8),
                 eng.config.block_size)
    eng.block_manager.allocate(s, register=False)
    s.num_cached_tokens = prefix
    s.num_scheduled_tokens = chunk
    eng.model_runner.kv_cache[:max(s.block_table) + 1].normal_()     # never time on zeros
    return s


def _time(fn, iters: int) -> tuple[float, float]:
    """Median GPU-event time (ms) of ``fn`` and the median host time of its launch part (ms)."""
    for _ in range(3):
        fn().result()
    torch.cuda.synchronize()
    times, host = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        launched = fn()
        host.append((time.perf_counter() - t0) * 1e3)
        launched.result()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2], sorted(host)[len(host) // 2]


def _warm_gpu(seconds: float = 2.0) -> None:
    """Run matrix products for a while, so that clocks are up before the first timing."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a
        torch.cuda.synchronize()


def measure(llm: LLM, batch: int, chunk: int, context: int, iters: int) -> dict:
    mr = llm.engine.model_runner
    rows = build_batch(llm, batch, context)
    for s in rows:
        s.num_scheduled_tokens = 1
    piece = _chunk_seq(llm, context, chunk, seed=batch * 7919 + chunk)
    out = {"batch": batch, "chunk": chunk, "context": context}
    for name, seqs, is_prefill in (("mixed", rows + [piece], True), ("decode", rows, False),
                                   ("prefill", [piece], True)):
        out[f"{name}_ms"], out[f"{name}_host_ms"] = _time(lambda s=seqs, p=is_prefill: mr.launch(s, p), iters)
    for s in rows + [piece]:
        llm.engine.block_manager.deallocate(s)
    out["two_launches_ms"] = out["decode_ms"] + out["prefill_ms"]
    out["mixed_over_decode"] = out["mixed_ms"] / out["decode_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--batch", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--chunk", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--context", type=int, default=3000, help="context of every decode row and the chunk's prefix")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", default="bench/results/chunked_step.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    need = max(args.batch) + 1
    llm = LLM(args.model, block_size=args.block_size, max_num_seqs=max(need, 64), max_model_len=8192,
              max_num_batched_tokens=max(args.chunk) + max(args.batch),
              num_kv_blocks=need * (-(-(args.context + max(args.chunk) + 8) // args.block_size)) + 64)
    _warm_gpu()
    results = [measure(llm, b, c, args.context, args.iters) for b in args.batch for c in args.chunk]
    write_result(args.out, {"config": vars(args), "results": results})
    print(f"{'batch':>5} {'chunk':>6} {'decode ms':>10} {'mixed ms':>9} {'(host)':>7} {'prefill ms':>10} "
          f"{'2 launches':>10} {'mixed/dec':>9}")
    for r in results:
        print(f"{r['batch']:5d} {r['chunk']:6d} {r['decode_ms']:10.2f} {r['mixed_ms']:9.2f} {r['mixed_host_ms']:7.2f} "
              f"{r['prefill_ms']:10.2f} {r['two_launches_ms']:10.2f} {r['mixed_over_decode']:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
