"""The registry of workers behind the router: static addresses and DNS-discovered pods.

``host:port`` is one worker; ``dns:///name:port`` is re-resolved every ``--dns-refresh-s``, one
worker per IP; a worker whose IP leaves DNS is retired and closed once idle. Registration
(``Info``) checks protocol_version "v1", the role, block_size and vocab_size; a different model
name is only logged.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

from pdserve.common.grpc_utils.protocol import PROTOCOL_VERSION
from pdserve.common.worker_types import DECODE_ROLES, PREFILL_CAPABLE, Role, WorkerInfo
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.settings import RouterSettings
from pdserve.router.tokenization import ModelSpec
from pdserve.router.worker_client import WorkerClient

log = logging.getLogger(__name__)

PREFILL_ROLES = frozenset({Role.PREFILL})       # what --prefill takes


def parse_addresses(value: str | Iterable[str] | None) -> list[str]:
    """A comma-separated list (or a list) of addresses, blanks dropped."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [a.strip() for a in items if a and a.strip()]


def split_dns_target(address: str) -> tuple[str, int] | None:
    """``dns:///name:port`` (or ``dns://authority/name:port``) -> (name, port); None otherwise."""
    if not address.startswith("dns:"):
        return None
    rest = address[len("dns:"):]
    if rest.startswith("//"):
        rest = rest[2:].split("/", 1)[1] if "/" in rest[2:] else ""
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"worker address {address!r}: expected dns:///name:port")
    return host.strip("[]"), int(port)


