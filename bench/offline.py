"""Offline engine throughput on W-nano and W-uniform (docs/design.md), with the roofline fraction.

    python -m bench.offline --workload nano uniform --out bench/results/offline_h100.json

Output tok/s = sum of max_tokens / wall time of one ``generate`` after a warm-up. Two floors,
both from ceilings measured in the same run:

- ``roofline_seconds`` (the project's historical figure): the bytes a decode must read (weights
  once per step, every context's KV once per token) over the copy bandwidth;
- ``floor_with_prefill_seconds``: that plus the prompts' prefill FLOPs over the dense bf16 GEMM
  throughput. Prefill is compute-bound and cannot hide under the decode's byte stream when all
  prompts arrive at once, so on large models the first floor is out of reach by the prefill time.

``--model`` takes a preset name (pdserve/common/presets) or a path to an HF ``config.json``.
``--tensor-parallel-size N`` splits the model over N GPUs (ranks); the floors are then one rank's
(its shard of the weights and of every token's KV, read at one GPU's bandwidth), and the result
counts the forwards the other ranks replayed from CUDA graphs (``tp_forwards``).
The step split (``prefill_step_seconds`` / ``decode_step_seconds``) is the wall time of engine
steps whose result held prompt tokens vs decode rows only.
"""
from __future__ import annotations

import argparse
import logging
import time

import torch

from bench.common import copy_bandwidth, matmul_throughput, write_result
from bench.workloads import decode_bytes, prefill_flops, w_nano, w_uniform
from pdserve.common.engine import LLM, SamplingParams
from pdserve.common.engine.engine_args import (
    add_chunked_prefill_arguments,
    add_fp8_arguments,
    chunked_prefill_kwargs,
    fp8_kwargs,
)

logger = logging.getLogger(__name__)


class StepSplit:
    """Wraps ``engine.step`` to add up wall time by what the returned step computed."""

    def __init__(self, engine) -> None:
        self.prefill_s = self.decode_s = 0.0
        self.prefill_steps = self.decode_steps = 0
        self._step = engine.step
        engine.step = self

    def __call__(self):
        start = time.perf_counter()
        out = self._step()
        took = time.perf_counter() - start
        if out.num_prefill_tokens:
            self.prefill_s, self.prefill_steps = self.prefill_s + took, self.prefill_steps + 1
        elif out.num_decode_rows:
            self.decode_s, self.decode_steps = self.decode_s + took, self.decode_steps + 1
        return out


def model_floor(llm: LLM, workload, bandwidth: float, flops: float | None) -> dict:
    """The two floors of the module docstring for ``workload`` on ``llm``'s model."""
    cfg = llm.engine.source.config
    model = llm.engine.model_runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = llm.engine.model_runner.block_bytes // llm.engine.config.block_size
    floor_s = decode_bytes(workload, kv_bytes, weight_bytes) / bandwidth
    produced = workload.num_output_tokens
    out = {"bytes_must_read": decode_bytes(workload, kv_bytes, weight_bytes), "roofline_seconds": floor_s,
           "roofline_output_tok_s": produced / floor_s, "weight_bytes": weight_bytes,
           "kv_bytes_per_token": kv_bytes, "model": cfg.name}
    if flops:
        skip = {id(model.embed_tokens.weight), id(model.lm_head.weight)}
        linear = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in skip)
        pf = prefill_flops(workload, linear, cfg.num_hidden_layers, model.num_local_heads, cfg.head_dim)
        out.update({"prefill_flops": pf, "prefill_floor_seconds": pf / flops,
                    "floor_with_prefill_seconds": floor_s + pf / flops})
    return out


def run_workload(llm: LLM, workload, bandwidth: float | None, flops: float | None = None) -> dict:
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    split = StepSplit(llm.engine)
    start = time.perf_counter()
    try:
        outs = llm.generate(workload.prompts, workload.params, use_tqdm=False)
    finally:
        llm.engine.step = split._step
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == workload.num_output_tokens, (produced, workload.num_output_tokens)
    result = {"workload": workload.name, "seconds": elapsed, "prompt_tokens": workload.num_prompt_tokens,
              "output_tokens": produced, "output_tok_s": produced / elapsed,
              "total_tok_s": (produced + workload.num_prompt_tokens) / elapsed,
              "preemptions": llm.engine.scheduler.num_preemptions,
              "prefill_step_seconds": split.prefill_s, "prefill_steps": split.prefill_steps,
              "decode_step_seconds": split.decode_s, "decode_steps": split.decode_steps}
    if bandwidth:
        result.update(model_floor(llm, workload, bandwidth, flops))
        result["fraction_of_roofline"] = result["roofline_seconds"] / elapsed
        result["decode_fraction_of_roofline"] = result["roofline_seconds"] / max(split.decode_s, 1e-9)
        if "floor_with_prefill_seconds" in result:
            result["fraction_of_floor_with_prefill"] = result["floor_with_prefill_seconds"] / elapsed
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
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs (ranks) the model is split over")
    add_chunked_prefill_arguments(p)
    add_fp8_arguments(p)
    p.add_argument("--out", default="bench/results/offline.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bandwidth = copy_bandwidth() if torch.cuda.is_available() else None
    flops = matmul_throughput() if torch.cuda.is_available() else None
    llm = LLM(args.model, block_size=args.block_size, max_num_seqs=args.max_num_seqs, device=args.device,
              max_model_len=args.max_model_len, attention_backend=args.attention_backend,
              enforce_eager=args.enforce_eager, max_num_batched_tokens=args.max_num_batched_tokens,
              tensor_parallel_size=args.tensor_parallel_size, **chunked_prefill_kwargs(args), **fp8_kwargs(args))
    llm.generate([[1, 2, 3, 4] * 8] * 4, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)  # warm-up
    makers = {"nano": w_nano, "uniform": w_uniform}
    results = []
    for name in args.workload:
        leader = llm.engine.model_runner.leader
        before = dict(leader.counts) if leader is not None else {}
        r = run_workload(llm, makers[name](args.num_seqs), bandwidth, flops)
        if leader is not None:
            r["tp_forwards"] = {k: v - before.get(k, 0) for k, v in leader.counts.items()}
        logger.info("%s: %.0f output tok/s (%.2f s)%s", r["workload"], r["output_tok_s"], r["seconds"],
                    f", {100 * r['fraction_of_roofline']:.1f}% of roofline" if bandwidth else "")
        results.append(r)
    write_result(args.out, {"copy_bandwidth_GBps": bandwidth / 1e9 if bandwidth else None,
                            "matmul_TFLOPS": flops / 1e12 if flops else None,
                            "config": vars(args), "results": results,
                            "num_kv_blocks": llm.engine.model_runner.num_kv_blocks,
                            "kv_cache_dtype": str(llm.engine.model_runner.kv_cache_dtype)})
    for r in results:
        print(f"{r['workload']:10s} {r['output_tok_s']:10.0f} out tok/s  {r['total_tok_s']:10.0f} total tok/s  "
              f"{r['seconds']:7.2f} s" + (f"  {100 * r['fraction_of_roofline']:5.1f}% roofline" if bandwidth else ""))
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
