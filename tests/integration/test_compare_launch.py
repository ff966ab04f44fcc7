"""``pdserve bench compare --launch --capacity`` end to end on the CPU: it starts two `pdserve up`
deployments of the embedded model one after the other (real router and worker processes), waits
for each, runs the capacity search on it and stops it. Each run sends its own variant of the
workload (``tests/unit/test_cli.py`` checks where ``--extra-decode-args`` goes). The routers'
admission control is off: a loaded CI machine's estimate of a burst's wait must not refuse
requests of a search whose objectives are a minute."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_compare_launches_two_deployments_and_finds_their_capacity(tmp_path):
    adaptive = ("--prefill 1 --decode 1 --role both --extra-decode-args='--max-num-seqs 8 --max-num-batched-tokens 64' "
                "--extra-router-args='--pd-policy adaptive --slo-tpot-ms 60000 --admission-slo-multiple 0'")
    colocated = "--prefill 0 --decode 1 --role both --extra-router-args='--admission-slo-multiple 0'"
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "compare", "--launch", "--device", "cpu",
           "--model", "default", "--up-config", f"colocated={colocated}",
           "--up-config", f"adaptive={adaptive}", "--up-args=--http-port 0",
           "--dataset", "random", "--num-prompts", "4", "--input-len", "16:32", "--output-len", "2:4",
           "--capacity", "--request-rate", "20,40", "--slo", "ttft_ms=60000,tpot_ms=60000",
           "--num-warmups", "1", "--disable-tqdm", "--no-plots", "--startup-timeout", "240",
           "--result-dir", str(tmp_path), "--result-filename", "cap"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "cap.json").read_text())
    deps = {d["name"]: d for d in data["deployments"]}
    assert list(deps) == ["colocated", "adaptive"]
    for dep in deps.values():
        cap = dep["capacity"]
        assert cap["capacity"] == 40 and cap["upper"] is None and not cap["bounded"]   # both rates held
        assert [p["rate"] for p in cap["points"]] == [20, 40] and all(p["holds"] for p in cap["points"])
        assert [r["prompt_variant"] for r in dep["results"]] == [1, 2]
        assert all(r["completed"] == 4 and r["failed"] == 0 for r in dep["results"])
        assert dep["results"][1]["total_cached_tokens"] == 0        # run 2 did not find run 1's prompts
    assert "| adaptive | 40 | - (lower bound) | 2 |" in (tmp_path / "cap.md").read_text()
