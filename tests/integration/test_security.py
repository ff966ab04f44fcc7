"""Router + prefill worker + decode worker as real processes with security on: TLS and bearer
tokens on the router's public port, mutual TLS on every internal port (certificates made here
by a test CA), the KV pair channel's rendezvous guarded by its one-time secret; and hostile
input at the router's door. Then `pdserve up` in each security mode (its default per-deployment
token, a given token, mutual TLS, both), and services started one by one with a token."""
from __future__ import annotations

import contextlib
import re
import socket
import stat
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.kv_transfer import KvTransferError, PairChannel
from pdserve.common.security import ClientSecurity, TlsFiles
from pdserve.loadtest import procs
from pdserve.loadtest.ports import free_port, free_port_range
from pdserve.loadtest.procs import Service
from pdserve.v1 import common_pb2, common_pb2_grpc, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.security_certs import CA

TOKEN = "s3cret-public-token"
INTERNAL_NAME = "pdserve-internal"
PROMPT = [1, 504, 3458, 282, 4649, 314, 7042, 30, 2]


class Secure:
    def __init__(self, d):
        self.dir = d
        self.ca, self.other = CA.create(d, "deploy"), CA.create(d, "stranger")
        self.public = self.ca.issue(d, "router-public", stem="public")
        self.internal = {n: self.ca.issue(d, n, dns=(INTERNAL_NAME,), ips=(), stem=n)
                         for n in ("router", "prefill", "decode")}
        self.foreign = self.other.issue(d, "router", dns=(INTERNAL_NAME,), ips=(), stem="foreign")
        self.tokens = d / "tokens"
        self.tokens.write_text(TOKEN + "\n")
        self.services: dict[str, Service] = {}
        self.router = self.decode = self.prefill = ""
        self.kv_port = 0

    def internal_env(self, name: str) -> dict[str, str]:
        cert, key = self.internal[name]
        return {"PDSERVE_INTERNAL_TLS_CERT": str(cert), "PDSERVE_INTERNAL_TLS_KEY": str(key),
                "PDSERVE_INTERNAL_TLS_CA": str(self.ca.path), "PDSERVE_INTERNAL_TLS_SERVER_NAME": INTERNAL_NAME,
                "PDSERVE_LOG_LEVEL": "INFO"}

    def start(self) -> None:
        cmd = [sys.executable, "-m", "pdserve.cli"]
        common = ["--host", "127.0.0.1", "--metrics-port", "0", "--device", "cpu", "--kv-memory-gb", "0.25"]
        self.decode, self.prefill, self.router = (f"127.0.0.1:{free_port()}" for _ in range(3))
        self.kv_port = free_port()
        specs = {
            "decode": (["decode", *common, "--port", self.decode.split(":")[1], "--kv-port", str(self.kv_port)],
                       self.decode),
            "prefill": (["prefill", *common, "--port", self.prefill.split(":")[1]], self.prefill),
            "router": (["router", "--host", "127.0.0.1", "--port", self.router.split(":")[1], "--metrics-port", "0",
                        "--decode", self.decode, "--prefill", self.prefill, "--tls-cert", str(self.public[0]),
                        "--tls-key", str(self.public[1]), "--auth-tokens-file", str(self.tokens),
                        "--reflection", "off",
                        # bursts of 8 streams on a loaded 2-core CI machine: not an admission test
                        "--admission-slo-multiple", "0"], self.router),
        }
        for name, (args, address) in specs.items():
            self.services[name] = Service(name, cmd + args, address, self.dir / f"{name}.log",
                                          self.internal_env(name)).start()

    # ---- clients -------------------------------------------------------------------------
    def public_channel(self, ca=None) -> grpc.Channel:
        creds = ClientSecurity(tls=TlsFiles(ca=ca or self.ca.path)).channel_credentials()
        return grpc.secure_channel(self.router, creds)

    def internal_channel(self, address: str, who: str | None = "router") -> grpc.Channel:
        """``who``: whose certificate to present (``None``: none; ``foreign``: another CA's)."""
        if who is None:
            tls = TlsFiles(ca=self.ca.path)
        else:
            cert, key = self.foreign if who == "foreign" else self.internal[who]
            tls = TlsFiles(cert, key, self.ca.path)
        sec = ClientSecurity(tls=tls, server_name=INTERNAL_NAME)
        return grpc.secure_channel(address, sec.channel_credentials(), options=sec.options())

    def wait(self, timeout: float = 240.0) -> None:
        end = time.monotonic() + timeout
        with self.public_channel() as ch:
            stub = router_pb2_grpc.GenerationStub(ch)
            while time.monotonic() < end:
                for svc in self.services.values():
                    if not svc.alive():
                        raise RuntimeError(f"{svc.name} exited:\n{svc.log_tail(30)}")
                try:
                    info = stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=2,
                                             metadata=AUTH)
                    if info.num_prefill_workers >= 1 and info.num_decode_workers >= 1:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError("secure deployment not up:\n" + "\n".join(s.log_tail(15) for s in self.services.values()))

    def stop(self) -> None:
        for svc in reversed(list(self.services.values())):
            svc.stop()


AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    dep = Secure(tmp_path_factory.mktemp("secure"))
    dep.start()
    try:
        dep.wait()
        yield dep
    finally:
        dep.stop()


def _gen_request(text: str | None = None, max_tokens: int = 8) -> router_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens)
    if text is not None:
        return router_pb2.GenerateRequest(text=text, params=params)
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=PROMPT), params=params)


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def _stream(stub, request, metadata=AUTH) -> tuple[list[int], float]:
    """(token ids, TTFT in seconds) of one streamed request."""
    t0, ttft, ids = time.monotonic(), None, []
    for msg in stub.Generate(request, timeout=120, metadata=metadata):
        if ttft is None and msg.token_ids:
            ttft = time.monotonic() - t0
        ids.extend(msg.token_ids)
    return ids, ttft if ttft is not None else float("inf")


def test_public_api_needs_a_token(secure):
    with secure.public_channel() as ch:
        stub = router_pb2_grpc.GenerationStub(ch)
        tokenize = router_pb2.TokenizeRequest(text="Hello there")
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
            # _code calls each lambda at once; the default binds this iteration's metadata
            assert _code(lambda md=metadata: list(stub.Generate(_gen_request(), timeout=30, metadata=md))) \
                == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda md=metadata: stub.GenerateUnary(_gen_request(), timeout=30, metadata=md)) \
                == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda md=metadata: stub.Tokenize(tokenize, timeout=30, metadata=md)) \
                == grpc.StatusCode.UNAUTHENTICATED
        ids, _ = _stream(stub, _gen_request())         # through the three services, KV over the pair channel
        assert len(ids) == 8
        assert stub.GenerateUnary(_gen_request(), timeout=60, metadata=AUTH).token_ids == ids
        assert stub.Tokenize(tokenize, timeout=30, metadata=AUTH).count > 0
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING      # no token needed


def test_tls_refuses_plaintext_and_other_ca(secure):
    for channel in (grpc.insecure_channel(secure.router), secure.public_channel(ca=secure.other.path)):
        with channel as ch:
            code = _code(lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5))
            assert code == grpc.StatusCode.UNAVAILABLE


def _internal_calls(ch: grpc.Channel) -> dict[str, grpc.StatusCode]:
    stub = worker_pb2_grpc.WorkerStub(ch)
    return {
        "Reserve": _code(lambda: stub.Reserve(worker_pb2.ReserveRequest(request_id="x", router_id="stranger",
                                                                        token_ids=PROMPT), timeout=5)),
        "PushKV": _code(lambda: stub.PushKV(worker_pb2.PushKVRequest(request_id="x", prefill_worker_id="p"),
                                            timeout=5)),
        "Submit": _code(lambda: stub.Submit(worker_pb2.SubmitRequest(request_id="x", router_id="stranger"),
                                            timeout=5)),
        "Subscribe": _code(lambda: next(iter(stub.Subscribe(worker_pb2.SubscribeRequest(router_id="stranger"),
                                                             timeout=2)))),
    }


