"""A simulated deployment on loopback: fleets of simulated workers (bench.sim.fleet of bench.sim.worker),
standalone workers (to kill, drain or add one at a time) and router replicas, all real
processes (pdserve.loadtest.procs.Service); and a sampler of every worker's GetStats."""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.loadtest import procs
from pdserve.loadtest.ports import free_port, free_ports
from pdserve.router.pd_policy import PdConfig
from pdserve.v1 import worker_pb2, worker_pb2_grpc

PER_FLEET = 16      # simulated workers per fleet process


@dataclass
class SimConfig:
    num_decode: int = 64
    num_prefill: int = 16
    num_routers: int = 2
    routing: str = "kv"
    load_alpha: float = 1.0
    time_scale: float = 6.0
    decode_blocks: int = 2048
    prefill_blocks: int = 512
    block_size: int = 16
    kv_max_channels: int = 32
    migration_limit: int = 2          # routers continue a stream cut after its first token (churn)
    standalone_decode: int = 0        # of num_decode: one process each (churn)
    standalone_prefill: int = 0
    late_decode: int = 0              # listed to the routers, started later (churn: added)
    late_prefill: int = 0


@dataclass
class Cluster:
    cfg: SimConfig
    log_dir: Path
    decode: list[str] = field(default_factory=list)
    prefill: list[str] = field(default_factory=list)
    routers: list[procs.Service] = field(default_factory=list)
    fleets: list[procs.Service] = field(default_factory=list)
    single: dict[str, procs.Service] = field(default_factory=dict)   # address -> standalone worker
    late: dict[str, procs.Service] = field(default_factory=dict)     # address -> not started yet
    decode_late: list[str] = field(default_factory=list)
    prefill_late: list[str] = field(default_factory=list)

    def worker_args(self, blocks: int) -> list[str]:
        c = self.cfg
        return ["--time-scale", str(c.time_scale), "--num-blocks", str(blocks), "--block-size",
                str(c.block_size), "--kv-max-channels", str(c.kv_max_channels), "--vocab", "49152",
                "--max-model-len", "8192", "--drain-grace-s", "20"]

    def _fleet(self, role: str, ports: list[int], blocks: int) -> procs.Service:
        cmd = [sys.executable, "-m", "bench.sim.fleet", "--role", role, "--ports", ",".join(map(str, ports)),
               "--", *self.worker_args(blocks)]
        return procs.Service(f"fleet-{role}-{ports[0]}", cmd, f"127.0.0.1:{ports[0]}",
                             self.log_dir / f"fleet-{role}-{ports[0]}.log")

    def _single(self, role: str, port: int, blocks: int) -> procs.Service:
        cmd = [sys.executable, "-m", "bench.sim.worker", "--role", role, "--port", str(port),
               *self.worker_args(blocks)]
        return procs.Service(f"{role}-{port}", cmd, f"127.0.0.1:{port}", self.log_dir / f"{role}-{port}.log")

    def _role(self, role: str, n: int, n_single: int, n_late: int, blocks: int) -> tuple[list[str], list[str]]:
        ports = free_ports(n + n_late)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        pooled = ports[:n - n_single]
        for i in range(0, len(pooled), PER_FLEET):
            self.fleets.append(self._fleet(role, pooled[i:i + PER_FLEET], blocks))
        for p in ports[n - n_single:n]:
            self.single[f"127.0.0.1:{p}"] = self._single(role, p, blocks)
        for p in ports[n:]:
            self.late[f"127.0.0.1:{p}"] = self._single(role, p, blocks)
        return addrs[:n], addrs[n:]

    def start(self, timeout: float = 120.0) -> Cluster:
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()          # what did start (fleets, routers) must not outlive the failure
            raise

    def _start(self, timeout: float) -> Cluster:
        c = self.cfg
        self.decode, self.decode_late = self._role("decode", c.num_decode, c.standalone_decode, c.late_decode,
                                                   c.decode_blocks)
        self.prefill, self.prefill_late = self._role("prefill", c.num_prefill, c.standalone_prefill, c.late_prefill,
                                                     c.prefill_blocks)
        workers = self.fleets + list(self.single.values())
        for s in workers:
            s.start()
        procs.wait_ready(workers, timeout)
        for i in range(c.num_routers):
            port = free_port()
            self.routers.append(procs.router(
                port, decode=self.decode + self.decode_late, prefill=self.prefill + self.prefill_late, model="default",
                extra=["--routing", c.routing, "--load-alpha", str(c.load_alpha), "--router-id", f"r{i}",
                       "--metrics-port", str(free_port()), "--block-size", str(c.block_size),
                       "--migration-limit", str(c.migration_limit),
                       # the recent-work window is modelled time, stretched like the GPUs
                       "--pd-rate-window-s", str(PdConfig().rate_window_s * c.time_scale)],
                log_dir=self.log_dir))
        for r in self.routers:      # the later --metrics-port wins over procs.router's 0
            r.start()
        procs.wait_ready(self.routers, timeout)
        for r in self.routers:
            procs.wait_workers(r.address, c.num_prefill, c.num_decode, timeout)
        return self

    @property
    def router_addresses(self) -> str:
        return ",".join(r.address for r in self.routers)

    def metrics_ports(self) -> list[int]:
        return [int(r.cmd[len(r.cmd) - 1 - r.cmd[::-1].index("--metrics-port") + 1]) for r in self.routers]

    def stop(self) -> None:
        # Routers first: while a router lives it holds (and re-opens) Subscribe / StreamKvEvents
        # streams on every worker, so a worker's graceful stop waits out its whole drain grace
        # (20 s per fleet process, one after another) before it exits.
        procs.stop_all(self.routers)
        procs.stop_all(self.fleets + list(self.single.values()) + list(self.late.values()))


def get_stats(address: str, timeout: float = 1.0) -> worker_pb2.WorkerStats | None:
    try:
        with grpc.insecure_channel(address) as ch:
            return worker_pb2_grpc.WorkerStub(ch).GetStats(worker_pb2.GetStatsRequest(), timeout=timeout)
    except grpc.RpcError:
        return None


class Sampler(threading.Thread):
    """GetStats of every worker every ``interval`` s: [(t, {address: WorkerStats})]."""

    def __init__(self, addresses: list[str], interval: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.addresses, self.interval = addresses, interval
        self.samples: list[tuple[float, dict[str, worker_pb2.WorkerStats]]] = []
        self._halt = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        chans = {a: grpc.insecure_channel(a) for a in self.addresses}
        stubs = {a: worker_pb2_grpc.WorkerStub(ch) for a, ch in chans.items()}
        while not self._halt.is_set():
            t = time.monotonic() - self.t0
            snap = {}
            for a, stub in stubs.items():
                try:
                    snap[a] = stub.GetStats(worker_pb2.GetStatsRequest(), timeout=1.0)
                except grpc.RpcError:
                    pass
            self.samples.append((t, snap))
            self._halt.wait(self.interval)
        for ch in chans.values():
            ch.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
