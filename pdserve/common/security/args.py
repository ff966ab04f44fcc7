"""Security flags of the router and the workers (each with a ``PDSERVE_*`` environment default):
``--tls-*``/``--auth-tokens-file`` for the router's public port, ``--internal-*`` for the
internal API (mutual TLS with a CA, or a shared token), ``--reflection`` and ``--health-port``
(a plaintext port with health only, for probes). A worker whose
internal port is open (no token, no mutual TLS) and listens beyond loopback says so in one
WARNING at start.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
from pathlib import Path

from pdserve.common import env
from pdserve.common.security.config import ClientSecurity, ServerSecurity
from pdserve.common.security.tls import TlsFiles

log = logging.getLogger(__name__)


def _path(value: str | None) -> Path | None:
    return Path(value).expanduser() if value else None


def add_public_arguments(p: argparse.ArgumentParser) -> None:
    """The router's public-port flags."""
    p.add_argument("--tls-cert", default=env.get("TLS_CERT"),
                   help="PEM certificate (chain) of the public port; with --tls-key turns TLS on "
                        "(env PDSERVE_TLS_CERT)")
    p.add_argument("--tls-key", default=env.get("TLS_KEY"), help="PEM private key (env PDSERVE_TLS_KEY)")
    p.add_argument("--tls-client-ca", default=env.get("TLS_CLIENT_CA"),
                   help="require client certificates that chain to this CA bundle (env PDSERVE_TLS_CLIENT_CA)")
    add_auth_tokens_argument(p)


def add_auth_tokens_argument(p: argparse.ArgumentParser) -> None:
    """``--auth-tokens-file``: the router's public-API tokens (also a flag of ``pdserve up``)."""
    p.add_argument("--auth-tokens-file", default=env.get("AUTH_TOKENS_FILE"),
                   help="bearer tokens accepted on the public API, one per line; re-read when it changes "
                        "(env PDSERVE_AUTH_TOKENS_FILE)")


def add_internal_tls_arguments(p: argparse.ArgumentParser) -> None:
    """The internal API's mutual-TLS flags (the services' and ``pdserve up``'s)."""
    p.add_argument("--internal-tls-cert", default=env.get("INTERNAL_TLS_CERT"),
                   help="PEM certificate presented on the internal API (env PDSERVE_INTERNAL_TLS_CERT)")
    p.add_argument("--internal-tls-key", default=env.get("INTERNAL_TLS_KEY"),
                   help="its private key (env PDSERVE_INTERNAL_TLS_KEY)")
    p.add_argument("--internal-tls-ca", default=env.get("INTERNAL_TLS_CA"),
                   help="CA bundle internal peers' certificates must chain to (env PDSERVE_INTERNAL_TLS_CA)")
    p.add_argument("--internal-tls-server-name", default=env.get("INTERNAL_TLS_SERVER_NAME"),
                   help="name the workers' certificates are checked for, instead of the address's host "
                        "(env PDSERVE_INTERNAL_TLS_SERVER_NAME)")


def add_internal_arguments(p: argparse.ArgumentParser) -> None:
    """The internal-API flags (router and workers), --reflection and --health-port."""
    add_internal_tls_arguments(p)
    p.add_argument("--internal-token-file", default=env.get("INTERNAL_TOKEN_FILE"),
                   help="internal API token(s), one per line: the first is sent, any is accepted "
                        "(env PDSERVE_INTERNAL_TOKEN_FILE)")
    p.add_argument("--reflection", choices=("on", "off"), default=env.get("REFLECTION", "on"),
                   help="serve gRPC server reflection (env PDSERVE_REFLECTION)")
    add_health_port_argument(p)


def add_health_port_argument(p: argparse.ArgumentParser) -> None:
    """``--health-port``: the plaintext health-only port (the router's and the workers')."""
    p.add_argument("--health-port", type=int, default=env.get_int("HEALTH_PORT", 0),
                   help="also serve grpc.health.v1, and nothing else, in plaintext on this port, for probes "
                        "that cannot speak the gRPC port's TLS (the kubelet's grpc probes); 0 = off "
                        "(env PDSERVE_HEALTH_PORT)")


def internal_tls(args: argparse.Namespace) -> TlsFiles | None:
    """The ``--internal-tls-*`` files, None when none is given; ValueError unless all three are."""
    cert, key, ca = (_path(getattr(args, f"internal_tls_{n}", None)) for n in ("cert", "key", "ca"))
    if cert is None and key is None and ca is None:
        return None
    if cert is None or key is None or ca is None:
        raise ValueError("internal TLS is mutual: --internal-tls-cert, --internal-tls-key and "
                         "--internal-tls-ca are needed together")
    return TlsFiles(cert, key, ca)


def public_server_security(args: argparse.Namespace) -> ServerSecurity:
    cert, key, client_ca = _path(args.tls_cert), _path(args.tls_key), _path(args.tls_client_ca)
    if client_ca is not None and cert is None:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    tls = TlsFiles(cert, key, client_ca) if cert or key else None
    return ServerSecurity(tls=tls, require_client_cert=client_ca is not None,
                          tokens_file=_path(args.auth_tokens_file),
                          reflection=args.reflection == "on", label="public port",
                          health_port=getattr(args, "health_port", 0))


def internal_server_security(args: argparse.Namespace) -> ServerSecurity:
    """A worker's internal port; one WARNING when it is open beyond loopback (``args.host``)."""
    tls = internal_tls(args)
    security = ServerSecurity(tls=tls, require_client_cert=tls is not None,
                              tokens_file=_path(args.internal_token_file), accept_peer_cert=tls is not None,
                              reflection=args.reflection == "on", label="internal port",
                              health_port=getattr(args, "health_port", 0))
    warn_if_open(security, getattr(args, "host", None))
    return security


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine only: localhost or a loopback IP."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:      # a host name: it may resolve to any interface
        return False


def warn_if_open(security: ServerSecurity, host: str | None) -> None:
    """One WARNING when an internal port without authentication listens on ``host`` beyond
    loopback (None: not known, nothing said)."""
    if security.authenticates or host is None or is_loopback(host):
        return
    log.warning("the internal port on %s has no authentication: anyone who reaches it can Reserve KV "
                "blocks, Submit, PushKV and Subscribe to every output; pass --internal-token-file "
                "and/or --internal-tls-cert/--internal-tls-key/--internal-tls-ca (pdserve up makes a "
                "token per deployment)", host)


def internal_client_security(args: argparse.Namespace) -> ClientSecurity:
    tls = internal_tls(args)
    return ClientSecurity(tls=tls, token_file=_path(args.internal_token_file),
                          server_name=(args.internal_tls_server_name or None) if tls else None)
