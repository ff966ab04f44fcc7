#!/usr/bin/env bash
# The GPU engine check on one H100: correctness first (kernels vs torch, engine vs HF), then the
# attention microbenchmark and the offline throughput (W-nano, W-uniform), then the HF baseline.
# Usage (device machine, repo root): bash bench/gpu_engine.sh OUTDIR [--no-baseline] [--quick]
set -uo pipefail
OUT=${1:-bench/results}; shift || true
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers, google.protobuf as pb, grpc; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'protobuf', pb.__version__, 'grpc', grpc.__version__)"
python3 -m pytest -q -x tests/gpu tests/unit/test_fused_ops.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
[[ " $* " == *" --kernels "* ]] && python3 bench/attention_kernels.py --no-sweep --out "$OUT/attention_kernels.json" 2>&1 | tail -25
python3 -m bench.decode_step --out "$OUT/decode_step.json" 2>&1 | tail -2
python3 -m bench.offline --workload nano uniform --out "$OUT/offline.json" 2>&1 | tail -8
if [[ " $* " != *" --no-baseline "* ]]; then
  python3 -m bench.hf_baseline --out "$OUT/hf_baseline.json" 2>&1 | tail -3
fi
