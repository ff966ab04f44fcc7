"""``pdserve router``: the public gRPC API (Generation + InfoService) in front of the workers.

Every flag has an environment default (pdserve.common.env, prefix PDSERVE_): the router's own
settings read ``PDSERVE_ROUTER_*``; the model and block size read the deployment-wide
``PDSERVE_MODEL`` and ``PDSERVE_BLOCK_SIZE`` that the workers read too. Also runnable as
``python -m pdserve.router.main``.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys
import uuid
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from pdserve.common import env
from pdserve.router.admission import AdmissionConfig
from pdserve.router.pd_args import add_pd_arguments, pd_config_from_args
from pdserve.router.settings import DEFAULT_METRICS_PORT, DEFAULT_PORT, RouterSettings

if TYPE_CHECKING:
    from pdserve.common.grpc_utils import GrpcServer
    from pdserve.common.security import ServerSecurity
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.servicer import GenerationServicer
    from pdserve.router.tokenization import ModelSpec, RouterTokenizer
    from pdserve.router.workers import WorkerRegistry

log = logging.getLogger(__name__)
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = RouterSettings(router_id="")        # the defaults
    _add_listen_arguments(p)
    _add_worker_arguments(p, d)
    _add_routing_arguments(p, d)
    add_pd_arguments(p)
    _add_admission_arguments(p, d)
    _add_lifecycle_arguments(p, d)
    from pdserve.common.security.args import add_internal_arguments, add_public_arguments
    add_public_arguments(p)
    add_internal_arguments(p)
    from pdserve.router.openai_api.settings import add_arguments as add_http_arguments
    add_http_arguments(p)
    p.add_argument("--event-loop", choices=EVENT_LOOPS, default=env.get("ROUTER_EVENT_LOOP", "auto"),
                   help="asyncio event loop: uvloop (~0.1 ms less added TTFT per request), asyncio, or auto "
                        "(uvloop where it is installed) (env PDSERVE_ROUTER_EVENT_LOOP)")


def _add_listen_arguments(p: argparse.ArgumentParser) -> None:
    """Where the router listens: its gRPC API and its /metrics."""
    p.add_argument("--host", default=env.get("ROUTER_HOST", "0.0.0.0"), help="listen address (env PDSERVE_ROUTER_HOST)")
    p.add_argument("--port", type=int, default=env.get_int("ROUTER_PORT", DEFAULT_PORT),
                   help="gRPC port (env PDSERVE_ROUTER_PORT)")
    p.add_argument("--metrics-port", type=int, default=env.get_int("ROUTER_METRICS_PORT", DEFAULT_METRICS_PORT),
                   help="Prometheus /metrics HTTP port, 0 = off (env PDSERVE_ROUTER_METRICS_PORT)")


def _add_worker_arguments(p: argparse.ArgumentParser, d: RouterSettings) -> None:
    """The model and the workers: where they are, what they must report, how the router calls them."""
    p.add_argument("--model", default=env.get("MODEL", "default"),
                   help="'default' (embedded SmolLM2, with tokenizer), a checkpoint dir, or a preset (token-id "
                        "input only) (env PDSERVE_MODEL)")
    p.add_argument("--prefill", default=env.get("ROUTER_PREFILL", ""),
                   help="prefill workers: comma list of host:port or dns:///name:port (env PDSERVE_ROUTER_PREFILL)")
    p.add_argument("--decode", default=env.get("ROUTER_DECODE", ""),
                   help="decode workers (role decode or both): comma list of host:port or dns:///name:port "
                        "(env PDSERVE_ROUTER_DECODE)")
    p.add_argument("--block-size", type=int, default=env.get_int("BLOCK_SIZE", d.block_size),
                   help="KV block size every worker must report; 0 = take the first worker's (env PDSERVE_BLOCK_SIZE)")
    p.add_argument("--lease-ms", type=int, default=env.get_int("ROUTER_LEASE_MS", d.lease_ms),
                   help="how long a decode worker holds reserved blocks for the KV (0 = the worker's default) "
                        "(env PDSERVE_ROUTER_LEASE_MS)")
    p.add_argument("--worker-timeout-s", type=float,
                   default=env.get_float("ROUTER_WORKER_TIMEOUT_S", d.worker_timeout_s),
                   help="timeout of one router->worker control call (Info, Reserve, Submit, GetStats) "
                        "(env PDSERVE_ROUTER_WORKER_TIMEOUT_S)")
    p.add_argument("--dns-refresh-s", type=float, default=env.get_float("ROUTER_DNS_REFRESH_S", d.dns_refresh_s),
                   help="re-resolution period of dns:/// worker addresses (env PDSERVE_ROUTER_DNS_REFRESH_S)")


def _add_routing_arguments(p: argparse.ArgumentParser, d: RouterSettings) -> None:
    """Where a request goes: the decode placement policy, and migration of a cut stream."""
    p.add_argument("--load-alpha", type=float, default=env.get_float("ROUTER_LOAD_ALPHA", d.load_alpha),
                   help="decode placement: score = cached prefix tokens - alpha * load tokens "
                        "(env PDSERVE_ROUTER_LOAD_ALPHA)")
    p.add_argument("--routing", choices=("kv", "least-loaded", "round-robin"),
                   default=env.get("ROUTER_ROUTING", d.routing),
                   help="placement policy: kv (cached prefix weighed against load), or the baselines least-loaded "
                        "and round-robin (env PDSERVE_ROUTER_ROUTING)")
    p.add_argument("--migration-limit", type=int, default=env.get_int("ROUTER_MIGRATION_LIMIT", d.migration_limit),
                   help="times a stream cut after its first token (its worker died) is continued on another "
                        "worker: prompt + the tokens sent so far as its new prompt; 0 = fail it "
                        "(env PDSERVE_ROUTER_MIGRATION_LIMIT)")


def _add_admission_arguments(p: argparse.ArgumentParser, d: RouterSettings) -> None:
    """When a new request is refused at once (RESOURCE_EXHAUSTED / HTTP 429 with Retry-After)
    instead of queued (pdserve.router.admission); each bound 0 = off."""
    a = d.admission
    g = p.add_argument_group("admission control (pdserve.router.admission)")
    g.add_argument("--max-queued-prompt-tokens", type=int,
                   default=env.get_int("ROUTER_MAX_QUEUED_PROMPT_TOKENS", a.max_queued_prompt_tokens),
                   help="refuse a new request while every worker that could prefill it has at least this many "
                        "prompt tokens queued; 0 = no bound (env PDSERVE_ROUTER_MAX_QUEUED_PROMPT_TOKENS)")
    g.add_argument("--max-waiting-requests", type=int,
                   default=env.get_int("ROUTER_MAX_WAITING_REQUESTS", a.max_waiting_requests),
                   help="refuse a new request while this many requests per prefill-capable worker wait for "
                        "their first token; 0 = no bound (env PDSERVE_ROUTER_MAX_WAITING_REQUESTS)")
    g.add_argument("--admission-slo-multiple", type=float,
                   default=env.get_float("ROUTER_ADMISSION_SLO_MULTIPLE", a.slo_multiple),
                   help="refuse a new request whose estimated TTFT (the prompt tokens queued ahead of it, then "
                        "its own, at the worker's prefill rate, plus its decode rows' share of each step) "
                        "exceeds this multiple of its TTFT objective (--slo-ttft-ms, or the request's own "
                        "when tighter) on every worker that could prefill it; 1 = a request that cannot meet "
                        "its objective is refused instead of queued; 0 = off "
                        "(env PDSERVE_ROUTER_ADMISSION_SLO_MULTIPLE)")


def _add_lifecycle_arguments(p: argparse.ArgumentParser, d: RouterSettings) -> None:
    """The router's id, its start and its drain."""
    p.add_argument("--router-id", default=env.get("ROUTER_ID", None),
                   help="this router's id on the workers' Subscribe streams (default: random) (env PDSERVE_ROUTER_ID)")
    p.add_argument("--drain-grace-s", type=float, default=env.get_float("ROUTER_DRAIN_GRACE_S", d.drain_grace_s),
                   help="on SIGTERM: time for requests in flight to finish (env PDSERVE_ROUTER_DRAIN_GRACE_S)")
    p.add_argument("--startup-wait-s", type=float, default=env.get_float("ROUTER_STARTUP_WAIT_S", 5.0),
                   help="at start: how long to wait for the listed workers' first registration before "
                        "reporting SERVING (env PDSERVE_ROUTER_STARTUP_WAIT_S)")