def test_internal_api_needs_the_deployment_certificate(secure):
    for who in (None, "foreign"):
        with secure.internal_channel(secure.decode, who) as ch:
            assert set(_internal_calls(ch).values()) == {grpc.StatusCode.UNAVAILABLE}, who
    with grpc.insecure_channel(secure.decode) as ch:
        assert set(_internal_calls(ch).values()) == {grpc.StatusCode.UNAVAILABLE}
    # with the router's certificate the same calls reach the worker's own checks
    with secure.internal_channel(secure.decode, "router") as ch:
        codes = _internal_calls(ch)
    assert grpc.StatusCode.UNAVAILABLE not in codes.values() and grpc.StatusCode.UNAUTHENTICATED not in codes.values()
    with secure.internal_channel(secure.prefill, "foreign") as ch:
        info = common_pb2_grpc.InfoServiceStub(ch)
        assert _code(lambda: info.Info(common_pb2.InfoRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE


def test_stranger_cannot_join_the_kv_rendezvous(secure):
    with secure.public_channel() as ch:
        stub = router_pb2_grpc.GenerationStub(ch)
        before, _ = _stream(stub, _gen_request())     # a pair channel exists now
        ids = {}
        for name, address in (("decode", secure.decode), ("prefill", secure.prefill)):
            with secure.internal_channel(address) as ich:   # the ids, as if leaked
                ids[name] = common_pb2_grpc.InfoServiceStub(ich).Info(common_pb2.InfoRequest(), timeout=5).worker_id
        store = f"127.0.0.1:{secure.kv_port}"
        t0 = time.time_ns() // 1000
        for epoch in (t0, t0 + 1):   # epochs near the sender's: what a stranger would guess
            with pytest.raises(KvTransferError):
                PairChannel(store, ids["prefill"], ids["decode"], epoch, 0, "cpu", timeout=1.0)
        with socket.create_connection(("127.0.0.1", secure.kv_port), timeout=5) as raw:
            raw.sendall(b"\x00garbage\xff" * 64)     # not the store protocol
        after, _ = _stream(stub, _gen_request())      # the worker keeps serving
        assert after == before
    assert secure.services["decode"].alive()


def test_hostile_input(secure):
    """A 20 MB prompt is refused before tokenization, in under a second, while 8 streams run."""
    with secure.public_channel() as ch:
        stub = router_pb2_grpc.GenerationStub(ch)
        _stream(stub, _gen_request(max_tokens=4))        # warm
        with ThreadPoolExecutor(8) as pool:              # the same load without the hostile request
            baseline = max(t for _, t in pool.map(lambda _: _stream(stub, _gen_request(max_tokens=16)), range(8)))
        huge = _gen_request(text="lorem ipsum " * (20 * 1024 * 1024 // 12))
        with ThreadPoolExecutor(9) as pool:
            streams = [pool.submit(_stream, stub, _gen_request(max_tokens=16)) for _ in range(8)]
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                stub.GenerateUnary(huge, timeout=30, metadata=AUTH)
            refused_s = time.monotonic() - t0
            results = [f.result(timeout=120) for f in streams]
        # over the public port's message limit (derived from the context): refused by its length
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in e.value.details()
        assert refused_s < 1.0, refused_s
        assert all(len(ids) == 16 for ids, _ in results)
        ttfts = sorted(t for _, t in results)
        print(f"TTFT of 8 streams: {baseline:.3f} s max alone, {ttfts[-1]:.3f} s max beside the 20 MB prompt "
              f"(refused in {refused_s:.3f} s)")
        assert ttfts[-1] - baseline < 1.0, (baseline, ttfts)     # no spike from the hostile request
        # under the message limit but more characters than the context can hold: not tokenized
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(_gen_request(text="lorem ipsum " * (3 * 1024 * 1024 // 12)), timeout=30,
                               metadata=AUTH))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cannot fit" in e.value.details()
        assert time.monotonic() - t0 < 1.0
        garbage = ch.unary_unary("/pdserve.v1.Generation/GenerateUnary")
        with pytest.raises(grpc.RpcError) as e:
            garbage(b"\x0a\xff\xff\xff\xff\xff", timeout=10, metadata=AUTH)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---- pdserve up: one deployment per security mode ------------------------------------------

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
            ids, _ = _stream(stub, _gen_request(max_tokens=4), metadata=public)
            assert len(ids) == 4
            if public:
                assert _code(lambda: list(stub.Generate(_gen_request(), timeout=30))) \
                    == grpc.StatusCode.UNAUTHENTICATED
        log = svc.log_path.read_text()
        assert not [w for w in HANDSHAKE_NOISE if w in log], log
        token_file = _check_generated_token(svc, log) if mode == "default" else None
        tls = mode in ("mtls", "both")
        stranger = grpc.StatusCode.UNAVAILABLE if tls else grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(decode) as ch:
            assert set(_internal_calls(ch).values()) == {stranger}, mode
            stats = worker_pb2_grpc.WorkerStub(ch).GetStats
            assert _code(lambda: stats(worker_pb2.GetStatsRequest(), timeout=5)) == stranger
        if tls:
            for identity in (None, up_pki["foreign"]):
                with _tls_channel(decode, up_pki, identity) as ch:
                    assert set(_internal_calls(ch).values()) == {grpc.StatusCode.UNAVAILABLE}
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
            ids, _ = _stream(router_pb2_grpc.GenerationStub(ch), _gen_request(max_tokens=4), metadata=())
        assert len(ids) == 4
        with grpc.insecure_channel(f"127.0.0.1:{decode}") as ch:
            assert set(_internal_calls(ch).values()) == {grpc.StatusCode.UNAUTHENTICATED}
        _not_refused(tmp_path / "router.log")
    finally:
        procs.stop_all(services)
