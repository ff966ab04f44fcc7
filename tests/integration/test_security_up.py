"""`pdserve up` (1 prefill + 1 decode worker, CPU) in each security mode: its default
per-deployment token, a given token, mutual TLS, both; and router, prefill and decode worker
started one by one with an internal token."""
from __future__ import annotations

import contextlib
import re
import stat
import time
from pathlib import Path

import grpc
import pytest

from pdserve.common.security import ClientSecurity, TlsFiles
from pdserve.loadtest import procs
from pdserve.loadtest.ports import free_port, free_port_range
from pdserve.loadtest.procs import Service
from pdserve.v1 import router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.secure_calls import AUTH, INTERNAL_NAME, TOKEN, code, gen_request, internal_calls, stream
from tests.security_certs import CA

UP_STARTUP_S = 300
HANDSHAKE_NOISE = ("WRONG_VERSION_NUMBER", "Handshake failed")


@pytest.fixture(scope="module")
def up_pki(tmp_path_factory):
    """One internal certificate for every service of a `pdserve up` deployment (SANs: 127.0.0.1,
    localhost and the internal name), and a stranger's certificate of another CA."""
    d = tmp_path_factory.mktemp("up-pki")
    ca, other = CA.create(d, "up-deploy"), CA.create(d, "up-stranger")
    internal = ca.issue(d, "pdserve-up", dns=(INTERNAL_NAME, "localhost"), ips=("127.0.0.1",), stem="internal")
    foreign = other.issue(d, "pdserve-up", dns=(INTERNAL_NAME, "localhost"), ips=("127.0.0.1",), stem="foreign")
    tokens, public = d / "internal-token", d / "public-tokens"
    tokens.write_text("up-internal-token\n")
    public.write_text(TOKEN + "\n")
    return dict(dir=d, ca=ca, internal=internal, foreign=foreign, tokens=tokens, public=public)


def _up_args(mode: str, pki: dict) -> list[str]:
    """`pdserve up`'s security flags of ``mode``."""
    cert, key = pki["internal"]
    tls = ["--internal-tls-cert", str(cert), "--internal-tls-key", str(key), "--internal-tls-ca", str(pki["ca"].path)]
    token = ["--internal-token-file", str(pki["tokens"])]
    return {"default": [], "token": token, "mtls": tls,
            "both": [*token, *tls, "--internal-tls-server-name", INTERNAL_NAME,
                     "--auth-tokens-file", str(pki["public"])]}[mode]


def _start_up(log_dir, mode: str, args: list[str]) -> tuple[Service, str, int]:
    """`pdserve up` (1 prefill + 1 decode, CPU) until it says every service is SERVING (its own
    readiness calls, with the deployment's credentials): (service, router address, decode port)."""
    router, base = free_port(), free_port_range(4)
    svc = procs.pdserve_up(router, base, ["--num-kv-blocks", "256", *args], log_dir=log_dir, name=mode).start()
    deadline = time.monotonic() + UP_STARTUP_S
    while "all services are SERVING" not in svc.log_path.read_text():
        if not svc.alive() or time.monotonic() > deadline:
            svc.stop()
            raise RuntimeError(f"pdserve up ({mode}) did not start:\n{svc.log_tail(40)}")
        time.sleep(0.3)
    return svc, f"127.0.0.1:{router}", base


def _tls_channel(address: str, pki: dict, identity: tuple | None) -> grpc.Channel:
    cert, key = identity or (None, None)
    sec = ClientSecurity(tls=TlsFiles(cert, key, pki["ca"].path), server_name=INTERNAL_NAME)
    return grpc.secure_channel(address, sec.channel_credentials(), options=sec.options())


def _generated_token_file(log: str) -> Path:
    m = re.search(r"internal API: the token in (\S+)", log)
    assert m, log
    return Path(m.group(1))


def _check_generated_token(svc: Service, log: str) -> Path:
    """The per-deployment token: in a 0600 file of a 0700 directory, on no command line."""
    path = _generated_token_file(log)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    token = path.read_text().strip()
    assert len(token) >= 32
    for pid in svc.tree_pids():
        with contextlib.suppress(OSError):
            assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    return path


