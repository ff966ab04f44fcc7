"""Fixtures shared by the integration tests of the OpenAI API and its clients."""
from __future__ import annotations

import pytest

from bench import deployment as services


@pytest.fixture(scope="session")
def openai_up(tmp_path_factory):
    """One ``pdserve up`` (router + prefill + decode, the embedded model, CPU) for the tests that
    drive the HTTP API with clients (openai SDK, lm-eval): started once, as each would start the
    same. Admission control is off: these tests' bursts on a loaded CI machine are not
    admission tests."""
    d = services.start_up(tmp_path_factory.mktemp("openai-up-logs"),
                          ["--extra-router-args", "--admission-slo-multiple 0"])
    d.colocated = False
    yield d
    d.stop()
