"""``pdserve prefill``: the prefill worker."""
from __future__ import annotations

import argparse

from pdserve.common.serving.launch import run_async, run_worker
from pdserve.common.serving.worker_args import (
    add_worker_arguments,
    engine_config_from_args,
    worker_id_from_args,
    worker_security,
)

DEFAULT_PORT, DEFAULT_METRICS_PORT = 50052, 9092


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_worker_arguments(p, DEFAULT_PORT, DEFAULT_METRICS_PORT)


async def _main(args: argparse.Namespace) -> None:
    worker_id = worker_id_from_args(args, "prefill")

    async def build():
        from pdserve.common.serving.worker_runtime import WorkerRuntime
        from pdserve.prefill_worker.export import KvExport
        from pdserve.prefill_worker.servicer import PrefillServicer

        runtime = await WorkerRuntime.create("prefill", worker_id, engine_config_from_args(args, "prefill"))
        export = KvExport.create(runtime, args.kv_timeout_s, args.kv_transport)
        runtime.start(export.hooks)
        return PrefillServicer(runtime, export)

    await run_worker(worker_id, args.host, args.port, args.drain_grace_s, build, args.metrics_port,
                     security=worker_security(args))


def run(args: argparse.Namespace) -> int:
    from pdserve.common.telemetry import setup_tracing
    setup_tracing("prefill")
    return run_async(_main(args))
