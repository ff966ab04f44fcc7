"""KV transports by name, imported lazily (as the attention backends are): ``"nccl"`` (pair
channels between GPUs), ``"gloo"`` (the same channels between CPU pools), ``"auto"`` (``AUTO``'s
transport for the pool's device type). A new transport is one module with a :class:`KvTransport`
subclass plus one line in ``_REGISTRY`` (or a :func:`register_transport` call).

A transport makes the three parts of a KV handoff: the decode worker's :class:`Endpoint`
(``listen``, before its model loads; its address reaches prefill workers through the router's
Reserve), the decode worker's :class:`Receiver` (into its pool) and the prefill worker's
:class:`Sender`. One transfer, the same for every transport (PushKV carries the epoch and the
secret; the prefill worker never has two PushKV in flight to one decode worker)::

    prefill: epoch = sender.next_epoch(d); PushKV(epoch, sender.pair_secret(d))
             sender.start_send(d, endpoint address, epoch, pool, ids, ...).wait()
    decode:  receiver.post(p, epoch, ids, with_first_token=..., secret=...) -> Future of Received

Errors are ``KvTransferError``; a failed send bumps the pair's epoch (``Sender``'s contract).
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import NamedTuple, Protocol

import torch

from .blocks import BlockIds
from .transfer import FirstTokenRef

_REGISTRY: dict[str, str] = {
    "nccl": "pdserve.common.kv_transfer.pair_transport:NcclTransport",
    "gloo": "pdserve.common.kv_transfer.pair_transport:GlooTransport",
}
_INSTANCES: dict[str, KvTransport] = {}

# What "auto" names, per device type of the KV pool.
AUTO: dict[str, str] = {"cuda": "nccl", "cpu": "gloo"}


class Received(NamedTuple):
    """What a receive future resolves to."""
    num_bytes: int
    event: torch.cuda.Event | None          # CUDA: after the scatter; the decode step waits on it
    first_token: tuple[int, float] | None     # (token id, logprob) when posted with_first_token


class Endpoint(Protocol):
    """Where a decode worker's receives rendezvous: listening on ``port``, reachable on this
    host at ``local_address``; ``close`` stops it."""

    @property
    def port(self) -> int: ...

    @property
    def local_address(self) -> str: ...

    def close(self) -> None: ...


class Pending(Protocol):
    """A started send: ``wait()`` returns ``(num_bytes, seconds since start)`` or raises
    ``KvTransferError`` (the pair's epoch is then bumped); a second wait returns the same."""

    @property
    def num_bytes(self) -> int: ...

    def wait(self) -> tuple[int, float]: ...


class Sender(Protocol):
    """The prefill side: ships blocks of its pool to decode workers, one pair per decode worker."""

    def next_epoch(self, decode_worker_id: str) -> int:
        """The epoch the next PushKV to this decode worker carries."""
        ...

    def pair_secret(self, decode_worker_id: str) -> str:
        """The current epoch's secret for PushKV ("" when the transport has none)."""
        ...

    def start_send(self, decode_worker_id: str, store_address: str, epoch: int, kv_cache: torch.Tensor,
                   block_ids: BlockIds, *, ready_event: torch.cuda.Event | None = None,
                   first_token: FirstTokenRef | None = None) -> Pending:
        """Start sending ``block_ids`` of ``kv_cache`` for the receive the PushKV of ``epoch``
        posted; bad input or a failed start raises ``KvTransferError`` now."""
        ...

    def mark_broken(self, decode_worker_id: str, reason: str = "marked broken") -> int:
        """Give up the pair's channel (a PushKV's outcome is unknown); returns the new epoch."""
        ...

    def close(self) -> None: ...


class Receiver(Protocol):
    """The decode side: receives blocks into its pool, in post order per prefill worker."""

    def post(self, prefill_worker_id: str, epoch: int, block_ids: BlockIds, *,
             with_first_token: bool = False, secret: str = "") -> Future:
        """Post the receive one PushKV announced; a Future of :class:`Received`. The blocks stay
        reserved until it is done. A refused post (stale or broken epoch, bad ids) raises
        ``KvTransferError`` at once."""
        ...

    def close(self) -> None: ...


class KvTransport(ABC):
    """One way to move KV blocks between workers' pools (module docstring)."""
    name: str = "abstract"

    @abstractmethod
    def listen(self, host: str, port: int, bind_host: str | None = None) -> Endpoint:
        """The decode worker's endpoint on ``port`` (0: a free one), advertised under ``host``."""

    @abstractmethod
    def receiver(self, kv_cache: torch.Tensor, worker_id: str, endpoint: Endpoint, timeout: float) -> Receiver:
        """The decode worker's receiver into ``kv_cache``; ``timeout`` bounds each receive (s)."""

    @abstractmethod
    def sender(self, worker_id: str, timeout: float) -> Sender:
        """The prefill worker's sender; ``timeout`` bounds each send (s)."""


def register_transport(name: str, target: str) -> None:
    """Register ``"module.path:ClassName"`` under ``name`` (imported on first use)."""
    _REGISTRY[name] = target
    _INSTANCES.pop(name, None)


def available_transports() -> list[str]:
    return sorted(_REGISTRY)


def resolve_transport_name(name: str, device_type: str) -> str:
    """``"auto"`` -> ``AUTO[device_type]`` (``"cpu"``'s for an unknown type); any other name unchanged."""
    if name != "auto":
        return name
    return AUTO.get(device_type, AUTO["cpu"])


def get_transport(name: str) -> KvTransport:
    """The transport registered as ``name``; raises ValueError for an unknown name and
    ImportError when its module cannot be imported."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(available_transports())}")
    if name not in _INSTANCES:
        module_name, class_name = _REGISTRY[name].split(":")
        _INSTANCES[name] = getattr(importlib.import_module(module_name), class_name)()
    return _INSTANCES[name]
