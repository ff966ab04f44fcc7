"""lm-evaluation-harness (the pinned release, its own CLI, unmodified) against ``pdserve up`` on
the embedded model (CPU, disaggregated), per item equal to lm-eval's own ``hf`` backend on the
same checkpoint:

- ``pdserve_mc`` (24 questions, tests/data/lm_eval) scored by log-likelihood through
  ``local-completions`` (``echo`` + prompt logprobs): every item picks the same choice, and each
  choice's log-likelihood agrees to 1e-3;
- ``pdserve_gen`` (16 questions, chat template, greedy) through ``local-chat-completions``: every
  generated answer is the same text, so the scores are equal.

The two server runs are lm-eval CLI processes started together; the ``hf`` reference runs
meanwhile in this process (lm-eval's Python API over one loaded model). The router's admission
control is off: an evaluation's requests wait their turn on a loaded CI machine.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "data" / "lm_eval"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OPENAI_API_KEY": "unused", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def dep(openai_up):
    return openai_up            # tests/integration/conftest.py (admission off)


def _cli(model: str, model_args: dict, task: str, out: Path, *extra: str) -> subprocess.Popen:
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", args, "--tasks", task,
           "--include_path", str(TASKS), "--log_samples", "--output_path", str(out), *extra]
    with open(out.parent / f"{out.name}.log", "w") as log:      # the child keeps its own descriptor
        return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **OFFLINE}, stdout=log, stderr=subprocess.STDOUT)


def _samples(out: Path, task: str) -> list[dict]:
    (path,) = glob.glob(str(out / "*" / f"samples_{task}_*.jsonl"))
    return sorted((json.loads(line) for line in open(path)), key=lambda s: s["doc_id"])


def _hf_samples(checkpoint: str) -> dict[str, list[dict]]:
    """lm-eval's own hf backend on the checkpoint, per task (the gen task with its chat template)."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    hf = HFLM(pretrained=checkpoint, dtype="float32", device="cpu", batch_size=16)
    tm = TaskManager(include_path=str(TASKS))
    out = {}
    for task, chat in (("pdserve_mc", False), ("pdserve_gen", True)):
        res = lm_eval.simple_evaluate(model=hf, tasks=[task], task_manager=tm, log_samples=True,
                                      apply_chat_template=chat)
        out[task] = sorted(res["samples"][task], key=lambda s: s["doc_id"])
    return out


def test_lm_eval_through_the_api_equals_the_hf_backend(dep, tmp_path, monkeypatch):
    from pdserve.common.default_model import ensure_default_model
    checkpoint = str(ensure_default_model())
    http = dep.http.rstrip("/")
    with urllib.request.urlopen(f"{http}/models", timeout=30) as r:
        name = json.load(r)["data"][0]["id"]
    mc = _cli("local-completions", {"model": name, "base_url": f"{http}/completions", "tokenizer": checkpoint,
                                    "tokenizer_backend": "huggingface", "num_concurrent": 4, "max_retries": 1},
              "pdserve_mc", tmp_path / "mc", "--batch_size", "16")
    gen = _cli("local-chat-completions", {"model": name, "base_url": f"{http}/chat/completions",
                                          "num_concurrent": 4, "max_retries": 1},
               "pdserve_gen", tmp_path / "gen", "--apply_chat_template")
    monkeypatch.chdir(ROOT)                          # the tasks' data paths are the repository's
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    ref = _hf_samples(checkpoint)
    for proc, out in ((mc, "mc"), (gen, "gen")):
        assert proc.wait(timeout=300) == 0, (tmp_path / f"{out}.log").read_text()[-3000:]

    served = _samples(tmp_path / "mc", "pdserve_mc")
    assert len(served) == len(ref["pdserve_mc"]) == 24
    for s, r in zip(served, ref["pdserve_mc"]):
        got = [float(x[0]) for x in s["filtered_resps"]]
        want = [float(x[0]) for x in r["filtered_resps"]]
        assert got.index(max(got)) == want.index(max(want)), (s["doc"], got, want)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3, (s["doc"], got, want)
        assert [x[1] for x in s["filtered_resps"]] == [str(x[1]) for x in r["filtered_resps"]]  # is_greedy
        assert s["acc"] == r["acc"]

    served = _samples(tmp_path / "gen", "pdserve_gen")
    assert len(served) == len(ref["pdserve_gen"]) == 16
    for s, r in zip(served, ref["pdserve_gen"]):
        assert s["resps"][0][0] == r["resps"][0][0], s["doc"]
        assert s["exact_match"] == r["exact_match"]
    dep.wait_whole(dep.decode[0])
    dep.wait_whole(dep.prefill[0])
