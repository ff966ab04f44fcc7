"""Router + workers as separate processes on loopback (CPU or GPUs), and what tests and checks
ask of them over gRPC: the topologies of the lab and the tests. Starting, waiting for and
stopping the processes is ``pdserve.loadtest.procs``'s (the launcher ``pdserve up`` uses too).

Used by the integration tests and by the GPU disaggregation check (bench/disagg_gpu.py).
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.loadtest import procs
from pdserve.loadtest.ports import free_port, free_port_range
from pdserve.loadtest.procs import Service
from pdserve.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc


@dataclass
class Deployment:
    router: str
    decode: list[str]
    prefill: list[str]
    services: dict[str, Service] = field(default_factory=dict)
    log_dir: Path | None = None
    http: str | None = None           # the router's OpenAI HTTP API, e.g. http://127.0.0.1:8000/v1
    metrics: dict[str, str] = field(default_factory=dict)   # service name -> host:port of its /metrics
    internal_token: str = ""          # the workers' internal token (start_up's), sent by stats()

    def scrape(self, name: str) -> str:
        """The text of service ``name``'s /metrics (started with ``metrics=True``)."""
        import urllib.request
        with urllib.request.urlopen(f"http://{self.metrics[name]}/metrics", timeout=10) as r:
            return r.read().decode()

    def router_stub(self) -> router_pb2_grpc.GenerationStub:
        return router_pb2_grpc.GenerationStub(grpc.insecure_channel(self.router))

    def cancel_after_tokens(self, request: router_pb2.GenerateRequest, n: int = 3, timeout: float = 120.0) -> int:
        """Stream ``request`` through the router and cancel it once ``n`` tokens came; the tokens seen."""
        call = self.router_stub().Generate(request, timeout=timeout)
        got = 0
        for msg in call:
            got += len(msg.token_ids)
            if got >= n:
                call.cancel()
                break
        return got

    def stats(self, address: str) -> worker_pb2.WorkerStats:
        metadata = (("authorization", f"Bearer {self.internal_token}"),) if self.internal_token else ()
        with grpc.insecure_channel(address) as ch:
            return worker_pb2_grpc.WorkerStub(ch).GetStats(worker_pb2.GetStatsRequest(), timeout=10,
                                                           metadata=metadata)

    def wait_whole(self, address: str, tries: int = 100) -> worker_pb2.WorkerStats:
        """Poll GetStats (bounded) until no block is referenced and nothing is in flight."""
        for _ in range(tries):
            s = self.stats(address)
            if (s.num_used_blocks == 0 and s.num_free_blocks == s.num_total_blocks and s.num_running == 0
                    and s.num_waiting == 0 and s.num_reserved == 0):
                return s
            time.sleep(0.1)
        raise AssertionError(f"{address} did not release its blocks: {s}")

    def kill(self, name: str) -> None:
        """SIGKILL one process (a crash), and reap it."""
        proc = self.services[name].proc
        proc.kill()
        proc.wait(30)

    def restart(self, name: str) -> None:
        """Start process ``name`` again with the same command (a new worker id)."""
        old = self.services[name]
        log = old.log_path.with_name(old.log_path.stem + "-restarted.log") if old.log_path else None
        self.services[name] = Service(old.name, old.cmd, old.address, log, dict(old.extra_env)).start()

    def logs(self) -> dict[str, Path]:
        return {name: svc.log_path for name, svc in self.services.items() if svc.log_path}

    def stop(self) -> None:
        """The router first, then the workers together (``pdserve.loadtest.procs.stop_all``)."""
        procs.stop_all(list(self.services.values()))


def _start(dep: Deployment, name: str, cmd: list[str], address: str, gpu: str | None = None) -> None:
    extra = {"PDSERVE_LOG_LEVEL": "INFO", **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})}
    dep.services[name] = Service(name, cmd, address, dep.log_dir / f"{name}.log", extra).start()


def _wait(dep: Deployment, timeout: float, num_prefill: int, num_decode: int) -> None:
    """Every service SERVING and the router seeing its workers; fails fast if a process dies."""
    try:
        procs.wait_started(list(dep.services.values()), dep.router, num_prefill, num_decode, timeout)
    except BaseException:
        dep.stop()
        raise


def _metrics_port(dep: Deployment, name: str, on: bool) -> int:
    """``--metrics-port``: a free port recorded in ``dep.metrics`` when ``on``, else 0 (off)."""
    if not on:
        return 0
    port = free_port()
    dep.metrics[name] = f"127.0.0.1:{port}"
    return port


