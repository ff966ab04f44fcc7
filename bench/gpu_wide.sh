#!/usr/bin/env bash
# One device call for the decode chain's wide range (Gluon GEMMs, 33-256 rows; nvidia-h100-x1):
# its GPU and kernel tests, then decode steps at 48-256 rows and W-nano, each interleaved with the
# wide range off (PDSERVE_DATAFLOW_WIDE=0) and on. MODEL=qwen3-8b adds the 8B geometry's W-nano.
# Results under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pytest -q -s -x tests/gpu/test_gluon_gemm_gpu.py tests/unit/test_dataflow_decode.py tests/gpu/test_dataflow_gpu.py \
  -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "batch|passed|failed|Error|error" | tail -20
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
. bench/onoff.sh
onoff PDSERVE_DATAFLOW_WIDE "decode step" "b=|decode step" python3 -m bench.decode_step --batch 48 --context 1200 \
  --grid 64:1200,96:1200,128:1200,192:1200,256:1200 --out "$OUT/decode_step_w{f}_r{r}.json"
onoff PDSERVE_DATAFLOW_WIDE W-nano "out tok/s" python3 -m bench.offline --workload nano --out "$OUT/offline_nano_w{f}_r{r}.json"
if [ -n "${MODEL:-}" ]; then
  for f in 0 1; do
    echo "== W-nano $MODEL, wide $f"
    PDSERVE_DATAFLOW_WIDE=$f python3 -m bench.offline --model "$MODEL" --workload nano \
      --out "$OUT/offline_${MODEL}_w$f.json" 2>&1 | tail -1
  done
fi
