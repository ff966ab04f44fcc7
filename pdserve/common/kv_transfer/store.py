"""The TCPStore a decode worker hosts; pair channels rendezvous through it, each under its own
secret prefix (channel.py). Only short rendezvous keys go through it; ``bind_host`` restricts
listening to one address (TCPStore alone listens on every interface).
"""
from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

from .errors import KvTransferError

_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (IPv6 hosts in brackets) -> ``(host, port)``."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise KvTransferError(f"bad store address {address!r}; expected 'host:port'")
    return host.strip("[]"), int(port)


def connect_store(address: str, timeout: float) -> dist.TCPStore:
    """A client connection to the store at ``address`` (raises KvTransferError)."""
    host, port = split_address(address)
    try:
        return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout),
                             wait_for_workers=False)
    except Exception as e:  # DistNetworkError, DistStoreError, RuntimeError
        raise KvTransferError(f"cannot connect to KV store {address}: {e}") from e


def _listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host`` (a name is resolved; its first address)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise KvTransferError(f"cannot resolve KV store bind address {host!r}: {e}") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(512)
    except OSError as e:
        sock.close()
        raise KvTransferError(f"cannot bind KV store to {host}:{port}: {e}") from e
    return sock


class KvStoreServer:
    """Hosts the decode worker's ``TCPStore`` (master, no fixed world size).

    A wildcard ``host`` is advertised as the host name unless ``advertise_host`` is given;
    ``bind_host`` listens on that address only; ``port`` 0 picks a free one (``.port``).
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 50054, *,
                 advertise_host: str | None = None, timeout: float = 30.0,
                 bind_host: str | None = None) -> None:
        local_host = "127.0.0.1" if host in _WILDCARD_HOSTS else host.strip("[]")
        listen_fd = None
        self._sock: socket.socket | None = None
        if bind_host and bind_host not in _WILDCARD_HOSTS:
            self._sock = _listen_socket(bind_host.strip("[]"), int(port))
            local_host, port = self._sock.getsockname()[:2]
            listen_fd = self._sock.fileno()
        try:
            self._store: dist.TCPStore | None = dist.TCPStore(
                local_host, int(port), None, True, datetime.timedelta(seconds=timeout),
                wait_for_workers=False, master_listen_fd=listen_fd)
        except Exception as e:
            if self._sock is not None:
                self._sock.close()
            raise KvTransferError(f"cannot start KV store on port {port}: {e}") from e
        if self._sock is not None:
            self._sock.detach()   # the store owns (and closes) the listening socket now
            self._sock = None
        self._local_host = local_host
        self._port = int(self._store.port)
        if advertise_host:
            self._host = advertise_host
        elif host in _WILDCARD_HOSTS:
            self._host = socket.gethostname()
        else:
            self._host = host
        self._closed = False

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        """``"host:port"`` for ``ReserveResponse.kv_store_address``."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self._port}"

    @property
    def local_address(self) -> str:
        """An address of the store that works from this machine (loopback or the bound one)."""
        host = f"[{self._local_host}]" if ":" in self._local_host else self._local_host
        return f"{host}:{self._port}"

    @property
    def store(self) -> dist.TCPStore:
        if self._store is None:
            raise KvTransferError("KV store is closed")
        return self._store

    def close(self) -> None:
        """Stop serving (the TCPStore server stops when its last reference goes)."""
        self._closed = True
        self._store = None

    def __enter__(self) -> KvStoreServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KvStoreServer({self.address}{', closed' if self._closed else ''})"
