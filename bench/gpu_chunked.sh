#!/usr/bin/env bash
# Chunked prefill on one GPU (nvidia-h100-x1). Parts, in the order given (default: all but serve):
#   tests  GPU tests + the chunked-prefill CPU suites on this machine
#   nano   W-nano with chunking on (default budget) and off, interleaved, after a decode-step
#          bench has compiled the decode kernels (as bench/gpu_engine.sh does)
#   long   a 32,768-token prompt under a budget of 8,192 while 32 sequences decode
#   steps  mixed-step timings for the Qwen3-8B geometry
#   serve  one worker of role both, Qwen3-8B geometry, prefill-heavy Poisson load: chunked
#          (budget $BUDGETS, default 512 1024) against unchunked, same requests
# Usage (device machine, repo root): bash bench/gpu_chunked.sh OUTDIR [part ...]
set -uo pipefail
OUT=${1:-bench/results}; shift || true
PARTS=${*:-tests nano long steps}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
cache_entries() { ls "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" 2>/dev/null | wc -l; }
for part in $PARTS; do case $part in
tests)
  python3 -m pytest -q -x tests/gpu tests/unit/test_fused_ops.py tests/unit/test_chunked_prefill.py \
    tests/unit/test_scheduler_chunked.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -3 ;;
nano)
  python3 -m bench.decode_step --out "$OUT/decode_step.json" 2>&1 | tail -1
  for i in 1 2; do
    for mode in chunked unchunked; do
      flag=""; [ $mode = unchunked ] && flag=--no-enable-chunked-prefill
      before=$(cache_entries)
      python3 -m bench.offline --workload nano $flag --out "$OUT/offline_${mode}_$i.json" 2>&1 | tail -1
      echo "  ($mode run $i: $(( $(cache_entries) - before )) Triton kernels compiled during the process)"
    done
  done ;;
long)
  python3 -m bench.long_prompt --out "$OUT/long_prompt.json" 2>&1 | tail -1 ;;
steps)
  python3 -m bench.chunked_step --model qwen3-8b --out "$OUT/chunked_step_8b.json" 2>&1 | tail -13 ;;
serve)
  ups=()
  for b in ${BUDGETS:-512 1024}; do
    ups+=(--up-config "chunked$b=--prefill 0 --decode 1 --role both --decode-gpus 0 --extra-worker-args=--max-num-batched-tokens=$b")
  done
  ups+=(--up-config "unchunked=--prefill 0 --decode 1 --role both --decode-gpus 0 --extra-worker-args=--no-enable-chunked-prefill")
  python3 -m pdserve.cli bench compare --launch --gpus 0 --device cuda --model qwen3-8b "${ups[@]}" \
    --dataset prefill-heavy --input-len 2000:4000 --output-len 100:300 --num-prompts ${NUM_PROMPTS:-160} \
    --request-rate ${RATES:-5,8,11} --prompt-format ids --vocab-size 151936 --num-warmups 4 \
    --slo ttft_ms=1000,tpot_ms=12 --label chunked-both-8b --disable-tqdm --startup-timeout 400 \
    --result-dir "$OUT" 2>&1 | tail -30 ;;
esac; done
