#!/usr/bin/env bash
# The disaggregation check with the FP8 KV cache on two GPUs (issue 38), one device call:
# bench.disagg_gpu with --kv-cache-dtype fp8 on every worker (disaggregated against co-located,
# token for token; pools whole; the decode-worker kill) with the check's float32 model (greedy
# ties across batch shapes unlikely), then the same run with a bf16 model and its bf16 cache, the
# baseline of the bytes per transfer (an FP8 block is the same size whatever the model's dtype).
# Usage (device machine, repo root): bash bench/gpu_fp8_disagg.sh OUTDIR
set -uo pipefail
OUT=${1:-bench/results/fp8_disagg}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -m bench.disagg_gpu --worker-args "--kv-cache-dtype fp8" --top-logprobs 2 --out "$OUT/disagg_fp8.json" 2>&1 | tail -3
python3 -m bench.disagg_gpu --dtype bfloat16 --out "$OUT/disagg_bf16.json" 2>&1 | tail -3
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
summary = {}
for name in ("fp8", "bf16"):
    p = out / f"disagg_{name}.json"
    if not p.exists():
        summary[name] = "missing"
        continue
    r = json.loads(p.read_text())
    pools = r.get("pools_after", {}).get("disaggregated", {})
    sent = sum(v["transfers"] for v in pools.values())
    nbytes = sum(v["transfer_bytes"] for v in pools.values())
    restart = r.get("kill", {}).get("pools_after_restart", {})   # the same 8 prompts to a fresh decode worker
    kill_bytes = min((v["transfer_bytes"] for v in restart.values() if v["transfers"]), default=0)  # the fresh one
    summary[name] = {"identical": r.get("equality", {}).get("identical"), "requests": r.get("equality", {}).get("requests"),
                     "near_ties": r.get("equality", {}).get("near_ties"), "kill_phase_bytes": kill_bytes,
                     "errors": r.get("equality", {}).get("errors"), "bytes_per_transfer": nbytes / sent if sent else None,
                     "pools_whole": all(v["free"] == v["total"] for pools in r.get("pools_after", {}).values()
                                        for v in pools.values())}
if isinstance(summary.get("fp8"), dict) and isinstance(summary.get("bf16"), dict) and summary["bf16"]["kill_phase_bytes"]:
    # the same blocks shipped (bytes per transfer also depend on the decode worker's prefix hits)
    summary["fp8_over_bf16_kill_phase_bytes"] = summary["fp8"]["kill_phase_bytes"] / summary["bf16"]["kill_phase_bytes"]
(out / "fp8_disagg_summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
PY
