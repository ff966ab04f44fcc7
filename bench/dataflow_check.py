"""End-to-end check of the small-batch decode chain (lab, issue 20): the same greedy requests
through two engines on the same dummy weights, one with ``PDSERVE_DATAFLOW_DECODE=0`` and one
with it on, every decode step at <= 32 rows (CUDA graphs). Reports how many outputs are identical
and where the others first differ (the two paths sum the GEMMs in different orders, so a near tie
between the top two logits can go either way), against the same comparison between two runs of
the usual path that batch differently (16 rows a step instead of 32: other cuBLAS kernels), and
that every KV block came back.

    python -m bench.dataflow_check --out bench/results/dataflow/dataflow_check_h100.json
"""
from __future__ import annotations

import argparse
import gc
import os
import random

import torch

from bench.common import write_result
from pdserve.common.engine import LLM, SamplingParams


def generate(flag: str, prompts: list[list[int]], max_tokens: int, max_num_seqs: int = 32) -> list[list[int]]:
    os.environ["PDSERVE_DATAFLOW_DECODE"] = flag
    llm = LLM("qwen3-0.6b", block_size=256, max_num_seqs=max_num_seqs, max_model_len=4096, kv_cache_memory_gb=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    assert llm.engine.block_manager.is_whole()
    tokens = [list(o.token_ids) for o in outs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    first = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in zip(a, b)]
    return {"identical_outputs": sum(d is None for d in first),
            "first_difference_at": [d for d in first if d is not None]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", default="bench/results/dataflow/dataflow_check.json")
    a = p.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(10000) for _ in range(rng.randint(20, 600))] for _ in range(a.num_prompts)]
    off = generate("0", prompts, a.max_tokens)
    result = {"num_prompts": len(prompts), "max_tokens": a.max_tokens,
              "chain_vs_usual": compare(off, generate("1", prompts, a.max_tokens)),
              # the noise floor: the usual path alone, batched 16 rows at a time instead of 32
              "usual_16_vs_usual_32": compare(off, generate("0", prompts, a.max_tokens, max_num_seqs=16))}
    write_result(a.out, result)
    for name in ("chain_vs_usual", "usual_16_vs_usual_32"):
        r = result[name]
        print(f"{name}: {r['identical_outputs']}/{len(prompts)} outputs identical; first differences at "
              f"{r['first_difference_at']}")
    print("every block whole after each run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
