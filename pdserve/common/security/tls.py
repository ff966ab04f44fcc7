"""TLS material from PEM files: server credentials re-read at the next handshake when a file
changes (a set that fails to load is logged and the previous one kept), and client credentials
read when a channel is made.
"""
from __future__ import annotations

import logging
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsFiles:
    """One party's TLS files: ``cert``/``key`` (both or neither) and ``ca``, the bundle peers
    must chain to (server: client certificates then required; client: else the system roots)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS: a certificate needs its key and a key its certificate "
                             f"(cert={self.cert}, key={self.key})")
        for name in ("cert", "key", "ca"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
                if not Path(value).is_file():
                    raise ValueError(f"TLS {name} file {value} does not exist")

    @property
    def has_identity(self) -> bool:
        return self.cert is not None

    def identity(self) -> tuple[Path, Path]:
        """(cert, key); ValueError when this party has none."""
        if self.cert is None or self.key is None:
            raise ValueError("TLS: no certificate and key given")
        return self.cert, self.key

    def paths(self) -> tuple[Path, ...]:
        return tuple(p for p in (self.cert, self.key, self.ca) if p is not None)


def _read(path: Path | None) -> bytes | None:
    return None if path is None else path.read_bytes()


def check_key_pair(cert: Path, key: Path) -> None:
    """Raise ``ssl.SSLError``/``OSError`` unless ``key`` is the private key of ``cert``."""
    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(str(cert), str(key))


class ReloadingServerCredentials:
    """A server's TLS material, re-read when its files change; ``require_client_cert``: mutual TLS."""

    def __init__(self, files: TlsFiles, require_client_cert: bool) -> None:
        if not files.has_identity:
            raise ValueError("a TLS server needs a certificate and a key")
        if require_client_cert and files.ca is None:
            raise ValueError("requiring client certificates needs a CA file to check them")
        self.files = files
        self.require_client_cert = require_client_cert
        self._lock = threading.Lock()
        self._stamp = self._file_stamp()
        self.reloads = 0
        self._initial = self._load()

    def _file_stamp(self) -> tuple[tuple[int, int, int] | None, ...]:
        stamps: list[tuple[int, int, int] | None] = []
        for p in self.files.paths():
            try:
                st = p.stat()
                stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                stamps.append(None)
        return tuple(stamps)

    def _load(self) -> grpc.ServerCertificateConfiguration:
        cert, key = self.files.identity()
        check_key_pair(cert, key)
        return grpc.ssl_server_certificate_configuration(
            [(key.read_bytes(), cert.read_bytes())], root_certificates=_read(self.files.ca))

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpc's fetcher: a new configuration when the files changed, else None (keep)."""
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return None
        with self._lock:
            if stamp == self._stamp:
                return None
            self._stamp = stamp
            try:
                config = self._load()
            except (OSError, ssl.SSLError, ValueError) as e:
                log.warning("TLS files %s changed but cannot be loaded (%s); keeping the "
                            "previous certificate", ", ".join(map(str, self.files.paths())), e)
                return None
            self.reloads += 1
            log.info("TLS certificate %s re-read (reload %d)", self.files.cert, self.reloads)
            return config

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self.fetch, require_client_authentication=self.require_client_cert)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Client credentials: trust ``files.ca`` (system roots when None), present ``cert``/``key``
    when given (mutual TLS). Files are read now."""
    if files.has_identity:
        check_key_pair(*files.identity())
    return grpc.ssl_channel_credentials(
        root_certificates=_read(files.ca), private_key=_read(files.key),
        certificate_chain=_read(files.cert))
