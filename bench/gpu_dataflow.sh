#!/usr/bin/env bash
# One device call for the small-batch decode chain (nvidia-h100-x1): GPU and kernel tests, the
# end-to-end greedy check, the layer probe, decode steps at batch 1-48 and W-nano, each interleaved with the chain
# off (PDSERVE_DATAFLOW_DECODE=0) and on. Results under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m pytest -q -s -x tests/gpu tests/unit/test_fused_ops.py tests/unit/test_dataflow_decode.py tests/unit/test_ops.py \
  tests/unit/test_sampler.py tests/unit/test_sampler_seeds.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
python3 -m bench.dataflow_check --out "$OUT/dataflow_check.json" 2>&1 | tail -2
python3 -m bench.dataflow_layer_probe --out "$OUT/layer_probe.json" 2>&1 | tail -8
. bench/onoff.sh
onoff PDSERVE_DATAFLOW_DECODE "decode step" "b=|decode step" python3 -m bench.decode_step --batch 1 --context 1200 \
  --grid 2:1200,4:1200,8:1200,16:1200,24:1200,32:1200,48:1200 --out "$OUT/decode_step_df{f}_r{r}.json"
onoff PDSERVE_DATAFLOW_DECODE W-nano "out tok/s" python3 -m bench.offline --workload nano --out "$OUT/offline_nano_df{f}_r{r}.json"
