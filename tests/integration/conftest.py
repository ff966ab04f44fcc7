"""Fixtures shared by the integration tests: the OpenAI API deployment of its clients, the offline
engine the served outputs are compared with."""
from __future__ import annotations

import pytest

from bench import deployment as services
from pdserve.common.engine import LLM
from pdserve.loadtest.ports import free_port_range


@pytest.fixture(scope="session")
def openai_up(tmp_path_factory):
    """One ``pdserve up`` (router + prefill + decode, the embedded model, CPU) for the tests that
    drive its APIs with clients (openai SDK, lm-eval, tritonclient, Node.js): started once, as
    each would start the same. Admission control is off: these tests' bursts on a loaded CI
    machine are not admission tests. The router's /metrics is ``metrics["router"]`` (the
    workers' on the next two ports)."""
    metrics = free_port_range(3)
    d = services.start_up(tmp_path_factory.mktemp("openai-up-logs"),
                          ["--metrics-port", str(metrics), "--extra-router-args", "--admission-slo-multiple 0"])
    d.metrics["router"] = f"127.0.0.1:{metrics}"
    d.colocated = False
    yield d
    d.stop()


@pytest.fixture(scope="session")
def offline():
    """The offline engine on the embedded model (CPU, 1,024 KV blocks): the greedy reference of the
    tests that compare served tokens with it, loaded once for all of them."""
    with LLM("default", device="cpu", num_kv_blocks=1024) as llm:
        yield llm
