"""Offline checks of the hardened deployment: read-only root filesystems with explicit writable
mounts, topology spread for every Deployment, the autoscaling component (one HPA per worker
Deployment on a metric the workers export, served by the Prometheus Adapter as docs/deploy.md
configures it), pinned torch and license labels in the images, the license itself, and the
split between the runtime install (`make run`) and the test install (`make test`).

Rendering uses the same pinned kustomize as the other deploy tests (tests/unit/deploy_render.py).
"""
from __future__ import annotations

import json
import re

import pytest
import tomllib
import yaml
from deploy_render import (
    DEPLOY,
    K8S,
    KUSTOMIZATIONS,
    MIN_K8S_VERSION,
    OVERLAYS,
    REPO,
    WORKERS,
    deployments,
    pod_spec,
    render_path,
    render_with_components,
    selector_matches,
)

AUTOSCALING = K8S / "components" / "autoscaling"
MONITORING = K8S / "components" / "monitoring"
HOME_CACHE = "/home/pdserve/.cache"     # $HOME/.cache of the images' user (JIT caches)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render_path(path) for name, path in KUSTOMIZATIONS.items()}


@pytest.fixture(scope="module")
def autoscaled(tmp_path_factory) -> dict[str, list[dict]]:
    """{overlay: objects} with the monitoring and autoscaling components, as docs/deploy.md says."""
    return render_with_components((MONITORING, AUTOSCALING), tmp_path_factory, "autoscaled")


# ---- pods ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_read_only_root_filesystem_with_explicit_writable_mounts(rendered, name):
    for role, dep in deployments(rendered[name]).items():
        spec = pod_spec(dep)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, (role, c["name"])
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert all(v in volumes for v in mounts.values()), (role, mounts)
            assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]], (role, mounts)
            if role in WORKERS:
                assert HOME_CACHE in mounts and "/dev/shm" in mounts, (role, mounts)
            for path, vol in mounts.items():
                assert volumes[vol]["emptyDir"].get("sizeLimit"), (role, path)    # bounded scratch space


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_every_deployment_spreads_over_nodes_and_zones(rendered, name):
    for role, dep in deployments(rendered[name]).items():
        constraints = pod_spec(dep).get("topologySpreadConstraints", [])
        keys = {c["topologyKey"]: c for c in constraints}
        assert {"kubernetes.io/hostname", "topology.kubernetes.io/zone"} <= set(keys), role
        labels = dep["spec"]["template"]["metadata"]["labels"]
        for c in constraints:
            assert c["maxSkew"] == 1 and selector_matches(c["labelSelector"], labels), (role, c)
        # two routers never share a node; workers prefer to (GPU nodes are scarce)
        want = "DoNotSchedule" if role == "router" else "ScheduleAnyway"
        assert keys["kubernetes.io/hostname"]["whenUnsatisfiable"] == want, role


# ---- autoscaling ----------------------------------------------------------------------------

def _worker_gauges() -> set[str]:
    from pdserve.common.serving.metrics import WorkerMetrics
    worker = WorkerMetrics("decode")
    worker.stats_source = lambda: {"num_total_blocks": 1}
    return {f.name for f in worker.registry.collect() if f.type == "gauge"}


def _adapter_rules() -> list[dict]:
    """The Prometheus Adapter rules in docs/deploy.md (the YAML block under "rules:")."""
    text = (REPO / "docs" / "deploy.md").read_text()
    block = re.search(r"```yaml\n(# prometheus-adapter values.*?)```", text, re.S)
    assert block, "docs/deploy.md: the Prometheus Adapter values block is missing"
    return yaml.safe_load(block.group(1))["rules"]["custom"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_hpa_per_worker_on_an_exported_worker_metric(autoscaled, overlay):
    objs = autoscaled[overlay]
    deps = deployments(objs)
    hpas = {o["spec"]["scaleTargetRef"]["name"]: o for o in objs if o["kind"] == "HorizontalPodAutoscaler"}
    assert set(hpas) == {deps[w]["metadata"]["name"] for w in WORKERS}
    rules = {r["name"]["as"]: r for r in _adapter_rules()}
    gauges = _worker_gauges()
    for role in WORKERS:
        dep = deps[role]
        hpa = hpas[dep["metadata"]["name"]]
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": dep["metadata"]["name"]}
        assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
        assert "replicas" not in dep["spec"], "the HPA owns the replica count"
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] == "Pods"
            name = metric["pods"]["metric"]["name"]
            rule = rules[name]              # the adapter serves it under this name ...
            source = rule["name"]["matches"].strip("^$")
            assert source in gauges, (name, source)     # ... from a gauge the workers export
            assert source in rule["seriesQuery"] and "<<.Series>>" in rule["metricsQuery"]
            assert {"namespace", "pod"} <= set(rule["resources"]["overrides"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_autoscaled_render_is_schema_valid(autoscaled, overlay):
    import kubernetes_validate
    for obj in autoscaled[overlay]:
        if obj["kind"] != "PodMonitor":     # a custom resource: test_deploy_monitoring checks it
            kubernetes_validate.validate(obj, MIN_K8S_VERSION, strict=True)
            kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


# ---- images, license, install ---------------------------------------------------------------

def _setup_torch_pin() -> str:
    return re.search(r"torch==([0-9.]+)", (REPO / "scripts" / "setup.sh").read_text()).group(1)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_images_pin_torch_and_carry_the_license(name):
    text = (DEPLOY / name).read_text()
    pin = re.search(r"^ARG TORCH_VERSION=(\S+)$", text, re.M)
    assert pin and pin.group(1) == _setup_torch_pin(), "the image's torch is the one the tests use"
    assert '"torch==${TORCH_VERSION}"' in text
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in text


def test_license_everywhere():
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    node = json.loads((REPO / "examples" / "node" / "package.json").read_text())
    assert node["license"] == "Apache-2.0"


def test_make_run_installs_only_the_runtime():
    make = (REPO / "Makefile").read_text()
    assert re.search(r"^run: setup$", make, re.M) and re.search(r"^test: lint$", make, re.M)
    assert re.search(r"^lint: setup-dev$", make, re.M)
    assert re.search(r"^setup:\n\t.*bash scripts/setup.sh$", make, re.M)
    assert re.search(r"^setup-dev:\n\t.*EXTRAS=dev bash scripts/setup.sh$", make, re.M)
    script = (REPO / "scripts" / "setup.sh").read_text()
    assert "[dev]" not in script and "${EXTRAS:+[$EXTRAS]}" in script
    assert re.search(r'if \[ -n "\$EXTRAS" \].*\n\s+scripts/install_kubectl.sh', script)    # test install only
