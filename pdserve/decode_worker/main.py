"""``pdserve decode``: the decode worker (role decode, or both = prefill + decode in one process; a
both worker also prefills for other workers and ships them the KV: pdserve.prefill_worker.export)."""
from __future__ import annotations

import argparse
import logging

from pdserve.common import env
from pdserve.common.serving.launch import run_async, run_worker
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
    from pdserve.common.engine.model_runner import resolve_device
    from pdserve.common.kv_transfer import get_transport, resolve_transport_name
    from pdserve.common.kv_transfer.layout import rank_name

    worker_id = worker_id_from_args(args, args.role)
    transport = get_transport(resolve_transport_name(args.kv_transport, resolve_device(args.device).type))
    store = transport.listen(args.host, args.kv_port, bind_host=args.kv_host or advertise_host(args))
    kv_address = f"{advertise_host(args)}:{store.port}"
    logger.info("KV store (%s) listening on %s (advertised as %s)", transport.name, store.local_address, kv_address)

    async def build():
        from pdserve.common.serving.engine_loop import EngineHooks
        from pdserve.common.serving.worker_runtime import WorkerRuntime
        from pdserve.decode_worker.kv_import import KvImport
        from pdserve.decode_worker.servicer import DecodeServicer
        from pdserve.decode_worker.state import DecodeState

        runtime = await WorkerRuntime.create(args.role, worker_id, engine_config_from_args(args, args.role))
        # rank 0's receiver: a tensor-parallel worker's ranks each receive their own KV heads
        name = rank_name(worker_id, 0, runtime.engine_config.tensor_parallel_size)
        receiver = transport.receiver(runtime.engine.model_runner.kv_cache, name, store, args.kv_timeout_s)
        state = DecodeState(runtime.outputs, args.lease_ms, runtime.requests, runtime.loop, runtime.cancelled)
        kv_import = KvImport(runtime, state, receiver, kv_address)
        export = None
        if args.role == "both":
            from pdserve.prefill_worker.export import KvExport
            export = KvExport.create(runtime, args.kv_timeout_s, args.kv_transport)
        runtime.start(kv_import.hooks if export is None else EngineHooks.combine(kv_import.hooks, export.hooks))
        return DecodeServicer(runtime, kv_import, export)

    try:
        await run_worker(worker_id, args.host, args.port, args.drain_grace_s, build, args.metrics_port,
                         security=worker_security(args))
    finally:
        store.close()


def run(args: argparse.Namespace) -> int:
    from pdserve.common.telemetry import setup_tracing
    setup_tracing(args.role)
    return run_async(_main(args))
