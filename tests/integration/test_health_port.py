"""Probes that work under TLS, on real processes: a router whose public port speaks TLS and a
decode worker (role both, embedded model, CPU) whose internal port wants mutual TLS (as the
router's channel to it), each with ``--health-port``. The kubelet's kind of probe (plaintext grpc.health.v1 Check, as a
``grpc:`` probe sends it) passes on both health ports once they are ready and fails on their
TLS ports; the router still reaches its worker over mutual TLS; after SIGTERM each health port
fails the probe.
"""
from __future__ import annotations

import asyncio

import pytest

from pdserve.common.security import ClientSecurity, TlsFiles
from pdserve.loadtest import procs
from pdserve.loadtest.ports import free_port
from tests.security_certs import CA
from tests.unit.test_health_port import kubelet_probe

STARTUP_S = 240.0


def _probe(port: int) -> bool:
    return asyncio.run(kubelet_probe(f"127.0.0.1:{port}"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = CA.create(d, "deploy")
    return dict(dir=d, ca=ca, server=ca.issue(d, "server"), client=ca.issue(d, "client", stem="client"))


def test_probes_pass_on_the_health_ports_of_tls_services_and_fail_once_stopped(pki):
    (cert, key), (ccert, ckey), ca = pki["server"], pki["client"], str(pki["ca"].path)
    internal = ["--internal-tls-cert", str(cert), "--internal-tls-key", str(key), "--internal-tls-ca", ca]
    mtls = ClientSecurity(tls=TlsFiles(ccert, ckey, pki["ca"].path))
    public = ClientSecurity(tls=TlsFiles(ca=pki["ca"].path))
    ports = {name: free_port() for name in ("worker", "kv", "worker_health", "router", "router_health")}
    worker = procs.Service("decode", procs.worker_cmd(
        "decode", ports["worker"], kv_port=ports["kv"], role="both",
        extra=["--device", "cpu", "--kv-memory-gb", "0.25", *internal, "--health-port", str(ports["worker_health"])]),
        f"127.0.0.1:{ports['worker']}", pki["dir"] / "decode.log", client=mtls)
    router = procs.Service("router", procs.router_cmd(
        ports["router"], model="default", decode=[worker.address],
        extra=["--tls-cert", str(cert), "--tls-key", str(key), *internal,
               "--health-port", str(ports["router_health"])]),
        f"127.0.0.1:{ports['router']}", pki["dir"] / "router.log", client=public)
    services = [worker.start(), router.start()]
    try:
        procs.wait_started(services, router.address, 1, 1, STARTUP_S, security=public)   # worker seen over mTLS
        assert _probe(ports["worker_health"]) and _probe(ports["router_health"])
        assert not _probe(ports["worker"]) and not _probe(ports["router"])      # plaintext to a TLS port
        worker.stop()
        assert not _probe(ports["worker_health"])
        assert _probe(ports["router_health"])          # the router's health does not depend on its workers
        router.stop()
        assert not _probe(ports["router_health"])
    finally:
        procs.stop_all(services)
