#!/usr/bin/env bash
# The fleet placement on two GPUs (nvidia-h200-x2) against the static deployments, one part per call:
#   check   python -m bench.disagg_gpu --fleet --moves: disaggregated, fleet and moved-decode outputs equal co-located
#           token for token (qwen3-0.6b, float32, 200 requests), pools whole, the decode-kill check
#   phases  `pdserve bench compare --launch --dataset phases` on the Qwen3-8B geometry (dummy bf16):
#           the same requests through each deployment at the base rates RATES (no capacity search
#           unless CAPACITY=1), SLOs TTFT <= 1,000 ms, TPOT <= 12 ms, ITL p99 <= 30 ms
#   <name>  the same for one of bench/gpu_capacity.sh's workloads (prefill-heavy, shared-prefix,
#           decode-heavy) at RATES
# Deployments (DEPLOYS, default all three), every one on both GPUs:
#   disagg     1 prefill (GPU 0) + 1 decode (GPU 1), router --pd-policy always
#   colocated  2 workers of role both, chunked prefill at budget 512 (its best: docs/benchmarks.md)
#   fleet      2 workers of role both at co-location's budget (512), router --pd-policy fleet (pdserve up --placement fleet)
#   fleet-mixed  the fleet with prefill-sized steps where a worker has no decode rows (budget 8192)
#              and co-location's 512 in steps with decode rows (--max-mixed-batched-tokens 512)
#   fleet-still  fleet-mixed with no decode moves (--pd-move-interval-s 0)
#   fleet-guard  2 workers of role both with the TPOT guard at 12 ms (margin 0.05), router --pd-policy fleet
#   fleet-b512 fleet-guard with co-location's step budget of 512 tokens (the guard's ceiling in every step)
# Usage (device machine, repo root): bash bench/gpu_fleet.sh OUTDIR part [part ...]
# Env: RATES, NUM_PROMPTS (non-phase parts), PHASE_SECONDS (default 15), PHASE_CYCLES (default 1),
#      DEPLOYS, MODEL, DEVICE (cuda; cpu for a dry run), GPUS (0,1), CAPACITY (0).
set -uo pipefail
OUT=${1:?usage: gpu_fleet.sh OUTDIR part...}; shift
PARTS=${*:-check phases}
SLO=${SLO:-ttft_ms=1000,tpot_ms=12,itl_p99_ms=30}
ROUTER_SLO="--slo-ttft-ms 1000 --slo-tpot-ms 12"
# Admission control off in every deployment: the comparison is of placements, and a refusal would
# count as a missed SLO anyway.
NOADM="--admission-slo-multiple 0"
GPUS=${GPUS:-0,1}
G0=${GPUS%%,*}; G1=${GPUS##*,}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null

declare -A UP=(
  [disagg]="--prefill 1 --decode 1 --prefill-gpus $G0 --decode-gpus $G1 --extra-router-args='--pd-policy always $NOADM'"
  [colocated]="--prefill 0 --decode 2 --role both --decode-gpus $GPUS --extra-decode-args='--max-num-batched-tokens 512' --extra-router-args='--pd-policy never $NOADM'"
  [fleet]="--prefill 0 --decode 2 --role both --decode-gpus $GPUS --extra-decode-args='--max-num-batched-tokens 512' --extra-router-args='--pd-policy fleet $ROUTER_SLO $NOADM'"
  [fleet-mixed]="--prefill 0 --decode 2 --role both --decode-gpus $GPUS --extra-decode-args='--max-num-batched-tokens 8192 --max-mixed-batched-tokens 512' --extra-router-args='--pd-policy fleet $ROUTER_SLO $NOADM'"
  [fleet-still]="--prefill 0 --decode 2 --role both --decode-gpus $GPUS --extra-decode-args='--max-num-batched-tokens 8192 --max-mixed-batched-tokens 512' --extra-router-args='--pd-policy fleet --pd-move-interval-s 0 $ROUTER_SLO $NOADM'"
  [fleet-guard]="--prefill 0 --decode 2 --role both --decode-gpus $GPUS --extra-decode-args='--tpot-target-ms 12' --extra-router-args='--pd-policy fleet $ROUTER_SLO $NOADM'"
  [fleet-b512]="--prefill 0 --decode 2 --role both --decode-gpus $GPUS --extra-decode-args='--tpot-target-ms 12 --max-num-batched-tokens 512' --extra-router-args='--pd-policy fleet $ROUTER_SLO $NOADM'"
)
ups=()
for d in ${DEPLOYS:-disagg colocated fleet}; do ups+=(--up-config "$d=${UP[$d]}"); done
search=()
[ "${CAPACITY:-0}" = 1 ] && search=(--capacity --capacity-tolerance 1)

for part in $PARTS; do
  echo "== $part $(date -u +%T)"
  case $part in
    check) python3 -m bench.disagg_gpu --fleet --moves --device "${DEVICE:-cuda}" --out "$OUT/disagg_fleet.json" 2>&1 | tail -3
           continue ;;
    phases) work=(--dataset phases --phase-seconds "${PHASE_SECONDS:-15}" --phase-cycles "${PHASE_CYCLES:-1}"
                  --num-prompts 100000) ;;
    prefill-heavy) work=(--dataset prefill-heavy --input-len 2000:4000 --output-len 100:300 --num-prompts "${NUM_PROMPTS:-400}") ;;
    decode-heavy)  work=(--dataset decode-heavy --input-len 200:800 --output-len 500:1500 --num-prompts "${NUM_PROMPTS:-600}") ;;
    shared-prefix) work=(--dataset shared-prefix --num-prefixes 16 --prefix-len 2000 --input-len 100:500
                         --output-len 100:500 --num-prompts "${NUM_PROMPTS:-600}") ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
  python3 -m pdserve.cli bench compare --launch --gpus "$GPUS" --device "${DEVICE:-cuda}" --model "${MODEL:-qwen3-8b}" \
    "${ups[@]}" "${work[@]}" --prompt-format ids --vocab-size "${VOCAB:-151936}" --num-warmups 4 "${search[@]}" \
    --request-rate "${RATES:-12}" --slo "$SLO" --label "fleet-$part" --disable-tqdm --startup-timeout 400 \
    --result-dir "$OUT" 2>&1 | grep -v '^\s*$' | tail -40
done
echo "== done $(date -u +%T)"
