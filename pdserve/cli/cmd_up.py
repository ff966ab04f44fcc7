"""``pdserve up``: router + prefill + decode workers on this machine, as separate processes.

``--demo`` streams a few sample chats and shuts down; otherwise it runs until Ctrl-C / SIGTERM.
Worker i takes gRPC port ``--base-port + 2i`` (a decode worker ``+ 1`` for its KV store) and
metrics port M + 1 + i. Every port is checked before anything starts; ``up`` stops all services
(the router first) as soon as one exits.

Security (pdserve.common.security.deployment): unless ``--internal-token-file``, ``--internal-tls-*``
or ``--no-internal-auth`` is given, ``up`` makes a random internal token for the deployment (a
0600 file, removed at exit) that every service sends and requires on the internal API; each
service gets the internal flags, the router also ``--auth-tokens-file``. ``up``'s own readiness
calls use the credentials each port expects (never plaintext to a TLS port).
"""
from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.common import env
from pdserve.common.grpc_utils.errors import Unavailable
from pdserve.common.security.config import ClientSecurity
from pdserve.common.security.deployment import DeploymentSecurity, add_deployment_arguments, deployment_security
from pdserve.loadtest import procs, up_layout
from pdserve.router.settings import DEFAULT_PORT as ROUTER_PORT

logger = logging.getLogger(__name__)
DEFAULT_HTTP_PORT = 8000        # `up` turns the router's OpenAI HTTP API on (the router alone: off)
DEMO_PROMPTS = ["What is the capital of France?",
                "Name three primary colors.",
                "Write a haiku about the sea."]


@dataclass(frozen=True)
class EngineDefaults:
    """The engine defaults that `up` passes on or shows in its help, as EngineConfig
    (pdserve/common/config.py) declares them. Mirrored, not imported: that module loads torch,
    which `up` itself never needs; tests/unit/test_cli.py checks that the two agree."""

    model: str = "default"
    dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"


ENGINE_DEFAULTS = EngineDefaults()
# the workers' default step budget by role, as DEFAULT_BUDGET of pdserve/common/serving/worker_args.py
DEFAULT_BUDGET = {"prefill": 16384, "decode": 2048}
# worker flags that `up` passes through to every worker when given (flag, type, help); unset, each
# worker takes its own default (shown here as mirrored above)
WORKER_FLAGS = (
    ("--dtype", str, f"auto, float32, bfloat16, float16 (default: the workers' own, {ENGINE_DEFAULTS.dtype})"),
    ("--block-size", int, f"tokens per KV block, router and workers (default: the workers' own, "
                          f"{ENGINE_DEFAULTS.block_size})"),
    ("--num-kv-blocks", int, "KV pool size of each worker in blocks (default: from --kv-memory-gb or free memory)"),
    ("--max-num-seqs", int, f"most sequences a worker runs at once (default: the workers' own, "
                            f"{ENGINE_DEFAULTS.max_num_seqs})"),
    ("--max-num-batched-tokens", int, "token budget of one engine step (default: the workers' own, by role: "
                                      f"{DEFAULT_BUDGET['prefill']} prefill, {DEFAULT_BUDGET['decode']} decode)"),
    ("--max-model-len", int, "longest sequence in tokens (default: the model's)"),
    ("--kv-memory-gb", float, "memory for each worker's KV pool in GiB (default: the workers' own)"),
    ("--attention-backend", str, f"attention kernels of the workers (default: {ENGINE_DEFAULTS.attention_backend})"),
    ("--kv-cache-dtype", str, "KV cache of every worker: auto or fp8 (default: the workers' own, "
                              f"{ENGINE_DEFAULTS.kv_cache_dtype})"),
    ("--quantization", str, "weights of every worker: fp8 (default: the checkpoint's as they are)"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=env.get("MODEL", ENGINE_DEFAULTS.model),
                   help="checkpoint dir, preset, or 'default'")
    p.add_argument("--device", default=env.get("DEVICE", "cpu"), help="cpu or cuda")
    p.add_argument("--prefill", type=int, default=1, help="number of prefill workers (0 = co-located only)")
    p.add_argument("--decode", type=int, default=1, help="number of decode workers")
    p.add_argument("--role", choices=("decode", "both"), default="decode", help="role of the decode workers")
    p.add_argument("--prefill-gpus", default="",
                   help="comma list of GPU ids for prefill workers (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--decode-gpus", default="", help="comma list of GPU ids for decode workers")
    up_layout.add_layout_arguments(p)
    p.add_argument("--router-port", type=int, default=ROUTER_PORT, help="the router's gRPC port (the public API)")
    p.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                   help="the router's OpenAI-compatible HTTP API (http://127.0.0.1:PORT/v1); 0 = off")
    p.add_argument("--base-port", type=int, default=50060,
                   help="first port for workers: worker i listens on BASE + 2i (a decode worker's KV store on +1)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics: the router on this port, worker i on PORT + 1 + i; 0 = off")
    p.add_argument("--enforce-eager", action="store_true", help="workers run without CUDA graphs")
    for flag, kind, help_text in WORKER_FLAGS:      # unset: not passed (no "(default: None)" in --help)
        p.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=help_text)
    p.add_argument("--extra-worker-args", default="", help="more flags for every worker, as one string")
    p.add_argument("--extra-decode-args", default="",
                   help="more flags for the decode (or both) workers only, after --extra-worker-args")
    p.add_argument("--extra-prefill-args", default="",
                   help="more flags for the prefill workers only, after --extra-worker-args")
    p.add_argument("--extra-router-args", default="", help="more flags for the router, as one string")
    p.add_argument("--demo", action="store_true", help="stream answers to sample prompts, then stop")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds to wait for every service to be SERVING (model loading included)")
    add_deployment_arguments(p)


