"""Many scripted workers in one process (one asyncio loop, one real gRPC server each):

    python -m bench.sim.fleet --role decode --ports 41000,41001,... -- --time-scale 6 ...

Every argument after ``--`` goes to each worker (``bench.sim.worker``'s flags; ``--port``
and ``--role`` are set here). SIGTERM / SIGINT drain every worker of the process (health
NOT_SERVING, new requests refused, those in flight finish within ``--drain-grace-s``).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from bench.sim import worker as sim_worker
from pdserve.common.grpc_utils import Service, build_server
from pdserve.loadtest import scripted_worker as sw
from pdserve.v1 import common_pb2, common_pb2_grpc, worker_pb2, worker_pb2_grpc

log = logging.getLogger("sim.fleet")


async def _run(role: str, ports: list[int], worker_argv: list[str]) -> None:
    servers, workers, tasks = [], [], []
    for port in ports:
        args = sim_worker.parse_args(["--port", str(port), "--role", role, *worker_argv])
        w = sw.ScriptedWorker(args, sim_worker.make_parts(args))
        server = build_server(f"{args.host}:{port}", [
            Service(worker_pb2.DESCRIPTOR.services_by_name["Worker"], worker_pb2_grpc.add_WorkerServicer_to_server, w),
            Service(common_pb2.DESCRIPTOR.services_by_name["InfoService"],
                    common_pb2_grpc.add_InfoServiceServicer_to_server, w)])
        await server.start()
        await server.set_serving(True)
        servers.append(server)
        workers.append(w)
        tasks.append(asyncio.create_task(w.run_engine()))
        if w.gpu is not None:
            tasks.append(asyncio.create_task(w.gpu.run()))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("%d %s workers on ports %s", len(ports), role, ports)
    await stop.wait()
    grace = workers[0].args.drain_grace_s if workers else 1.0
    await asyncio.gather(*(s.shutdown(grace, w.drain) for s, w in zip(servers, workers)))
    for t in tasks:
        t.cancel()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m bench.sim.fleet", description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=sorted(sw.ROLES), required=True)
    p.add_argument("--ports", required=True, help="comma list: one worker per port")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(own)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_run(args.role, [int(x) for x in args.ports.split(",") if x], rest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
