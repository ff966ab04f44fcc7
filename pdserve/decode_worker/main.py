"""``pdserve decode``: the decode worker (role decode, or both = prefill + decode in one process; a
both worker also prefills for other workers and ships them the KV: pdserve.prefill_worker.export)."""
from __future__ import annotations

import argparse
import logging

from pdserve.common import env
from pdserve.common.serving.launch import run_async, run_worker, start_metrics
from pdserve.common.serving.worker_args import (
    add_worker_arguments,
    advertise_host,
    engine_config_from_args,
    worker_id_from_args,
    worker_security,
)

logger = logging.getLogger(__name__)
DEFAULT_PORT, DEFAULT_KV_PORT, DEFAULT_METRICS_PORT = 50053, 50054, 9093
DEFAULT_LEASE_MS = 30_000        # a KV reservation's lease when the router sends none


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_worker_arguments(p, DEFAULT_PORT, DEFAULT_METRICS_PORT)
    p.add_argument("--role", choices=("decode", "both"), default=env.get("ROLE", "decode"),
                   help="decode: receives KV from prefill workers; both: also prefills, for itself (no "
                        "transfer) and for other workers (it ships them the KV) (env PDSERVE_ROLE)")
    p.add_argument("--kv-port", type=int, default=env.get_int("KV_PORT", DEFAULT_KV_PORT),
                   help="port of the TCPStore that pair channels rendezvous through (env PDSERVE_KV_PORT)")
    p.add_argument("--kv-host", default=env.get("KV_HOST", None),
                   help="address the TCPStore listens on (env PDSERVE_KV_HOST); default: the advertised "
                        "host (the pod IP on Kubernetes); 0.0.0.0 = every interface")
    p.add_argument("--lease-ms", type=int, default=env.get_int("LEASE_MS", DEFAULT_LEASE_MS),
                   help="default lease of a KV reservation")


async def _main(args: argparse.Namespace) -> None:
    from pdserve.common.kv_transfer import KvReceiver, KvStoreServer
    from pdserve.common.serving.worker_runtime import WorkerRuntime
    from pdserve.decode_worker.servicer import DecodeServicer
    from pdserve.decode_worker.state import DecodeState

    security = worker_security(args)
    runtime = WorkerRuntime(args.role, worker_id_from_args(args, args.role), engine_config_from_args(args, args.role))
    state = DecodeState(runtime.outputs, args.lease_ms, runtime.requests)
    store = KvStoreServer(args.host, args.kv_port, bind_host=args.kv_host or advertise_host(args))
    kv_address = f"{advertise_host(args)}:{store.port}"
    logger.info("KV store listening on %s (advertised as %s)", store.local_address, kv_address)
    export = None
    if args.role == "both":
        from pdserve.prefill_worker.export import KvExport
        export = KvExport.create(runtime, args.kv_timeout_s)
    servicer = DecodeServicer(runtime, state, kv_address, receiver=None, export=export)

    async def startup() -> None:
        if export is None:
            await runtime.start(state.on_step, state.expire)
        else:
            await runtime.start(*both_hooks(state, export.state))
        state.loop = runtime.loop
        servicer.receiver = KvReceiver(runtime.engine.model_runner.kv_cache, runtime.worker_id, store,
                                       timeout=args.kv_timeout_s)
        start_metrics(args.metrics_port, runtime.metrics.registry)

    try:
        await run_worker(runtime, servicer, args.host, args.port, args.drain_grace_s, startup, servicer.drain,
                         security=security)
    finally:
        if servicer.receiver is not None:
            servicer.receiver.close()
        if export is not None:
            export.close()
        store.close()


def both_hooks(decode, prefill):
    """The engine hooks of a worker of role both: its decode requests' and the prefills it runs
    for other workers' (each state ignores the other's sequences)."""
    def on_step(out) -> None:
        decode.on_step(out)
        prefill.on_step(out)

    def expire(engine) -> None:
        decode.expire(engine)
        prefill.expire(engine)

    return on_step, expire, prefill.on_launch


def run(args: argparse.Namespace) -> int:
    from pdserve.common.telemetry import setup_tracing
    setup_tracing(args.role)
    return run_async(_main(args))