def _loop_runner(choice: str) -> Callable[[Coroutine[Any, Any, None]], None]:
    """``uvloop.run`` or ``asyncio.run`` for ``--event-loop``; ``auto``: uvloop where it is installed,
    else asyncio (see bench/NOTES.md, "Figures moved out of the code")."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise
            log.debug("uvloop not installed: asyncio event loop")
        else:
            log.info("event loop: uvloop %s", getattr(uvloop, "__version__", ""))
            return uvloop.run
    return asyncio.run


def run(args: argparse.Namespace) -> int:
    from pdserve.common.grpc_utils import PdserveError
    from pdserve.common.telemetry import setup_tracing
    setup_tracing("router")
    try:
        runner = _loop_runner(getattr(args, "event_loop", "auto"))
    except ImportError as e:
        log.error("--event-loop uvloop: %s", e)
        return 2
    try:
        runner(_serve(args))
    except (FileNotFoundError, ValueError) as e:   # a missing model; bad TLS / token settings
        log.error("%s", e)
        return 2
    except PdserveError as e:   # e.g. the port is taken
        log.error("router failed: %s", e)
        return 1
    return 0


def _listen_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _router_settings(args: argparse.Namespace) -> RouterSettings:
    """The router's settings from its flags (a random router id unless ``--router-id``)."""
    return RouterSettings(
        router_id=args.router_id or f"router-{uuid.uuid4().hex[:8]}", block_size=args.block_size,
        lease_ms=args.lease_ms, worker_timeout_s=args.worker_timeout_s, dns_refresh_s=args.dns_refresh_s,
        load_alpha=args.load_alpha, drain_grace_s=args.drain_grace_s, routing=args.routing,
        migration_limit=args.migration_limit, pd=pd_config_from_args(args), admission=_admission_config(args))


