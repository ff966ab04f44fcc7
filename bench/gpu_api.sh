#!/usr/bin/env bash
# Issue 42 on one GPU: the sampler's bias / min_tokens / top-logprob paths and prompt logprobs on
# CUDA against torch and HF references (tests/gpu/test_logprobs_gpu.py, with the other sampler
# tests), then the guided-decoding throughput bar (bench/guided_gpu.py: guided JSON within 10% of
# unguided output tok/s at batch 64).
# Usage (device machine, repo root): bash bench/gpu_api.sh OUTDIR
# Env: TOKENIZER, a tokenizer directory for the guided run where the embedded model is not installed.
set -uo pipefail
OUT=${1:-bench/results}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_logprobs_gpu.py tests/unit/test_sampler_bias.py \
  tests/unit/test_sampler_mask.py tests/unit/test_prompt_logprobs.py 2>&1 | tee "$OUT/gpu_api_tests.log" | tail -15
python3 -m bench.guided_gpu ${TOKENIZER:+--tokenizer "$TOKENIZER"} --out "$OUT/guided_h100.json" 2>&1 | tail -8
