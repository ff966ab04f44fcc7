#!/usr/bin/env bash
# SLO capacity of deployments on two GPUs (nvidia-h200-x2), Qwen3-8B geometry, dummy bf16 weights:
# the highest Poisson rate at which >= 90% of requests meet TTFT <= 1,000 ms and TPOT <= 12 ms and
# the run's ITL p99 stays <= 30 ms (`pdserve bench compare --capacity`, docs/benchmarks.md).
# Deployments (DEPLOYS, default all four):
#   disagg     1 prefill (GPU 0) + 1 decode (GPU 1), every prompt prefilled remotely
#   colocated  2 workers of role both, chunked prefill (budget $BUDGET), every prompt local
#   adaptive   1 prefill (GPU 0) + 1 both (GPU 1, budget $BUDGET), the router's adaptive policy
#   adaptive2  2 workers of role both (budget $BUDGET), the router's adaptive policy
# Workloads, in the order given (default all three):
#   prefill-heavy  prompts 2,000-4,000 tokens, 100-300 out
#   decode-heavy   prompts 200-800, 500-1,500 out
#   shared-prefix  16 system prompts of 2,000 tokens + user parts of 100-500, 100-500 out
# Usage (device machine, repo root): bash bench/gpu_capacity.sh OUTDIR [workload ...]
# Env: RATES (the rate list the bisection starts from), NUM_PROMPTS, BUDGET, DEPLOYS, MODEL,
#      ROUTER_TPOT (the adaptive router's --slo-tpot-ms, default 12: the benchmark's SLO), TAG (file label),
#      CAP_TOL (the bisection's tolerance, req/s, default 1).
set -uo pipefail
OUT=${1:-bench/results}; shift || true
PARTS=${*:-prefill-heavy decode-heavy shared-prefix}
BUDGET=${BUDGET:-512}
SLO=${SLO:-ttft_ms=1000,tpot_ms=12,itl_p99_ms=30}
ROUTER_SLO="--slo-ttft-ms 1000 --slo-tpot-ms ${ROUTER_TPOT:-12}"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null

declare -A UP=(
  [disagg]="--prefill 1 --decode 1 --prefill-gpus 0 --decode-gpus 1 --extra-router-args='--pd-policy always'"
  [colocated]="--prefill 0 --decode 2 --role both --decode-gpus 0,1 --extra-decode-args='--max-num-batched-tokens $BUDGET' --extra-router-args='--pd-policy never'"
  [adaptive]="--prefill 1 --decode 1 --role both --prefill-gpus 0 --decode-gpus 1 --extra-decode-args='--max-num-batched-tokens $BUDGET' --extra-router-args='--pd-policy adaptive $ROUTER_SLO'"
  [adaptive2]="--prefill 0 --decode 2 --role both --decode-gpus 0,1 --extra-decode-args='--max-num-batched-tokens $BUDGET' --extra-router-args='--pd-policy adaptive $ROUTER_SLO'"
)
ups=()
for d in ${DEPLOYS:-disagg colocated adaptive adaptive2}; do ups+=(--up-config "$d=${UP[$d]}"); done

for part in $PARTS; do
  case $part in
    prefill-heavy) work=(--dataset prefill-heavy --input-len 2000:4000 --output-len 100:300)
                   rates=${RATES:-6,10,14,18} ;;
    decode-heavy)  work=(--dataset decode-heavy --input-len 200:800 --output-len 500:1500)
                   rates=${RATES:-8,14,20,26} ;;
    shared-prefix) work=(--dataset shared-prefix --num-prefixes 16 --prefix-len 2000 --input-len 100:500
                         --output-len 100:500)
                   rates=${RATES:-8,14,20,26} ;;
    *) echo "unknown workload $part"; exit 2 ;;
  esac
  echo "== $part $(date -u +%T)"
  python3 -m pdserve.cli bench compare --launch --gpus 0,1 --device cuda --model "${MODEL:-qwen3-8b}" "${ups[@]}" \
    "${work[@]}" --num-prompts "${NUM_PROMPTS:-120}" --prompt-format ids --vocab-size 151936 --num-warmups 4 \
    --capacity --capacity-tolerance "${CAP_TOL:-1}" --request-rate "$rates" --slo "$SLO" --label "capacity-$part${TAG:+-$TAG}" --disable-tqdm \
    --startup-timeout 400 --result-dir "$OUT" 2>&1 | grep -v '^\s*$' | tail -40
done
echo "== done $(date -u +%T)"
