"""uvicorn serving the API inside the router's own event loop, beside the gRPC server.

The listening socket is bound when the server is made, so a taken port fails the router at
start-up with a clear error (uvicorn itself would exit the process). uvicorn's own signal
handling is left out: the router's shutdown (``pdserve.common.grpc_utils.serve``) owns SIGTERM and
stops this server after its drain.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import ssl
from typing import TYPE_CHECKING, TypedDict

import uvicorn

from pdserve.common.grpc_utils import Unavailable

if TYPE_CHECKING:
    from pdserve.common.security import ServerSecurity, TlsFiles
    from pdserve.router.flow import Flow
    from pdserve.router.servicer import GenerationServicer

log = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone."""

    def capture_signals(self):  # noqa: D401 - uvicorn's hook
        return contextlib.nullcontext()


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one); Unavailable if taken."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        raise Unavailable(f"cannot bind the HTTP port {host}:{port}: {e}") from e
    sock.setblocking(False)
    return sock


class _SslArgs(TypedDict, total=False):
    """uvicorn.Config's TLS keywords (none: plain HTTP)."""
    ssl_certfile: str
    ssl_keyfile: str
    ssl_ca_certs: str | None
    ssl_cert_reqs: int


class HttpServer:
    """An ASGI app on a bound socket, started and stopped from the router's loop.

    ``tls`` (a ``pdserve.common.security.tls.TlsFiles``): HTTPS with that certificate and key, and
    client certificates of ``tls.ca`` required when ``require_client_cert``. The files are
    read once, at start-up.
    """

    def __init__(self, app, host: str, port: int, keep_alive_s: int = 5, tls: TlsFiles | None = None,
                 require_client_cert: bool = False) -> None:
        self.sock = bind(host, port)
        self.host = host
        self.port: int = self.sock.getsockname()[1]
        self.scheme = "https" if tls is not None else "http"
        ssl_args: _SslArgs = {} if tls is None else {
            "ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key),
            "ssl_ca_certs": str(tls.ca) if tls.ca else None,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE}
        config = uvicorn.Config(app, http="auto", ws="none", lifespan="off", log_config=None,
                                access_log=False, proxy_headers=False, timeout_keep_alive=keep_alive_s, **ssl_args)
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)    # its start/stop lines: ours say it
        self.server = _EmbeddedServer(config)
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()      # raises what failed
                raise Unavailable("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        log.info("OpenAI HTTP API listening on %s://%s:%d/v1", self.scheme, self.host or "0.0.0.0", self.port)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting, let open responses end (up to ``grace_s``), then close everything."""
        if self.task is None:
            self.sock.close()
            return
        self.server.config.timeout_graceful_shutdown = max(1, int(grace_s))
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), grace_s + 2.0)
        except asyncio.TimeoutError:
            self.server.force_exit = True
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        self.task = None
        log.info("OpenAI HTTP API on port %d stopped", self.port)


def from_args(args: argparse.Namespace, servicer: GenerationServicer, flow: Flow,
              security: ServerSecurity | None = None) -> HttpServer | None:
    """The router's HTTP server for its flags (None with ``--http-port 0``), its port bound.

    ``security`` (the public port's ``pdserve.common.security.ServerSecurity``): its bearer tokens
    (``--auth-tokens-file``) and TLS files apply to both front doors.
    """
    from pdserve.router.openai_api.app import build_app
    from pdserve.router.openai_api.front import OpenAIFront
    from pdserve.router.openai_api.settings import HttpSettings

    settings = HttpSettings.from_args(args)
    if not settings.enabled:
        return None
    auth = tls = None
    if security is not None and security.tokens_file is not None:
        from pdserve.common.security.tokens import BearerTokens
        auth = BearerTokens.from_file(security.tokens_file)
    if security is not None:
        tls = security.tls
    front = OpenAIFront(servicer, flow, settings.served_model_names, aliases=(args.model,))
    return HttpServer(build_app(front, auth, settings.max_body_bytes), settings.host, settings.port, tls=tls,
                      require_client_cert=bool(security is not None and security.require_client_cert))
