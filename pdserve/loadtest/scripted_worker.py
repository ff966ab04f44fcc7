"""A scripted pdserve worker: the real gRPC ``Worker`` + ``InfoService``, no model behind it.

    python -m pdserve.loadtest.scripted_worker --port 50053 --role both --vocab 49152 --block-size 16 --step-ms 5

The command line and entry point; the servicer is pdserve/loadtest/scripted_servicer.py, its state
pdserve/loadtest/scripted_state.py (both re-exported here). On SIGTERM the worker drains: health
NOT_SERVING, new requests refused (UNAVAILABLE), those in flight finish within ``--drain-grace-s``.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable

from pdserve.common.grpc_utils import Service, build_server, serve
from pdserve.loadtest.scripted_servicer import KV_QUEUE_MAX, MAX_CATCH_UP, ROLES, ScriptedWorker
from pdserve.loadtest.scripted_state import BlockPool, ModelledParts, Outbox, Req, script_logprob, script_token
from pdserve.v1 import common_pb2, common_pb2_grpc, worker_pb2, worker_pb2_grpc

__all__ = ["KV_QUEUE_MAX", "MAX_CATCH_UP", "ROLES", "BlockPool", "ModelledParts", "Outbox", "Req", "ScriptedWorker",
           "main", "parse_args", "script_logprob", "script_token"]


def parse_args(argv: list[str] | None = None,
               add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The worker's flags, plus those ``add_arguments`` adds (a modelled backend's)."""
    p = argparse.ArgumentParser(prog="python -m pdserve.loadtest.scripted_worker", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--advertise", default="127.0.0.1", help="host in the kv_store_address it reports")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--role", choices=sorted(ROLES), default="both")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="model name reported by Info")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--step-ms", type=float, default=5.0, help="engine step interval")
    p.add_argument("--prefill-ms", type=float, default=None, help="simulated prefill time (default: --step-ms)")
    p.add_argument("--lease-ms", type=int, default=30_000, help="default reservation lease")
    p.add_argument("--default-max-tokens", type=int, default=64, help="max_tokens when a request sends 0")
    p.add_argument("--eos-ids", default="2", help="comma list of EOS ids (never scripted; stop unless ignore_eos)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--fail-submits", type=int, default=0,
                   help="fail the first N Submit/Reserve calls with UNAVAILABLE (-1 = all), for failover tests")
    p.add_argument("--catch-up", action=argparse.BooleanOptionalAction,
                   default=os.environ.get("PDSERVE_SCRIPTED_CATCH_UP", "1") != "0",
                   help="run the engine steps that came due while the process was late (CPU contention) at once, "
                        "as a GPU engine that kept stepping would (env PDSERVE_SCRIPTED_CATCH_UP=0: off)")
    p.add_argument("--kv-drop-every", type=int, default=0,
                   help="drop every Nth KV event message (tests the router's gap repair)")
    p.add_argument("--drain-grace-s", type=float, default=1.0, help="on SIGTERM: time for requests in flight")
    p.add_argument("--log-level", default="WARNING")
    if add_arguments is not None:
        add_arguments(p)
    args = p.parse_args(argv)
    if args.prefill_ms is None:
        args.prefill_ms = args.step_ms
    return args


async def _main(args: argparse.Namespace, parts: ModelledParts | None) -> None:
    worker = ScriptedWorker(args, parts)
    server = build_server(f"{args.host}:{args.port}", [
        Service(worker_pb2.DESCRIPTOR.services_by_name["Worker"], worker_pb2_grpc.add_WorkerServicer_to_server, worker),
        Service(common_pb2.DESCRIPTOR.services_by_name["InfoService"],
                common_pb2_grpc.add_InfoServiceServicer_to_server, worker),
    ])
    tasks = [asyncio.create_task(worker.run_engine())]
    if worker.gpu is not None:
        tasks.append(asyncio.create_task(worker.gpu.run()))
    try:
        await serve(server, grace_s=args.drain_grace_s, drain=worker.drain)
    finally:
        for t in tasks:
            t.cancel()


def main(argv: list[str] | None = None,
         add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
         make_parts: Callable[[argparse.Namespace], ModelledParts] | None = None) -> int:
    """Run one worker; ``add_arguments`` / ``make_parts`` plug in a modelled backend."""
    args = parse_args(argv, add_arguments)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_main(args, make_parts(args) if make_parts is not None else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
