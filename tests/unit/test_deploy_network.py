"""NetworkPolicies of the rendered manifests (deploy/k8s): who may reach each port — worker gRPC
only from its callers, KV transfer only within the deployment, the router as the only entry, and
default deny (rendering: tests/unit/deploy_render.py).
"""
from __future__ import annotations

import pytest
from deploy_render import (
    GRPC_CALLERS,
    KUSTOMIZATIONS,
    ROLES,
    WORKERS,
    deployments,
    design_ports,
    main_container,
    of_kind,
    render,
    selector_matches,
)

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


def _rendered(renderer, name) -> tuple[list[dict], dict, dict, dict]:
    """(objects, Deployments by role, design ports, traffic sources) of one kustomization."""
    objs = render(renderer, name)
    deps = deployments(objs)
    return objs, deps, design_ports(), _sources(deps)


def _pod(deps: dict, role: str) -> tuple[dict, dict]:
    """(pod labels, main container) of ``role``'s Deployment."""
    return deps[role]["spec"]["template"]["metadata"]["labels"], main_container(deps[role])


# ports NCCL/Gloo may pick: low, the Linux ephemeral range 32768-60999, and around our own ports
EPHEMERAL_SAMPLES = (1024, 29500, 32768, 40000, 50055, 55555, 60999, 65535)


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_network_policy_worker_grpc_only_from_callers(renderer, name):
    """Prefill gRPC: router pods only. Decode gRPC: router and prefill pods only."""
    objs, deps, ports, srcs = _rendered(renderer, name)
    for role in WORKERS:
        labels, c = _pod(deps, role)
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
    objs, deps, ports, srcs = _rendered(renderer, name)
    decode_labels, decode_c = _pod(deps, "decode")
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
    objs, deps, ports, srcs = _rendered(renderer, name)
    router_labels, router_c = _pod(deps, "router")
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
