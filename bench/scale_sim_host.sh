#!/usr/bin/env bash
# The scale simulation on a device machine's 16 CPU cores (the GPU unused), two runs side by side:
#
#   bash bench/scale_sim_host.sh multi-turn     # 6-turn conversations, open and closed loop
#   bash bench/scale_sim_host.sh long           # 12-turn (4,096-block prefill pools) beside saturated,
#                                               # then the decision alone x3
#   bash bench/scale_sim_host.sh churn          # 4 workers killed and 4 added under load, then shared-prefix,
#                                               # beside a repeat of the 6-turn open-loop compare
#
# Results under $OUT/<plan>/ (JSON; at most 8 files come back from a device call), logs under
# /tmp/scale_sim_logs/<plan>/ (their last lines printed). Needs .whl (the grpc / protobuf wheels of
# docs/benchmarks.md) and .simcache (the embedded model's config and tokenizer; the routers need
# no weights) carried; PDSERVE_GIT_COMMIT names the commit in every JSON.
set -u
plan=${1:?plan: multi-turn | long | churn}
out=${OUT:-/tmp/out}/$plan
logs=/tmp/scale_sim_logs/$plan
mkdir -p "$out" "$logs"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PDSERVE_CACHE_DIR=$PWD/.simcache
sim() { local name=$1; shift; timeout 560 python3 -m bench.scale_sim "$@" --out "$out/$name" > "$logs/$name.log" 2>&1; }

case $plan in
multi-turn)
    sim closed6 compare --workloads multi-turn-closed --policies kv,round-robin,oracle & b=$!
    sim open6 compare --workloads multi-turn --policies kv,round-robin,oracle
    wait $b ;;
long)
    sim saturated saturated --num-prompts 300 --rate 5 --policies kv,least-loaded,round-robin & b=$!
    sim long12 compare --workloads multi-turn-long --policies kv,round-robin,oracle --prefill-blocks 4096
    wait $b
    for i in 1 2 3; do python3 -m bench.sim.decision --requests 2000 --out "$out/decision_run$i.json" > /dev/null; done ;;
churn)
    sim open6_repeat compare --workloads multi-turn --policies kv,round-robin,oracle & b=$!
    sim churn churn --num-prompts 1200 --rate 15 --churn-at 20 --churn-workload shared-prefix-long
    sim shared compare --workloads shared-prefix --policies kv,round-robin,oracle
    wait $b ;;
*) echo "unknown plan $plan"; exit 2 ;;
esac
for f in "$logs"/*.log; do echo "== $f"; tail -3 "$f"; done
