"""Offline checks of the monitoring parts of deploy/: the PodMonitor component and the Grafana
dashboard (deploy/grafana/pdserve.json).

Each overlay is rendered with the component (``components: [.../components/monitoring]``, as
docs/deploy.md says) by the same kustomize as the other deploy tests (tests/unit/deploy_render.py); everything but the
PodMonitor is validated strictly against the Kubernetes schemas, and the PodMonitor (a custom
resource) against what the Prometheus Operator reads: its selector picks every pdserve pod and
each of them has the named port it scrapes, the metrics port of docs/design.md. Every series the
dashboard queries is one the services export (read from their own metric registries).
"""
from __future__ import annotations

import json
import re

import pytest
from deploy_render import (
    DEPLOY,
    K8S,
    MIN_K8S_VERSION,
    OVERLAYS,
    deployments,
    design_ports,
    main_container,
    named_port,
    pod_spec,
    render_with_component,
    selector_matches,
)

COMPONENT = K8S / "components" / "monitoring"
DASHBOARD = DEPLOY / "grafana" / "pdserve.json"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """{overlay: objects} rendered with the monitoring component."""
    return render_with_component(COMPONENT, tmp_path_factory)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_podmonitor_scrapes_every_pod_on_its_metrics_port(rendered, overlay):
    objs = rendered[overlay]
    monitors = [o for o in objs if o["kind"] == "PodMonitor"]
    assert len(monitors) == 1 and monitors[0]["apiVersion"] == "monitoring.coreos.com/v1"
    spec = monitors[0]["spec"]
    assert set(spec) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels"}
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    ports = design_ports()
    for role, dep in deployments(objs).items():
        assert selector_matches(spec["selector"], dep["spec"]["template"]["metadata"]["labels"]), role
        assert pod_spec(dep)["containers"], role
        assert named_port(main_container(dep), endpoint["port"]) == ports[role]["metrics"], role


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_everything_else_is_schema_valid(rendered, overlay):
    import kubernetes_validate
    others = [o for o in rendered[overlay] if o["kind"] != "PodMonitor"]
    assert others
    for obj in others:
        kubernetes_validate.validate(obj, MIN_K8S_VERSION, strict=True)


def _exported_series() -> set[str]:
    """Sample names the router and a worker can export (histogram/counter suffixes included)."""
    from pdserve.common.serving.metrics import WorkerMetrics
    from pdserve.router.metrics import RouterMetrics
    worker = WorkerMetrics("decode")
    worker.stats_source = lambda: {"num_total_blocks": 1}
    names: set[str] = set()
    for registry in (worker.registry, RouterMetrics().registry):
        for family in registry.collect():
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
            names.update(family.name + s for s in suffixes)
    return names


def test_dashboard_queries_only_exported_series():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and "datasource" in {v["name"] for v in dash["templating"]["list"]}
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    used = {m for e in exprs for m in re.findall(r"\bpdserve[a-z0-9_:]*", e)}
    exported = _exported_series()
    assert used and used <= exported, sorted(used - exported)
    for wanted in ("pdserve:kv_cache_usage_perc", "pdserve:num_requests_running", "pdserve:num_requests_waiting",
                   "pdserve:prefix_cache_hits_total", "pdserve:num_preemptions_total",
                   "pdserve:engine_step_duration_seconds_bucket", "pdserve:kv_transfer_size_bytes_sum",
                   "pdserve_router_time_to_first_token_seconds_bucket",
                   "pdserve_router_inter_token_latency_seconds_bucket"):
        assert wanted in used, wanted
