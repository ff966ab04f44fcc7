"""Offline checks of the Kubernetes manifests (deploy/k8s).

Every kustomization (base and overlays) is rendered with a real kustomize (tests/unit/deploy_render.py
says which binary and where it comes from; without one the tests FAIL), every rendered object is
validated against the Kubernetes OpenAPI schemas in strict mode (``kubernetes-validate``: unknown
fields are errors), and the invariants the services rely on are checked: probes, ports (from
docs/design.md), discovery through headless Services, GPU limits, draining, PodDisruptionBudgets,
/dev/shm, ConfigMap use. NetworkPolicies: test_deploy_network.py; images: test_deploy_images.py.
"""
from __future__ import annotations

import re

import pytest
from deploy_render import (
    COMPONENT,
    DRAIN_GRACE_S,
    EMBEDDED_MODEL_NAMES,
    KUSTOMIZATIONS,
    MIN_K8S_VERSION,
    MIN_STARTUP_BUDGET_S,
    OVERLAYS,
    PART_OF,
    ROLES,
    WORKERS,
    configmap,
    deployments,
    design_ports,
    flag,
    main_container,
    named_port,
    of_kind,
    pod_spec,
    quantity_bytes,
    quantity_cpu,
    render,
    resolved_args,
    selector_matches,
)

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
def test_grpc_probes_on_health_port(renderer, name):
    """Native gRPC probes on the plaintext health-only port (``--health-port``), never on the gRPC
    port, which may speak TLS (the kubelet's probes cannot; test_deploy_tls.py renders TLS on)."""
    objs = render(renderer, name)
    for role, dep in deployments(objs).items():
        for c in pod_spec(dep)["containers"]:
            health_port = named_port(c, "health")
            assert health_port != named_port(c, "grpc")
            assert flag(resolved_args(c, objs), "health-port") == str(health_port)
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                assert probe, f"{role}/{c['name']}: no {kind}"
                assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, \
                    f"{role}: {kind} must be a gRPC probe"
                assert probe["grpc"]["port"] == health_port, \
                    f"{role}: {kind} probes {probe['grpc']['port']}, the health port is {health_port}"
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
        assert named_port(c, "health") == ports[role]["health"]
        assert flag(args, "health-port") == str(ports[role]["health"])
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
    assert parsed.health_port == ports["health"]
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