@dataclass(frozen=True)
class Child:
    """One service to start: its name in messages, command line, GPU, gRPC address, ports, and
    how to call that address (its port's credentials)."""
    name: str
    cmd: list[str]
    gpu: str | None                 # CUDA_VISIBLE_DEVICES (a worker's GPUs, one a rank); None = this process's
    address: str
    ports: dict[int, str]           # port -> the flag that sets it (for the port-in-use error)
    client: ClientSecurity = field(default_factory=ClientSecurity)

    def service(self) -> procs.Service:
        """Run here as ``up`` itself runs (directory, environment), the output on this terminal."""
        gpu = {"CUDA_VISIBLE_DEVICES": self.gpu} if self.gpu is not None else {}
        return procs.Service(self.name, self.cmd, self.address, extra_env=gpu, from_source=False, inherit_output=True,
                             client=self.client)


def _metrics_port(args: argparse.Namespace, index: int) -> int:
    return args.metrics_port + index if args.metrics_port else 0


def _passed(args: argparse.Namespace) -> list[str]:
    """The WORKER_FLAGS given to ``up``, as worker flags."""
    out: list[str] = []
    for flag, _, _ in WORKER_FLAGS:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"), None)
        if value is not None:
            out += [flag, str(value)]
    return out


def _worker_cmd(kind: str, port: int, index: int, args: argparse.Namespace,
                security: DeploymentSecurity) -> list[str]:
    decode = kind == "decode"
    tp = up_layout.tensor_parallel_size(args, kind)
    extra = ["--model", args.model, "--device", args.device, *_passed(args), *security.internal_flags(),
             *(["--tensor-parallel-size", str(tp)] if tp > 1 else []),
             *(["--enforce-eager"] if args.enforce_eager else []), *args.extra_worker_args.split(),
             *(args.extra_decode_args if decode else args.extra_prefill_args).split()]
    return procs.worker_cmd(kind, port, metrics_port=_metrics_port(args, index), kv_port=port + 1 if decode else None,
                            role=args.role if decode else None, extra=extra)


