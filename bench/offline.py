"""Offline engine throughput on W-nano and W-uniform (docs/design.md), with the roofline fraction.

    python -m bench.offline --workload nano uniform --out bench/results/offline_h100.json

Output tok/s = sum of max_tokens / wall time of one ``generate`` after a warm-up. The roofline
is the bytes a decode must read (weights once per step, every context's KV once per token) over
the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import logging
import time

import torch

from bench.common import copy_bandwidth, write_result
from bench.workloads import decode_bytes, w_nano, w_uniform
from common.engine import LLM, SamplingParams
from common.engine.engine_args import add_chunked_prefill_arguments, chunked_prefill_kwargs

logger = logging.getLogger(__name__)


def run_workload(llm: LLM, workload, bandwidth: float | None) -> dict:
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    start = time.perf_counter()
    outs = llm.generate(workload.prompts, workload.params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == workload.num_output_tokens, (produced, workload.num_output_tokens)
    result = {"workload": workload.name, "seconds": elapsed, "prompt_tokens": workload.num_prompt_tokens,
              "output_tokens": produced, "output_tok_s": produced / elapsed,
              "total_tok_s": (produced + workload.num_prompt_tokens) / elapsed,
              "preemptions": llm.engine.scheduler.num_preemptions}
    if bandwidth:
        cfg = llm.engine.source.config
        weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model_runner.model.parameters())
        kv_bytes = llm.engine.model_runner.block_bytes // llm.engine.config.block_size
        need = decode_bytes(workload, kv_bytes, weight_bytes)
        floor_s = need / bandwidth
        result.update({"bytes_must_read": need, "roofline_seconds": floor_s,
                       "roofline_output_tok_s": produced / floor_s, "fraction_of_roofline": floor_s / elapsed,
                       "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes, "model": cfg.name})
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--workload", nargs="+", default=["nano", "uniform"], choices=["nano", "uniform"])
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    add_chunked_prefill_arguments(p)
    p.add_argument("--out", default="bench/results/offline.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bandwidth = copy_bandwidth() if torch.cuda.is_available() else None
    llm = LLM(args.model, block_size=args.block_size, max_num_seqs=args.max_num_seqs, device=args.device,
              max_model_len=args.max_model_len, attention_backend=args.attention_backend,
              enforce_eager=args.enforce_eager, max_num_batched_tokens=args.max_num_batched_tokens,
              **chunked_prefill_kwargs(args))
    llm.generate([[1, 2, 3, 4] * 8] * 4, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)  # warm-up
    makers = {"nano": w_nano, "uniform": w_uniform}
    results = []
    for name in args.workload:
        r = run_workload(llm, makers[name](args.num_seqs), bandwidth)
        logger.info("%s: %.0f output tok/s (%.2f s)%s", r["workload"], r["output_tok_s"], r["seconds"],
                    f", {100 * r['fraction_of_roofline']:.1f}% of roofline" if bandwidth else "")
        results.append(r)
    write_result(args.out, {"copy_bandwidth_GBps": bandwidth / 1e9 if bandwidth else None,
                            "config": vars(args), "results": results})
    for r in results:
        print(f"{r['workload']:10s} {r['output_tok_s']:10.0f} out tok/s  {r['total_tok_s']:10.0f} total tok/s  "
              f"{r['seconds']:7.2f} s" + (f"  {100 * r['fraction_of_roofline']:5.1f}% roofline" if bandwidth else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