def start(log_dir: Path, model: str = "default", decode_blocks: int = 0, decode_role: str = "decode",
          num_prefill: int = 1, num_decode: int = 1, timeout: float = 240.0, device: str = "cpu",
          kv_memory_gb: float = 0.25, decode_gpus: list[str] | None = None, prefill_gpus: list[str] | None = None,
          extra_worker_args: list[str] = (), metrics: bool = False, router_args: list[str] = ()) -> Deployment:
    """``num_decode`` decode (or both) workers, ``num_prefill`` prefill workers and a router
    (``metrics``: each serves /metrics on a port of its own, see ``Deployment.metrics``;
    ``router_args``: more router flags, e.g. the prefill-placement policy's)."""
    dep = Deployment(router=f"127.0.0.1:{free_port()}", decode=[], prefill=[], log_dir=log_dir)
    common = ["--model", model, "--device", device, *extra_worker_args]
    for i in range(num_decode):
        port, name = free_port(), f"decode{i}"
        pool = ["--num-kv-blocks", str(decode_blocks)] if decode_blocks else ["--kv-memory-gb", str(kv_memory_gb)]
        cmd = procs.worker_cmd("decode", port, metrics_port=_metrics_port(dep, name, metrics), kv_port=free_port(),
                               role=decode_role, extra=[*common, *pool])
        _start(dep, name, cmd, f"127.0.0.1:{port}", decode_gpus[i % len(decode_gpus)] if decode_gpus else None)
        dep.decode.append(f"127.0.0.1:{port}")
    for i in range(num_prefill):
        port, name = free_port(), f"prefill{i}"
        cmd = procs.worker_cmd("prefill", port, metrics_port=_metrics_port(dep, name, metrics),
                               extra=[*common, "--kv-memory-gb", str(kv_memory_gb)])
        _start(dep, name, cmd, f"127.0.0.1:{port}", prefill_gpus[i % len(prefill_gpus)] if prefill_gpus else None)
        dep.prefill.append(f"127.0.0.1:{port}")
    _start(dep, "router", procs.router_cmd(int(dep.router.split(":")[1]), model=model, decode=dep.decode,
                                           prefill=dep.prefill, metrics_port=_metrics_port(dep, "router", metrics),
                                           extra=router_args), dep.router)
    # the router counts a worker of role both as prefill-capable too: wait for every worker started
    _wait(dep, timeout, num_prefill + (num_decode if decode_role == "both" else 0), num_decode)
    return dep


def start_up(log_dir: Path, up_args: list[str] = (), timeout: float = 240.0, num_prefill: int = 1,
             num_decode: int = 1, decode_role: str = "decode") -> Deployment:
    """``pdserve up`` (router + 1 prefill + 1 decode on the CPU by default) as one process; its
    HTTP API on a free port unless ``up_args`` name one. ``num_prefill``, ``num_decode`` and
    ``decode_role``: the layout ``up_args`` ask for (``--prefill``, ``--decode``, ``--role``), for
    the workers' addresses (up gives worker i port base + 2i, decode workers first) and for what
    the router must see before the deployment is ready."""
    router_port, base = free_port(), free_port_range(2 * (num_prefill + num_decode))
    ports = [f"127.0.0.1:{base + 2 * i}" for i in range(num_prefill + num_decode)]
    dep = Deployment(router=f"127.0.0.1:{router_port}", decode=ports[:num_decode], prefill=ports[num_decode:],
                     log_dir=log_dir)
    up_args = list(up_args)
    if "--http-port" not in up_args:
        up_args += ["--http-port", str(free_port())]
    http_port = int(up_args[up_args.index("--http-port") + 1])
    dep.http = f"http://127.0.0.1:{http_port}/v1" if http_port else None
    if not {"--internal-token-file", "--no-internal-auth"} & set(up_args):    # up's workers want a token
        dep.internal_token = secrets.token_hex(16)
        (log_dir / "internal-token").write_text(dep.internal_token + "\n")
        up_args += ["--internal-token-file", str(log_dir / "internal-token")]
    _start(dep, "up", procs.pdserve_cmd("up", "--router-port", str(router_port), "--base-port", str(base), *up_args),
           dep.router)
    _wait(dep, timeout, num_prefill + (num_decode if decode_role == "both" else 0), num_decode)
    return dep