def plan(args: argparse.Namespace, security: DeploymentSecurity | None = None) -> list[Child]:
    """The services to start, workers first, the router last, with ``security`` (default: as
    the flags give it, no token made)."""
    up_layout.apply(args)
    up_layout.check_tensor_parallel(args)
    security = security if security is not None else DeploymentSecurity.from_args(args)
    children: list[Child] = []
    addresses: dict[str, list[str]] = {"decode": [], "prefill": []}
    port = args.base_port
    for kind, count in (("decode", args.decode), ("prefill", args.prefill)):
        for i in range(count):
            index = len(children)
            ports = {port: "--base-port"} | ({port + 1: "--base-port"} if kind == "decode" else {})
            if args.metrics_port:
                ports[args.metrics_port + 1 + index] = "--metrics-port"
            gpus = args.decode_gpus if kind == "decode" else args.prefill_gpus
            children.append(Child(f"{kind} worker {i}", _worker_cmd(kind, port, 1 + index, args, security),
                                  up_layout.worker_gpus(gpus, i, up_layout.tensor_parallel_size(args, kind)),
                                  f"127.0.0.1:{port}", ports, security.internal_client()))
            addresses[kind].append(f"127.0.0.1:{port}")
            port += 2
    block = ["--block-size", str(args.block_size)] if hasattr(args, "block_size") else []
    router = procs.router_cmd(args.router_port, model=args.model, decode=addresses["decode"],
                              prefill=addresses["prefill"], metrics_port=_metrics_port(args, 0),
                              extra=[*block, "--http-port", str(args.http_port), *security.router_flags(),
                                     *args.extra_router_args.split()])
    ports = {args.router_port: "--router-port"} | ({args.http_port: "--http-port"} if args.http_port else {})
    if args.metrics_port:
        ports[args.metrics_port] = "--metrics-port"
    children.append(Child("router", router, None, f"127.0.0.1:{args.router_port}", ports, security.public_client()))
    return children


def check_ports(children: list[Child]) -> None:
    """Unavailable naming the port, its service and the flag to change when a port is in use."""
    for child in children:
        for port, flag in child.ports.items():
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", port))
                except OSError as e:
                    raise Unavailable(f"cannot bind 127.0.0.1:{port} for the {child.name}: {e.strerror}; "
                                      f"pass another {flag}") from None


def wait_started(children: list[Child], services: list[procs.Service], args: argparse.Namespace) -> None:
    """Everything SERVING and the router seeing every worker, or Unavailable when a service exits
    or the startup timeout passes (a worker of role both counts as prefill-capable too). Each
    port is asked with its own credentials (mutual TLS, tokens), as its peers ask it
    (:func:`pdserve.loadtest.procs.wait_started`; each service's ``client``)."""
    num_prefill = args.prefill + (args.decode if args.role == "both" else 0)
    router = children[-1]
    try:
        procs.wait_started(services, router.address, num_prefill, args.decode, args.startup_timeout,
                           security=router.client)
    except (procs.ServiceExited, TimeoutError) as e:
        raise Unavailable(str(e)) from None


def _demo(router: str, metadata: Sequence[tuple[str, str]] = ()) -> None:
    """Stream the answers to DEMO_PROMPTS; ``metadata``: the public API's token, if it wants one."""
    import grpc

    from pdserve.client import build_request
    from pdserve.common.grpc_utils.errors import from_rpc_error
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.v1 import router_pb2_grpc
    with grpc.insecure_channel(router) as channel:
        stub = router_pb2_grpc.GenerationStub(channel)
        for prompt in DEMO_PROMPTS:
            sys.stdout.write(f"\n>>> {prompt}\n")
            try:
                for resp in stub.Generate(build_request(prompt, SamplingParams(temperature=0.0, max_tokens=64)),
                                          timeout=120.0, metadata=tuple(metadata)):
                    sys.stdout.write(resp.text)
                    sys.stdout.flush()
            except grpc.RpcError as e:
                raise from_rpc_error(e) from None
            sys.stdout.write("\n")


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))    # stop the services on SIGTERM too
    # Ctrl-C stops them even when this process was started with SIGINT ignored (a background job
    # of a shell without job control, nohup): Python then installs no handler of its own
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with deployment_security(args) as security:
        return _run(args, security)


def _run(args: argparse.Namespace, security: DeploymentSecurity) -> int:
    children = plan(args, security)
    check_ports(children)
    logger.info("%s", security.describe())
    services = [child.service().start() for child in children]
    try:
        wait_started(children, services, args)
        logger.info("all services are SERVING; router at %s (gRPC)%s", children[-1].address,
                    f", http://127.0.0.1:{args.http_port}/v1 (OpenAI API)" if args.http_port else "")
        if args.demo:
            _demo(children[-1].address, security.public_metadata())
            return 0
        while all(svc.alive() for svc in services):
            time.sleep(0.5)
        logger.error("a service exited; stopping the others")
        return 1
    except KeyboardInterrupt:           # Ctrl-C: the normal way to stop
        return 0
    finally:
        procs.stop_all(services)        # the router first, then the workers together
