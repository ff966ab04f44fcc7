#!/usr/bin/env bash
# FP8 on one H100 (issue 38), one device call: the FP8 kernel and engine tests (CUDA against the
# dequantized torch references), then W-nano through bench.offline in the same call on the
# Qwen3-8B preset (bf16; FP8 KV cache only; FP8 weights + FP8 KV cache) and the Qwen3-0.6B preset
# (bf16; FP8 weights + FP8 KV cache), then a summary: speedups over bf16 and KV pool sizes. Between
# the tests and W-nano, the FP8 projection against bf16 at decode row counts (bench/fp8_gemm.py).
# Usage (device machine, repo root): bash bench/gpu_fp8.sh OUTDIR
set -uo pipefail
OUT=${1:-bench/results/fp8_h100}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -m pytest -q -x tests/gpu/test_fp8_gpu.py tests/unit/test_fp8_kv_cache.py -p no:cacheprovider 2>&1 \
  | tee "$OUT/fp8_tests.log" | tail -15
python3 -m bench.fp8_gemm --out "$OUT/fp8_gemm.json" 2>&1 | tail -34
run() {   # name, model, extra flags...
  local name=$1 model=$2; shift 2
  python3 -m bench.offline --model "$model" --workload nano --out "$OUT/nano_$name.json" "$@" 2>&1 | tail -1
}
run 8b_bf16 qwen3-8b
run 8b_kvfp8 qwen3-8b --kv-cache-dtype fp8
run 8b_fp8 qwen3-8b --kv-cache-dtype fp8 --quantization fp8
run 06b_bf16 qwen3-0.6b
run 06b_fp8 qwen3-0.6b --kv-cache-dtype fp8 --quantization fp8
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    p = out / f"nano_{name}.json"
    return json.loads(p.read_text()) if p.exists() else None
summary = {}
for model, runs in (("qwen3-8b", ("8b_bf16", "8b_kvfp8", "8b_fp8")), ("qwen3-0.6b", ("06b_bf16", "06b_fp8"))):
    base = load(runs[0])
    for name in runs:
        r = load(name)
        if r is None or base is None:
            summary[name] = "missing"
            continue
        tok_s = r["results"][0]["output_tok_s"]
        summary[name] = {"model": model, "output_tok_s": round(tok_s), "speedup": round(tok_s / base["results"][0]["output_tok_s"], 3),
                         "num_kv_blocks": r["num_kv_blocks"], "blocks_ratio": round(r["num_kv_blocks"] / base["num_kv_blocks"], 3),
                         "kv_cache_dtype": r["kv_cache_dtype"], "preemptions": r["results"][0]["preemptions"]}
(out / "fp8_summary.json").write_text(json.dumps(summary, indent=1))
for k, v in summary.items():
    print(k, v)
PY
