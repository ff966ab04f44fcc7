"""The manifests with TLS on (deploy/k8s/components/tls): each overlay rendered with the
component, as docs/deploy.md says to turn TLS on, by the same kustomize as the other deploy tests
(tests/unit/deploy_render.py), every object validated strictly against the Kubernetes schemas.

With TLS on, the probes are unchanged and still work: native gRPC probes on each pod's plaintext
health port (``--health-port``, grpc.health.v1 only), never on the gRPC port that now speaks TLS
(the kubelet's probes cannot). Each service gets the TLS settings its real flag parser reads
(the router the public and internal ones, the workers the internal ones), every certificate
path is a file of the right Secret's volume, and the router's Service no longer claims
cleartext HTTP/2 for its gRPC port.
"""
from __future__ import annotations

import argparse

import pytest
from deploy_render import (
    K8S,
    MIN_K8S_VERSION,
    OVERLAYS,
    ROLES,
    by_name,
    container_env,
    deployments,
    design_ports,
    flag,
    main_container,
    named_port,
    pod_spec,
    render_with_component,
    resolved_args,
)

COMPONENT = K8S / "components" / "tls"
INTERNAL = ("PDSERVE_INTERNAL_TLS_CERT", "PDSERVE_INTERNAL_TLS_KEY", "PDSERVE_INTERNAL_TLS_CA")
PUBLIC = ("PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY")
SECRETS = {"PDSERVE_INTERNAL": "pdserve-internal-tls", "PDSERVE_TLS": "pdserve-public-tls"}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """{overlay: objects} rendered with the TLS component."""
    return render_with_component(COMPONENT, tmp_path_factory)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_schema_strict_with_tls(rendered, overlay):
    import kubernetes_validate
    for obj in rendered[overlay]:
        kubernetes_validate.validate(obj, MIN_K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_use_the_plaintext_health_port_with_tls_on(rendered, overlay):
    objs = rendered[overlay]
    ports = design_ports()
    for role, dep in deployments(objs).items():
        c = main_container(dep)
        health = named_port(c, "health")
        assert health == ports[role]["health"] and health != named_port(c, "grpc")
        assert flag(resolved_args(c, objs), "health-port") == str(health)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c[kind]
            assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, f"{role}: {kind}"
            assert probe["grpc"]["port"] == health and probe["grpc"].get("service", "") == "", f"{role}: {kind}"


def _secret_of(dep: dict, container: dict, path: str) -> str | None:
    """The Secret whose volume holds ``path`` in ``container`` (None: no Secret volume does)."""
    volumes = {v["name"]: v for v in pod_spec(dep).get("volumes", [])}
    for m in container.get("volumeMounts", []):
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            secret = volumes[m["name"]].get("secret")
            return secret["secretName"] if secret else None
    return None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_gets_its_certificates_from_the_secrets(rendered, overlay):
    objs = rendered[overlay]
    for role, dep in deployments(objs).items():
        c = main_container(dep)
        env = container_env(c, objs)
        wanted = INTERNAL + (PUBLIC if role == "router" else ())
        for name in wanted:
            assert name in env, f"{role}: {name} not set"
            secret = SECRETS["PDSERVE_INTERNAL" if name.startswith("PDSERVE_INTERNAL") else "PDSERVE_TLS"]
            assert _secret_of(dep, c, env[name]) == secret, f"{role}: {name}={env[name]} is not in {secret}"
        if role != "router":
            assert not set(PUBLIC) & set(env), f"{role}: public TLS is the router's"
        assert env["PDSERVE_INTERNAL_TLS_SERVER_NAME"] == "pdserve-internal"
        for m in c["volumeMounts"]:
            if m["name"].endswith("-tls"):
                assert m.get("readOnly"), f"{role}: {m['name']} mounted writable"


# the module behind each `pdserve <role>` subcommand (pdserve/cli/__init__.py SUBCOMMANDS)
ROLE_MODULES = {"router": "pdserve.router.main", "prefill": "pdserve.prefill_worker.main",
                "decode": "pdserve.decode_worker.main"}


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory):
    """The two Secrets' files as the pods see them under /etc/pdserve, made here (real certificates)."""
    import shutil

    from tests.security_certs import CA
    root = tmp_path_factory.mktemp("etc-pdserve")
    ca = CA.create(root, "deploy")
    for sub, cn in (("internal", "pdserve-internal"), ("public", "pdserve.example.com")):
        (root / sub).mkdir()
        cert, key = ca.issue(root, cn, dns=(cn,), stem=sub)
        shutil.copy(cert, root / sub / "tls.crt")
        shutil.copy(key, root / sub / "tls.key")
        shutil.copy(ca.path, root / sub / "ca.crt")
    return root


@pytest.mark.parametrize("role", ROLES)
def test_the_real_parsers_turn_tls_on_and_keep_the_health_port(rendered, role, secrets_dir, monkeypatch):
    """The container's environment and args, as the kubelet builds them (the Secrets' files
    under a local directory instead of /etc/pdserve), through `pdserve <role>`'s parser and its
    security settings: TLS on the gRPC port, the plaintext health port beside it."""
    import importlib

    from pdserve.common.security.args import internal_server_security, public_server_security
    objs = rendered["gpu"]
    c = main_container(deployments(objs)[role])
    for k, v in container_env(c, objs).items():
        if k.startswith("PDSERVE_"):
            monkeypatch.setenv(k, v.replace("/etc/pdserve/", f"{secrets_dir}/"))
    args = [a.replace("<status.podIP>", "10.0.0.7").replace("<metadata.namespace>", "serving")
            for a in resolved_args(c, objs)]
    parser = argparse.ArgumentParser(prog="pdserve")
    importlib.import_module(ROLE_MODULES[role]).add_arguments(parser.add_subparsers().add_parser(role))
    parsed = parser.parse_args(args)
    security = public_server_security(parsed) if role == "router" else internal_server_security(parsed)
    assert security.tls is not None, f"{role}: its gRPC port is not TLS"
    assert security.require_client_cert == (role != "router")      # workers: mutual TLS
    assert security.health_port == design_ports()[role]["health"]
    if role == "router":                                            # and its channels to the workers
        assert internal_server_security(parsed).tls is not None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_service_does_not_claim_cleartext(rendered, overlay):
    svc = by_name(rendered[overlay], "Service", "pdserve-router")
    protocols = {p["name"]: p.get("appProtocol") for p in svc["spec"]["ports"]}
    assert protocols["grpc"] != "kubernetes.io/h2c" and protocols["http"] == "https", protocols