def _format(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({_format(str(info[4][0]), port) for info in infos})   # an IP string for AF_INET(6)


class WorkerRegistry:
    def __init__(self, settings: RouterSettings, spec: ModelSpec, prefill: Iterable[str],
                 decode: Iterable[str], prefix_index: PrefixIndex | None = None) -> None:
        self.settings = settings
        self.spec = spec
        self.block_size = settings.block_size
        self.prefix_index = prefix_index or PrefixIndex()
        self.clients: dict[str, WorkerClient] = {}
        self._targets: list[tuple[str, frozenset[Role]]] = (
            [(a, PREFILL_ROLES) for a in parse_addresses(prefill)]
            + [(a, DECODE_ROLES) for a in parse_addresses(decode)])
        self._dns_tasks: list[asyncio.Task] = []
        self._listeners: list = []
        # Usable decode / prefill-capable workers, rebuilt after a change: every change of a
        # client's ``up`` or ``info`` is reported through its ``on_change`` (= _changed), and
        # ``retired`` / membership change only here, followed by _changed.
        self._views: tuple[list[WorkerClient], list[WorkerClient]] | None = None

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self, initial_wait_s: float) -> None:
        """Add every worker and wait (bounded) for each one's first registration attempt."""
        for address, roles in self._targets:
            target = split_dns_target(address)
            if target is None:
                self._add(address, roles)
            else:
                await self._refresh(address, target, roles)
                self._dns_tasks.append(asyncio.create_task(self._dns_loop(address, target, roles)))
        waits = [c.first_attempt.wait() for c in self.clients.values()]
        if waits:
            await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=initial_wait_s)

    async def stop(self) -> None:
        for task in self._dns_tasks:
            task.cancel()
        await asyncio.gather(*(c.close() for c in self.clients.values()), return_exceptions=True)
        self.clients.clear()
        self._views = None

    def add_listener(self, fn) -> None:
        self._listeners.append(fn)

    def _changed(self) -> None:
        self._views = None
        self.update_kv_wanted()
        for fn in self._listeners:
            fn()

    def update_kv_wanted(self) -> None:
        """Consume KV events only from workers with a usable peer in a pool they belong to:
        the decode pool (decode, both) or the prefill pool (prefill, both; a both worker is a
        place to prefill for itself and for others, see pdserve.router.pd_policy). The prefix index
        only ranks two or more candidates, and the events of a lone worker would cost the
        router a message per request for nothing."""
        up = [c for c in self.clients.values() if c.usable and c.info is not None]
        decoders = sum(1 for c in up if c.can_decode)
        prefillers = sum(1 for c in up if c.role in PREFILL_CAPABLE)
        for c in self.clients.values():
            ok = c.usable and c.info is not None
            c.set_kv_wanted(ok and ((c.can_decode and decoders > 1) or (c.role in PREFILL_CAPABLE and prefillers > 1)))

    def _add(self, address: str, roles: AbstractSet[Role]) -> None:
        self._views = None
        client = self.clients.get(address)
        if client is not None:
            client.expected_roles |= roles
            client.retired = False
            return
        client = WorkerClient(address, roles, self.settings, self.prefix_index, self._check_info, self._changed)
        self.clients[address] = client
        client.start()

    # ---- DNS --------------------------------------------------------------------------
    async def _dns_loop(self, address: str, target: tuple[str, int], roles: AbstractSet[Role]) -> None:
        while True:
            await asyncio.sleep(self.settings.dns_refresh_s)
            await self._refresh(address, target, roles)

    async def _refresh(self, address: str, target: tuple[str, int], roles: AbstractSet[Role]) -> None:
        try:
            found = set(await resolve(*target))
        except OSError as e:
            log.warning("cannot resolve %s: %s (keeping the workers known so far)", address, e)
            return
        owned = {k for k, c in self.clients.items() if c.dns_source == address}
        for key in sorted(found - owned):
            self._add(key, roles)
            self.clients[key].dns_source = address
            log.info("%s: new worker %s", address, key)
        for key in owned - found:
            self.clients[key].retired = True
            log.info("%s: worker %s left DNS; retired", address, key)
        for key in [k for k in owned if self.clients[k].retired and self.clients[k].inflight == 0]:
            client = self.clients.pop(key)
            await client.close()
        self._changed()

    # ---- registration check -----------------------------------------------------------
    def _check_info(self, client: WorkerClient, info: WorkerInfo) -> str | None:
        role = info.role.value if info.role is not None else "unspecified"
        if info.protocol_version != PROTOCOL_VERSION:
            return f"protocol_version {info.protocol_version!r}, the router speaks {PROTOCOL_VERSION!r}"
        if info.role not in client.expected_roles:
            wanted = ", ".join(sorted(r.value for r in client.expected_roles))
            return f"role {role}, expected {wanted} (check --prefill / --decode)"
        if info.block_size <= 0:
            return "block_size 0"
        if self.block_size and info.block_size != self.block_size:
            return f"block_size {info.block_size}, the deployment uses {self.block_size}"
        if info.vocab_size and info.vocab_size != self.spec.vocab_size:
            return f"vocab_size {info.vocab_size}, the router's model {self.spec.name!r} has {self.spec.vocab_size}"
        if info.model and info.model != self.spec.name:
            log.warning("worker %s serves model %r, the router has %r", client.key, info.model, self.spec.name)
        if not self.block_size:
            self.block_size = info.block_size
            log.info("block size %d (from worker %s)", self.block_size, client.key)
        return None

    # ---- views ------------------------------------------------------------------------
    def _usable(self) -> tuple[list[WorkerClient], list[WorkerClient]]:
        if self._views is None:
            up = [c for c in self.clients.values() if c.usable]
            self._views = ([c for c in up if c.can_decode], [c for c in up if c.role in PREFILL_CAPABLE])
        return self._views

    def decode_workers(self, exclude: Iterable[str] = ()) -> list[WorkerClient]:
        """Usable workers of roles decode and both (a shared list when nothing is excluded: do
        not modify it)."""
        decoders = self._usable()[0]
        return [c for c in decoders if c.key not in exclude] if exclude else decoders

    def prefill_workers(self, exclude: Iterable[str] = ()) -> list[WorkerClient]:
        """Workers that can prefill a request for another one: roles prefill and both (shared
        like ``decode_workers``)."""
        prefillers = self._usable()[1]
        return [c for c in prefillers if c.key not in exclude] if exclude else prefillers

    def count_up(self, roles: AbstractSet[Role]) -> int:
        return sum(1 for c in self.clients.values() if c.usable and c.role in roles)

    def max_model_len(self) -> int:
        lens = [c.info.max_model_len for c in self.clients.values() if c.info is not None and c.info.max_model_len]
        return min(lens) if lens else self.spec.max_model_len

    def dtype(self) -> str:
        return next((c.info.dtype for c in self.clients.values() if c.info is not None and c.info.dtype), "")

    def total_inflight(self) -> int:
        return sum(c.inflight for c in self.clients.values())
