#!/usr/bin/env bash
# The engine on several model geometries on one H100 (dummy weights), correctness first.
# Parts, in the order given (default: tests steps nano baseline):
#   tests     GPU tests (kernels vs the torch reference on fresh random inputs, logits vs HF)
#   steps     one graph-replayed decode step per geometry at a few (batch, context) points
#   nano      W-nano per geometry ($MODELS), $RUNS runs each in fresh processes
#   baseline  W-uniform on qwen3-0.6b and the HF transformers baseline of the same workload
# Usage (device machine, repo root): bash bench/gpu_geometry.sh OUTDIR [part ...]
set -uo pipefail
OUT=${1:-bench/results}; shift || true
PARTS=${*:-tests steps nano baseline}
MODELS=${MODELS:-qwen3-0.6b qwen3-8b qwen2.5-7b smollm2-1.7b llama3.2-3b}
RUNS=${RUNS:-1}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
for part in $PARTS; do case $part in
tests)
  python3 -m pytest -q -x tests/gpu tests/unit/test_fused_ops.py -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -3 ;;
steps)
  for m in $MODELS; do
    echo "== decode step $m"
    python3 -m bench.decode_step --model "$m" --grid 128:800,32:1000,8:1200 \
      --out "$OUT/decode_step_$m.json" 2>&1 | grep -E "b=|step|GB/s" | tail -5
  done ;;
nano)
  for m in $MODELS; do
    for i in $(seq 1 "$RUNS"); do
      echo "== W-nano $m run $i"
      python3 -m bench.offline --model "$m" --workload nano --out "$OUT/offline_${m}_$i.json" 2>&1 | tail -1
    done
  done ;;
baseline)
  python3 -m bench.offline --workload uniform --out "$OUT/offline_uniform.json" 2>&1 | tail -1
  python3 -m bench.hf_baseline --out "$OUT/hf_baseline.json" 2>&1 | tail -1 ;;
*) echo "unknown part $part"; exit 2 ;;
esac; done
