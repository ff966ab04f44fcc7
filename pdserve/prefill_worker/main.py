"""``pdserve prefill``: the prefill worker."""
from __future__ import annotations

import argparse

from pdserve.common.serving.launch import run_async, run_worker, start_metrics
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
    from pdserve.common.serving.worker_runtime import WorkerRuntime
    from pdserve.prefill_worker.export import KvExport
    from pdserve.prefill_worker.servicer import PrefillServicer

    security = worker_security(args)
    runtime = WorkerRuntime("prefill", worker_id_from_args(args, "prefill"), engine_config_from_args(args, "prefill"))
    export = KvExport.create(runtime, args.kv_timeout_s)
    servicer = PrefillServicer(runtime, export)

    async def startup() -> None:
        state = export.state
        await runtime.start(state.on_step, state.expire, state.on_launch)
        start_metrics(args.metrics_port, runtime.metrics.registry)

    try:
        await run_worker(runtime, servicer, args.host, args.port, args.drain_grace_s, startup, servicer.drain,
                         security=security)
    finally:
        export.close()


def run(args: argparse.Namespace) -> int:
    from pdserve.common.telemetry import setup_tracing
    setup_tracing("prefill")
    return run_async(_main(args))
