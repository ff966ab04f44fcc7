"""The baseline: Hugging Face transformers' continuous batching (``generate_batch``) on W-uniform.

    python -m bench.hf_baseline --out bench/results/hf_baseline.json

Same preset geometry with random weights (throughput does not depend on the values), bf16,
paged SDPA attention; output tok/s = generated tokens / wall time of one ``generate_batch``.
"""
from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from bench.common import write_result
from bench.workloads import w_uniform
from pdserve.common.loader import PRESET_DIR

logger = logging.getLogger(__name__)


def build_hf_model(preset: str, device: str, dtype: torch.dtype, attn: str):
    import transformers as tf
    cfg_dict = json.loads((PRESET_DIR / f"{preset}.json").read_text())
    cfg = tf.AutoConfig.for_model(**cfg_dict)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", help="preset name")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--attn", default="paged|sdpa", help="attn_implementation")
    p.add_argument("--out", default="bench/results/hf_baseline.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import transformers as tf
    from transformers.generation import GenerationConfig
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_hf_model(args.model, device, dtype, args.attn)
    workload = w_uniform(args.num_seqs, args.max_tokens)
    gen = GenerationConfig(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
                           eos_token_id=model.config.vocab_size + 1, pad_token_id=0)
    model.generate_batch(inputs=[[1, 2, 3]] * 2, generation_config=gen.__class__(
        max_new_tokens=4, do_sample=False, eos_token_id=model.config.vocab_size + 1, pad_token_id=0),
        progress_bar=False)
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=workload.prompts, generation_config=gen, progress_bar=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.generated_tokens) for o in outputs.values())
    result = {"workload": workload.name, "engine": f"transformers {tf.__version__} generate_batch ({args.attn})",
              "seconds": elapsed, "output_tokens": produced, "output_tok_s": produced / elapsed,
              "num_requests": len(outputs), "config": vars(args)}
    write_result(args.out, result)
    print(f"HF baseline {workload.name}: {produced} tokens in {elapsed:.1f} s = {produced / elapsed:.1f} out tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
