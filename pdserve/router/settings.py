"""The router's settings (from flags, see pdserve.router.main) and its fixed internal timings."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.router.admission import AdmissionConfig
from pdserve.router.pd_policy import PdConfig

# The router's ports unless flags say otherwise (its gRPC API; Prometheus /metrics).
DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9091

# How often GetStats is polled per worker (load figure and liveness check).
STATS_INTERVAL_S = 0.5
# A worker whose GetStats times out this many times in a row is marked down (its in-flight
# requests fail over or get UNAVAILABLE). One slow answer is a busy worker, not a dead one; a
# closed connection (UNAVAILABLE) marks it down at once.
STATS_MISSES_DOWN = 3
# Reconnect backoff of a worker that is down (Info probe): first, then doubling up to max.
RECONNECT_MIN_S = 0.25
RECONNECT_MAX_S = 5.0
# How long the router waits for a Subscribe stream to be confirmed by the worker's initial
# metadata before assuming it is open anyway (a worker that sends headers only with its first
# StepOutputs).
SUBSCRIBE_CONFIRM_S = 1.0
# HTTP/2 window of the Subscribe stream (its own connection; see pdserve.router.subscription): how many
# bytes of a decode worker's outputs may wait unread in the router before the worker holds (and
# merges) further steps.
SUBSCRIBE_WINDOW_BYTES = 64 * 1024
# Receive window of the router's other connections (clients -> router, router -> workers), fixed:
# BDP probing is off there (its PINGs wake both loops on a request's way to its first token; see
# bench/NOTES.md). 1 MiB takes a prompt of ~300k token ids without a window update.
RECEIVE_WINDOW_BYTES = 1024 * 1024
# grpc options of those connections (server and channels).
NO_BDP_OPTIONS = (
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", RECEIVE_WINDOW_BYTES),
)
# A KV event stream found inconsistent (a gap in its sequence numbers) is re-opened after this
# pause (its snapshot repairs the router's prefix index; the worker is not matched meanwhile).
KV_RESUBSCRIBE_S = 0.1
# Cancel rpcs are fire-and-forget with this timeout.
CANCEL_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class RouterSettings:
    router_id: str
    block_size: int = 0            # 0 = learn from the first worker; else every worker must match
    lease_ms: int = 30_000         # reservation lease sent with Reserve (0 = the worker's default)
    worker_timeout_s: float = 2.0  # timeout of one router -> worker control call (Info, Reserve, ...)
    dns_refresh_s: float = 10.0    # re-resolution period of dns:/// worker addresses
    load_alpha: float = 1.0        # policy weight of a decode worker's load (see pdserve.router.policy)
    drain_grace_s: float = 30.0
    routing: str = "kv"            # placement: kv | least-loaded | round-robin (see pdserve.router.policy)
    migration_limit: int = 0       # times a stream cut after its first token is continued elsewhere (flow.py)
    pd: PdConfig = PdConfig()      # local vs remote prefill, SLOs (see pdserve.router.pd_policy)
    admission: AdmissionConfig = AdmissionConfig()   # when a new request is refused (pdserve.router.admission)

    def __post_init__(self) -> None:
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
