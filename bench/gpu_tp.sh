#!/usr/bin/env bash
# Tensor parallelism on two GPUs (issue 37; nvidia-h200-x2). Parts, in the order given (default: all):
#   tests  the tensor-parallel GPU tests (sharded layers vs unsharded on fresh random weights, the
#          engine at TP2 with CUDA graphs = TP1) and the CPU TP suites on this machine
#   nano   W-nano, Qwen3-32B preset (dummy weights), bf16: TP1 on GPU 0, then TP2 on GPUs 0-1;
#          prints the TP2/TP1 output tok/s ratio and the forwards the other rank replayed from graphs
# Usage (device machine, repo root): bash bench/gpu_tp.sh OUTDIR [part ...]
# (Disaggregated P TP1 -> D TP2 needs the KV transfer across layouts, not built yet: no part here.)
set -uo pipefail
OUT=${1:-bench/results}; shift || true
PARTS=${*:-tests nano}
MODEL=${MODEL:-qwen3-32b}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv
nvidia-smi topo -m | head -3
for part in $PARTS; do case $part in
tests)
  timeout 420 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_parallel_gpu.py \
    tests/unit/test_parallel_layers.py 2>&1 | tee "$OUT/gpu_tp_tests.log" | tail -3 ;;
nano)
  for tp in 1 2; do
    python3 -m bench.offline --model "$MODEL" -tp $tp --workload nano --out "$OUT/offline_${MODEL}_tp$tp.json" \
      2>&1 | grep -v " INFO " | tail -2
  done
  python3 - "$OUT" "$MODEL" <<'PY'
import json, sys
out, model = sys.argv[1], sys.argv[2]
r = {tp: json.load(open(f"{out}/offline_{model}_tp{tp}.json"))["results"][0] for tp in (1, 2)}
print(f"W-nano {model}: TP1 {r[1]['output_tok_s']:.0f}, TP2 {r[2]['output_tok_s']:.0f} output tok/s, "
      f"ratio {r[2]['output_tok_s'] / r[1]['output_tok_s']:.2f}; decode steps {r[2]['decode_steps']}, "
      f"forwards mirrored at TP2 {r[2].get('tp_forwards')}")
PY
  ;;
*) echo "unknown part $part" ;;
esac; done
