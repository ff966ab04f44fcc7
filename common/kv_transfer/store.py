"""The TCPStore a decode worker hosts; pair channels rendezvous through it.

Each pair channel lives under its own prefix ``pdserve/{prefill_id}/{decode_id}/{epoch}``, so
one store serves every prefill worker, and a new epoch never sees an old epoch's keys. Only
rendezvous keys (a few short strings per channel) go through the store; no tensors, no
pickle.
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


class KvStoreServer:
    """Hosts the decode worker's ``torch.distributed.TCPStore`` (master, no fixed world size).

    ``host``: the address it is known by; the server listens on all interfaces, and a wildcard
    host (``0.0.0.0``) is advertised as this machine's host name unless ``advertise_host`` is
    given. ``port`` 0 picks a free port (TCPStore binds it itself; ``.port`` tells which).
    """

    def __init__(self, host: str = "0.0.0.0", port: int = 50054, *,
                 advertise_host: str | None = None, timeout: float = 30.0) -> None:
        bind_host = "127.0.0.1" if host in _WILDCARD_HOSTS else host.strip("[]")
        try:
            self._store: dist.TCPStore | None = dist.TCPStore(
                bind_host, int(port), None, True, datetime.timedelta(seconds=timeout),
                wait_for_workers=False)
        except Exception as e:
            raise KvTransferError(f"cannot start KV store on port {port}: {e}") from e
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
        """An address of the store that works from this machine (loopback)."""
        return f"127.0.0.1:{self._port}"

    @property
    def store(self) -> dist.TCPStore:
        if self._store is None:
            raise KvTransferError("KV store is closed")
        return self._store

    def close(self) -> None:
        """Stop serving (the TCPStore server stops when its last reference goes)."""
        self._closed = True
        self._store = None

    def __enter__(self) -> "KvStoreServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KvStoreServer({self.address}{', closed' if self._closed else ''})"