def _admission_config(args: argparse.Namespace) -> AdmissionConfig:
    return AdmissionConfig(max_queued_prompt_tokens=args.max_queued_prompt_tokens,
                           max_waiting_requests=args.max_waiting_requests, slo_multiple=args.admission_slo_multiple)


async def _load_model(model: str, router_id: str) -> tuple[ModelSpec, RouterTokenizer | None]:
    """The model's spec for ``--model``, and its tokenizer where it has one (loaded off the loop)."""
    from pdserve.router.tokenization import RouterTokenizer, resolve_spec
    spec = resolve_spec(model)
    tokenizer = await asyncio.to_thread(RouterTokenizer, spec.tokenizer_dir) if spec.tokenizer_dir else None
    log.info("router %s: model %s (context %d, vocab %d, %s)", router_id, spec.name, spec.max_model_len,
             spec.vocab_size, "with tokenizer" if tokenizer else "no tokenizer: token-id input only")
    return spec, tokenizer


def _gauge_updater(metrics: RouterMetrics, registry: WorkerRegistry) -> Callable[[], None]:
    """The registry listener that sets the workers-up gauges (one per role) from the registry."""
    from pdserve.common.worker_types import Role

    def update_gauges() -> None:
        for role in (Role.PREFILL, Role.DECODE, Role.BOTH):      # labels ROLE_PREFILL, ...
            metrics.workers_up.labels(f"ROLE_{role.name}").set(registry.count_up({role}))

    return update_gauges


def _grpc_server(args: argparse.Namespace, generation: GenerationServicer, registry: WorkerRegistry,
                 spec: ModelSpec, router_id: str, security: ServerSecurity) -> GrpcServer:
    """The public gRPC server: Generation and InfoService, and KServe v2 on the same port."""
    from pdserve.common.grpc_utils import build_server
    from pdserve.router.kserve.servicer import KServeServicer
    from pdserve.router.kserve.servicer import service as kserve_service
    from pdserve.router.servicer import InfoServicer, services
    from pdserve.router.settings import NO_BDP_OPTIONS
    kserve = KServeServicer(generation)     # KServe v2 gRPC, same port and request path
    server = build_server(_listen_address(args.host, args.port), [
        *services(generation, InfoServicer(registry, spec, router_id)), kserve_service(kserve),
    ], options=NO_BDP_OPTIONS, security=security, max_message_bytes=generation.bounds.max_request_bytes)
    kserve.bind_health(server.health)
    return server


async def _serve(args: argparse.Namespace) -> None:
    from pdserve.common.grpc_utils import serve
    from pdserve.common.security import set_default_client_security
    from pdserve.common.security.args import internal_client_security, public_server_security
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.observed import ObservedFlow
    from pdserve.router.servicer import GenerationServicer
    from pdserve.router.workers import WorkerRegistry
    security = public_server_security(args)
    set_default_client_security(internal_client_security(args))
    settings = _router_settings(args)
    spec, tokenizer = await _load_model(args.model, settings.router_id)
    metrics = RouterMetrics()
    registry = WorkerRegistry(settings, spec, args.prefill, args.decode)
    flow = ObservedFlow(registry, settings, tokenizer, metrics)
    update_gauges = _gauge_updater(metrics, registry)
    registry.add_listener(update_gauges)
    generation = GenerationServicer(flow, registry, spec, tokenizer)
    from pdserve.router.openai_api.server import from_args as http_server
    http = http_server(args, generation, flow, security)    # OpenAI HTTP API (same tokens, TLS); None = off
    server = _grpc_server(args, generation, registry, spec, settings.router_id, security)

    async def startup() -> None:
        metrics.serve(args.metrics_port, args.host)
        await registry.start(initial_wait_s=args.startup_wait_s)
        update_gauges()
        if http is not None:
            await http.start()
        # Everything allocated so far (modules, the tokenizer, channels) lives as long as the
        # process: keep it out of the cyclic GC's scans, which then cost per request, not per heap.
        gc.collect()
        gc.freeze()

    async def drain(grace_s: float) -> None:
        await flow.drain(grace_s)       # both front doors' requests: new ones get UNAVAILABLE / 503
        if http is not None:
            await http.stop(1.0)

    try:
        await serve(server, startup=startup, drain=drain, grace_s=args.drain_grace_s)
    finally:
        if http is not None:
            await http.stop(0.0)
        await registry.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve router", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=env.log_level())
    parser.add_argument("--log-format", choices=("text", "json"), default=env.log_format(),
                        help="json: one JSON object per line, with request and trace ids (env PDSERVE_LOG_FORMAT)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    from pdserve.common.telemetry import configure_logging
    configure_logging(args.log_level, args.log_format)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