@pytest.mark.parametrize("mode", ["default", "token", "mtls", "both"])
def test_up_security_modes(up_pki, tmp_path, mode):
    """Each mode serves Generate (prefill -> decode over the internal API, with its credentials)
    with no plaintext probe of a TLS port in any log; a stranger gets UNAUTHENTICATED (token
    modes, the default's token made by up) or no TLS handshake (mTLS modes) on the decode
    worker's port; the deployment's own credentials reach the worker's checks."""
    svc, router, decode_port = _start_up(tmp_path, mode, _up_args(mode, up_pki))
    decode = f"127.0.0.1:{decode_port}"
    public = AUTH if mode == "both" else ()
    token_file = None
    try:
        with grpc.insecure_channel(router) as ch:
            stub = router_pb2_grpc.GenerationStub(ch)
            ids, _ = stream(stub, gen_request(max_tokens=4), metadata=public)
            assert len(ids) == 4
            if public:
                assert code(lambda: list(stub.Generate(gen_request(), timeout=30))) \
                    == grpc.StatusCode.UNAUTHENTICATED
        log = svc.log_path.read_text()
        assert not [w for w in HANDSHAKE_NOISE if w in log], log
        token_file = _check_generated_token(svc, log) if mode == "default" else None
        tls = mode in ("mtls", "both")
        stranger = grpc.StatusCode.UNAVAILABLE if tls else grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(decode) as ch:
            assert set(internal_calls(ch).values()) == {stranger}, mode
            stats = worker_pb2_grpc.WorkerStub(ch).GetStats
            assert code(lambda: stats(worker_pb2.GetStatsRequest(), timeout=5)) == stranger
        if tls:
            for identity in (None, up_pki["foreign"]):
                with _tls_channel(decode, up_pki, identity) as ch:
                    assert set(internal_calls(ch).values()) == {grpc.StatusCode.UNAVAILABLE}
            with _tls_channel(decode, up_pki, up_pki["internal"]) as ch:
                stats = worker_pb2_grpc.WorkerStub(ch).GetStats
                assert stats(worker_pb2.GetStatsRequest(), timeout=5).num_total_blocks == 256
        own_token = token_file.read_text().strip() if token_file else "up-internal-token" if mode == "token" else ""
        if own_token:           # the token up made (default) or was given
            token = (("authorization", f"Bearer {own_token}"),)
            with grpc.insecure_channel(decode) as ch:
                stats = worker_pb2_grpc.WorkerStub(ch).GetStats
                assert stats(worker_pb2.GetStatsRequest(), timeout=5, metadata=token).num_total_blocks == 256
    finally:
        svc.stop()
    assert svc.proc.returncode == 0, svc.log_tail(30)
    if token_file is not None:
        assert not token_file.parent.exists()       # removed at exit


def _not_refused(log: Path) -> None:
    """The router's calls to workers were never refused (e.g. its Subscribe sent without the token)."""
    text = log.read_text()
    assert "UNAUTHENTICATED" not in text, text


def test_services_started_one_by_one_with_an_internal_token(tmp_path):
    """Router, prefill and decode worker started by hand, each with --internal-token-file: the
    router's Subscribe / StreamKvEvents / Prefill and the prefill worker's PushKV carry the token,
    so a request is served; a caller without it is refused."""
    token_file = tmp_path / "internal-token"
    token_file.write_text("by-hand-token\n")
    token = ["--internal-token-file", str(token_file)]
    common = ["--model", "default", "--device", "cpu", "--num-kv-blocks", "256", *token]
    decode, prefill, router = free_port(), free_port(), free_port()
    services = [
        Service("decode", procs.worker_cmd("decode", decode, kv_port=free_port(), extra=common),
                f"127.0.0.1:{decode}", tmp_path / "decode.log"),
        Service("prefill", procs.worker_cmd("prefill", prefill, extra=common), f"127.0.0.1:{prefill}",
                tmp_path / "prefill.log"),
        Service("router", procs.router_cmd(router, model="default", decode=[f"127.0.0.1:{decode}"],
                                           prefill=[f"127.0.0.1:{prefill}"], extra=["--http-port", "0", *token]),
                f"127.0.0.1:{router}", tmp_path / "router.log"),
    ]
    for svc in services:
        svc.start()
    try:
        procs.wait_ready(services, UP_STARTUP_S)        # models loaded
        procs.wait_workers(f"127.0.0.1:{router}", 1, 1, 60, check=lambda: _not_refused(tmp_path / "router.log"))
        with grpc.insecure_channel(f"127.0.0.1:{router}") as ch:
            ids, _ = stream(router_pb2_grpc.GenerationStub(ch), gen_request(max_tokens=4), metadata=())
        assert len(ids) == 4
        with grpc.insecure_channel(f"127.0.0.1:{decode}") as ch:
            assert set(internal_calls(ch).values()) == {grpc.StatusCode.UNAUTHENTICATED}
        _not_refused(tmp_path / "router.log")
    finally:
        procs.stop_all(services)
