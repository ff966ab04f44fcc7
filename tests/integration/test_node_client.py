"""The Node.js example client (examples/node/client.js) against router + prefill + decode processes.

The client loads protos/pdserve/v1/*.proto at run time with @grpc/proto-loader, so this also
checks that the .proto files work for a non-Python gRPC stack. Skipped only when node or npm
is not installed. `npm ci` runs only when node_modules does not match package-lock.json (npm's
own record of what it installed, node_modules/.package-lock.json, is compared with the lock).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "examples" / "node"
CLIENT = NODE_DIR / "client.js"
CLIENT_TIMEOUT = 180  # s; the client's own deadline is 120 s

pytestmark = pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None,
                                reason="node and npm are needed for the Node.js client example")


def _versions(lock: Path) -> dict[str, str]:
    """Package path -> version of an npm lock file ("" is the example itself: left out)."""
    return {path: p.get("version") for path, p in json.loads(lock.read_text())["packages"].items() if path}


def _installed_from_lock() -> bool:
    """Whether node_modules holds the packages of package-lock.json at their locked versions."""
    try:
        installed = _versions(NODE_DIR / "node_modules" / ".package-lock.json")    # written by npm itself
        return installed == _versions(NODE_DIR / "package-lock.json")
    except (OSError, ValueError, KeyError):
        return False


@pytest.fixture(scope="module")
def node_modules() -> Path:
    """`npm ci` in examples/node unless node_modules was installed from this very lock file."""
    if _installed_from_lock():
        return NODE_DIR / "node_modules"
    r = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"npm ci failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return NODE_DIR / "node_modules"


@pytest.fixture(scope="module")
def deployment(openai_up):
    return openai_up            # `pdserve up`, CPU, the session's: tests/integration/conftest.py


def _client(address: str, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PDSERVE_ROUTER", "PDSERVE_PROTOS")}
    return subprocess.run(["node", str(CLIENT), address, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=CLIENT_TIMEOUT)


def test_streams_the_answer(node_modules, deployment):
    r = _client(deployment.router)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "Paris" in r.stdout, r.stdout
    assert "finish_reason=FINISH_REASON_" in r.stderr and "completion_tokens=" in r.stderr, r.stderr


def test_invalid_sampling_value_is_invalid_argument(node_modules, deployment):
    r = _client(deployment.router, "--top-p", "2")
    assert r.returncode != 0, r.stdout
    assert "INVALID_ARGUMENT" in r.stderr and "params.top_p" in r.stderr, r.stderr
    assert r.stdout.strip() == ""


def test_empty_text_prompt_is_invalid_argument(node_modules, deployment):
    r = _client(deployment.router, "", "--text")
    assert r.returncode != 0, r.stdout
    assert "INVALID_ARGUMENT" in r.stderr and "prompt is empty" in r.stderr, r.stderr
