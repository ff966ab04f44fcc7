"""``pdserve decode``: the decode worker (role decode, or both = prefill + decode in one process)."""
from __future__ import annotations

import argparse
import logging

from common import env
from common.serving.launch import run_async, run_worker, start_metrics
from common.serving.worker_args import (add_worker_arguments, advertise_host, engine_config_from_args,
                                        worker_id_from_args)

logger = logging.getLogger(__name__)
DEFAULT_PORT, DEFAULT_KV_PORT, DEFAULT_METRICS_PORT = 50053, 50054, 9093


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_worker_arguments(p, DEFAULT_PORT, DEFAULT_METRICS_PORT)
    p.add_argument("--role", choices=("decode", "both"), default=env.get("ROLE", "decode"),
                   help="decode: receives KV from prefill workers; both: also prefills locally (env PDSERVE_ROLE)")
    p.add_argument("--kv-port", type=int, default=env.get_int("KV_PORT", DEFAULT_KV_PORT),
                   help="port of the TCPStore that pair channels rendezvous through (env PDSERVE_KV_PORT)")
    p.add_argument("--lease-ms", type=int, default=env.get_int("LEASE_MS", 30000),
                   help="default lease of a KV reservation")


async def _main(args: argparse.Namespace) -> None:
    from common.kv_transfer import KvReceiver, KvStoreServer
    from common.serving.worker_runtime import WorkerRuntime
    from decode_worker.servicer import DecodeServicer
    from decode_worker.state import DecodeState

    runtime = WorkerRuntime(args.role, worker_id_from_args(args, args.role), engine_config_from_args(args))
    state = DecodeState(runtime.outputs, args.lease_ms)
    store = KvStoreServer(args.host, args.kv_port)
    kv_address = f"{advertise_host(args)}:{store.port}"
    servicer = DecodeServicer(runtime, state, kv_address, receiver=None)

    async def startup() -> None:
        await runtime.start(state.on_step, state.expire)
        state.loop = runtime.loop
        servicer.receiver = KvReceiver(runtime.engine.model_runner.kv_cache, runtime.worker_id, store,
                                       timeout=args.kv_timeout_s)
        start_metrics(args.metrics_port)

    try:
        await run_worker(runtime, servicer, args.host, args.port, args.drain_grace_s, startup, servicer.drain)
    finally:
        if servicer.receiver is not None:
            servicer.receiver.close()
        store.close()


def run(args: argparse.Namespace) -> int:
    return run_async(_main(args))
