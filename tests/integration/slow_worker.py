"""``pdserve ARGS`` with a slow model on long steps: the tests' stand-in for a loaded CPU.

Every engine step that computes at least $PDSERVE_TEST_SLOW_MIN_TOKENS tokens of one sequence
(a long prompt's prefill) takes $PDSERVE_TEST_SLOW_STEP_S seconds more, inside the model's
compute (``ModelRunner.launch``, the forward on the CPU), as a long prefill does on a machine
whose cores other work holds (measured on the 2-core test machine: a 1,200-token prefill of the
embedded model took 14-30 s on two intra-op threads while other processes kept both cores busy).
Short steps are untouched. Run as
``python tests/integration/slow_worker.py decode --port ...`` (the source tree on PYTHONPATH).
"""
from __future__ import annotations

import os
import runpy
import sys
import time

from pdserve.common.engine import model_runner

SLOW_STEP_S = float(os.environ.get("PDSERVE_TEST_SLOW_STEP_S", "0"))
MIN_TOKENS = int(os.environ.get("PDSERVE_TEST_SLOW_MIN_TOKENS", "200"))
_launch = model_runner.ModelRunner.launch


def launch(self, seqs, is_prefill, *args, **kwargs):
    launched = _launch(self, seqs, is_prefill, *args, **kwargs)
    if SLOW_STEP_S and max((s.num_scheduled_tokens for s in seqs), default=0) >= MIN_TOKENS:
        time.sleep(SLOW_STEP_S)
    return launched


model_runner.ModelRunner.launch = launch     # type: ignore[method-assign]
sys.argv = ["pdserve", *sys.argv[1:]]
runpy.run_module("pdserve.cli", run_name="__main__")
