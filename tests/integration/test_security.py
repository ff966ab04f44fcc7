"""Router + prefill worker + decode worker as real processes with security on: TLS and bearer
tokens on the router's public port, mutual TLS on every internal port (certificates made here
by a test CA), the KV pair channel's rendezvous guarded by its one-time secret; and hostile
input at the router's door. `pdserve up` in each security mode: test_security_up.py."""
from __future__ import annotations

import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.kv_transfer import KvTransferError, PairChannel
from pdserve.common.security import ClientSecurity, TlsFiles
from pdserve.loadtest.ports import free_port
from pdserve.loadtest.procs import Service
from pdserve.v1 import common_pb2, common_pb2_grpc, router_pb2, router_pb2_grpc
from tests.integration.secure_calls import AUTH, INTERNAL_NAME, TOKEN, code, gen_request, internal_calls, stream
from tests.security_certs import CA


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


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    dep = Secure(tmp_path_factory.mktemp("secure"))
    dep.start()
    try:
        dep.wait()
        yield dep
    finally:
        dep.stop()


def test_public_api_needs_a_token(secure):
    with secure.public_channel() as ch:
        stub = router_pb2_grpc.GenerationStub(ch)
        tokenize = router_pb2.TokenizeRequest(text="Hello there")
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
            # code calls each lambda at once; the default binds this iteration's metadata
            assert code(lambda md=metadata: list(stub.Generate(gen_request(), timeout=30, metadata=md))) \
                == grpc.StatusCode.UNAUTHENTICATED
            assert code(lambda md=metadata: stub.GenerateUnary(gen_request(), timeout=30, metadata=md)) \
                == grpc.StatusCode.UNAUTHENTICATED
            assert code(lambda md=metadata: stub.Tokenize(tokenize, timeout=30, metadata=md)) \
                == grpc.StatusCode.UNAUTHENTICATED
        ids, _ = stream(stub, gen_request())         # through the three services, KV over the pair channel
        assert len(ids) == 8
        assert stub.GenerateUnary(gen_request(), timeout=60, metadata=AUTH).token_ids == ids
        assert stub.Tokenize(tokenize, timeout=30, metadata=AUTH).count > 0
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING      # no token needed


def test_tls_refuses_plaintext_and_other_ca(secure):
    for channel in (grpc.insecure_channel(secure.router), secure.public_channel(ca=secure.other.path)):
        with channel as ch:
            status = code(lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5))
            assert status == grpc.StatusCode.UNAVAILABLE


def test_internal_api_needs_the_deployment_certificate(secure):
    for who in (None, "foreign"):
        with secure.internal_channel(secure.decode, who) as ch:
            assert set(internal_calls(ch).values()) == {grpc.StatusCode.UNAVAILABLE}, who
    with grpc.insecure_channel(secure.decode) as ch:
        assert set(internal_calls(ch).values()) == {grpc.StatusCode.UNAVAILABLE}
    # with the router's certificate the same calls reach the worker's own checks
    with secure.internal_channel(secure.decode, "router") as ch:
        codes = internal_calls(ch)
    assert grpc.StatusCode.UNAVAILABLE not in codes.values() and grpc.StatusCode.UNAUTHENTICATED not in codes.values()
    with secure.internal_channel(secure.prefill, "foreign") as ch:
        info = common_pb2_grpc.InfoServiceStub(ch)
        assert code(lambda: info.Info(common_pb2.InfoRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE


def test_stranger_cannot_join_the_kv_rendezvous(secure):
    with secure.public_channel() as ch:
        stub = router_pb2_grpc.GenerationStub(ch)
        before, _ = stream(stub, gen_request())     # a pair channel exists now
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
        after, _ = stream(stub, gen_request())      # the worker keeps serving
        assert after == before
    assert secure.services["decode"].alive()


def test_hostile_input(secure):
    """A 20 MB prompt is refused before tokenization, in under a second, while 8 streams run."""
    with secure.public_channel() as ch:
        stub = router_pb2_grpc.GenerationStub(ch)
        stream(stub, gen_request(max_tokens=4))        # warm
        with ThreadPoolExecutor(8) as pool:              # the same load without the hostile request
            baseline = max(t for _, t in pool.map(lambda _: stream(stub, gen_request(max_tokens=16)), range(8)))
        huge = gen_request(text="lorem ipsum " * (20 * 1024 * 1024 // 12))
        with ThreadPoolExecutor(9) as pool:
            streams = [pool.submit(stream, stub, gen_request(max_tokens=16)) for _ in range(8)]
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
            list(stub.Generate(gen_request(text="lorem ipsum " * (3 * 1024 * 1024 // 12)), timeout=30,
                               metadata=AUTH))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cannot fit" in e.value.details()
        assert time.monotonic() - t0 < 1.0
        garbage = ch.unary_unary("/pdserve.v1.Generation/GenerateUnary")
        with pytest.raises(grpc.RpcError) as e:
            garbage(b"\x0a\xff\xff\xff\xff\xff", timeout=10, metadata=AUTH)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
