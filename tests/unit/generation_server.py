"""A ``pdserve.v1.Generation`` servicer served in-process on a free local port, on a thread of its
own (for the load tool's tests): ``with serve(servicer) as address: ...``."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from pdserve.v1 import router_pb2_grpc


@contextmanager
def serve(servicer: router_pb2_grpc.GenerationServicer) -> Iterator[str]:
    ready, done, holder = threading.Event(), threading.Event(), {}

    def run() -> None:
        async def main() -> None:
            server = grpc.aio.server()
            router_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
            holder["port"] = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            ready.set()
            while not done.is_set():
                await asyncio.sleep(0.05)
            await server.stop(0)
        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30)
    try:
        yield f"127.0.0.1:{holder['port']}"
    finally:
        done.set()
        thread.join(10)
