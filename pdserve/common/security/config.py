"""What one gRPC port (:class:`ServerSecurity`) and one process's channels to workers
(:class:`ClientSecurity`, set once at start-up) apply: TLS, tokens, reflection. All off by
default for a service started alone: plaintext without authentication (``pdserve up`` makes an
internal token per deployment: :mod:`.deployment`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pdserve.common.security.auth import AuthInterceptor, token_client_interceptors
from pdserve.common.security.tls import ReloadingServerCredentials, TlsFiles, channel_credentials
from pdserve.common.security.tokens import BearerTokens

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSecurity:
    """Security of one listening port: ``tls`` files; ``require_client_cert`` (mutual TLS with
    ``tls.ca``); ``tokens_file`` (accepted bearer tokens); ``accept_peer_cert`` (a verified client
    certificate instead of a token: the internal API); ``reflection``; ``health_port``: a second,
    plaintext port that serves ``grpc.health.v1`` and nothing else, for probes that cannot speak
    this port's TLS or present its client certificate (the kubelet's ``grpc:`` probes); 0 = none."""

    tls: TlsFiles | None = None
    require_client_cert: bool = False
    tokens_file: Path | None = None
    accept_peer_cert: bool = False
    reflection: bool = True
    label: str = "gRPC"
    health_port: int = 0

    def __post_init__(self) -> None:
        if self.tls is not None and not self.tls.has_identity:
            raise ValueError(f"{self.label}: TLS needs a certificate and a key")
        if self.require_client_cert and (self.tls is None or self.tls.ca is None):
            raise ValueError(f"{self.label}: client certificates need TLS and a CA file")
        if not 0 <= self.health_port <= 65535:
            raise ValueError(f"{self.label}: health port {self.health_port} is not a port number")
        if self.tokens_file is not None:
            object.__setattr__(self, "tokens_file", Path(self.tokens_file))
            BearerTokens.from_file(self.tokens_file)  # fail at start-up, not at the first call

    @property
    def authenticates(self) -> bool:
        return self.tokens_file is not None or self.require_client_cert

    def credentials(self) -> grpc.ServerCredentials | None:
        if self.tls is None:
            return None
        return ReloadingServerCredentials(self.tls, self.require_client_cert).credentials()

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        if not self.authenticates:
            return []
        tokens = BearerTokens.from_file(self.tokens_file) if self.tokens_file else None
        return [AuthInterceptor(tokens, accept_peer_cert=self.accept_peer_cert)]

    def describe(self) -> str:
        if self.tls is None:
            transport = "plaintext (no TLS)"
        else:
            transport = "mutual TLS" if self.require_client_cert else "TLS"
        who = [w for w, on in (("bearer tokens", self.tokens_file is not None),
                               ("client certificates", self.require_client_cert)) if on]
        return (f"{transport}, " + (" or ".join(who) if who else "no authentication")
                + ("" if self.reflection else ", reflection off"))


@dataclass(frozen=True)
class ClientSecurity:
    """Security of outgoing channels to workers: ``tls`` (``ca``; ``cert``/``key`` for mutual
    TLS); ``token_file`` (its first token is sent); ``server_name`` (checked in the workers'
    certificates instead of the address host: workers are reached by pod IP)."""

    tls: TlsFiles | None = None
    token_file: Path | None = None
    server_name: str | None = None
    _token: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._read_token()
        if self.server_name and self.tls is None:
            raise ValueError("a TLS server name needs TLS")

    def _read_token(self) -> None:
        if self.token_file is not None:
            object.__setattr__(self, "_token", BearerTokens.from_file(self.token_file).first_token())

    def files_stamp(self) -> tuple:
        """(path, mtime, size) of every credential file, to notice rotation
        (:class:`RenewingChannels`)."""
        paths = [*(self.tls.paths() if self.tls is not None else ()), *filter(None, [self.token_file])]
        return tuple(_stamp(p) for p in paths)

    @property
    def enabled(self) -> bool:
        return self.tls is not None or self._token is not None

    def options(self) -> list[tuple[str, Any]]:
        if self.tls is not None and self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS credentials (with the token as call credentials), or None for plaintext. Reads the
        files now."""
        self._read_token()
        if self.tls is None:
            return None
        creds = channel_credentials(self.tls)
        if self._token is not None:
            creds = grpc.composite_channel_credentials(
                creds, grpc.access_token_call_credentials(self._token))
        return creds

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """Plaintext with a token: the interceptors that add it, one per call kind (the token file
        read now)."""
        self._read_token()
        if self.tls is None and self._token is not None:
            return token_client_interceptors(self._token)
        return []


_default_client = ClientSecurity()


def _stamp(path: Path) -> tuple:
    try:
        st = path.stat()
    except OSError:
        return (str(path), None, None)
    return (str(path), st.st_mtime_ns, st.st_size)


def set_default_client_security(security: ClientSecurity) -> None:
    """The security of every channel this process opens to workers (set once at start-up)."""
    global _default_client
    _default_client = security
    if security.enabled:
        log.info("channels to workers: %s%s", "TLS" if security.tls else "plaintext",
                 " with an internal token" if security.token_file else "")


def default_client_security() -> ClientSecurity:
    return _default_client
