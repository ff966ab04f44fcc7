"""The disaggregation check of bench/disagg_gpu.py, on the CPU with Gloo and a tiny preset:
disaggregated outputs equal a co-located worker's, pools whole, and a decode worker killed with
requests in flight (then restarted) leaves the prefill worker whole and is used again; the fleet
placement (two both workers, ``--pd-policy fleet``, TPOT guard) equals the co-located worker too. The
workers run with overlapped steps (``--async-scheduling on``), as they do on a GPU."""
from __future__ import annotations

import json

from bench import disagg_gpu


def test_disaggregated_equals_colocated_and_survives_a_decode_crash(tmp_path):
    out = tmp_path / "disagg.json"
    assert disagg_gpu.main(["--device", "cpu", "--model", "tiny-qwen3", "--vocab-max", "500", "--requests", "24",
                            "--prefix-len", "64", "--max-tokens", "8", "--kv-memory-gb", "0.05",
                            "--kill-prompt-len", "300", "--max-model-len", "1024", "--out", str(out),
                            "--worker-args", "--async-scheduling on", "--fleet"]) == 0
    r = json.loads(out.read_text())
    assert r["equality"]["identical"] == r["equality"]["requests"] == 24
    assert not any(r["equality"]["errors"].values())
    for pools in r["pools_after"].values():
        assert all(p["free"] == p["total"] for p in pools.values())
    kill = r["kill"]
    assert set(kill["client_codes"]) <= {"UNAVAILABLE", "OK"} and "UNAVAILABLE" in kill["client_codes"]
    assert kill["prefill_free_after_kill"] == kill["prefill_total"]
    assert kill["after_restart_identical"] == 8
    assert all(p["free"] == p["total"] for p in kill["pools_after_restart"].values())
    assert not any(r["log_errors"].get(name) for name in ("prefill0", "decode0", "both-decode0"))
    fleet = r["fleet"]
    assert fleet["equality"]["identical"] == 24 and not any(fleet["equality"]["errors"].values())
    assert all(p["free"] == p["total"] for p in fleet["pools_after"].values())
