"""The pair-channel transports: a 2-rank process group per (prefill worker, decode worker, epoch)
that rendezvouses through a TCPStore the decode worker hosts (channel.py, store.py), ``KvSender``
on the prefill side, ``KvReceiver`` on the decode side, one pair secret per epoch. ``"nccl"``
moves CUDA pools, ``"gloo"`` CPU pools: the channel's backend follows the pool's device, and
:meth:`PairTransport.receiver` refuses a pool of the other device type."""
from __future__ import annotations

import torch

from .errors import KvTransferError
from .receiver import KvReceiver
from .sender import KvSender
from .store import KvStoreServer
from .transport import Endpoint, KvTransport


class PairTransport(KvTransport):
    device_type: str = ""

    def listen(self, host: str, port: int, bind_host: str | None = None) -> KvStoreServer:
        return KvStoreServer(host, port, bind_host=bind_host)

    def receiver(self, kv_cache: torch.Tensor, worker_id: str, endpoint: Endpoint, timeout: float) -> KvReceiver:
        if kv_cache.device.type != self.device_type:
            raise KvTransferError(f"KV transport {self.name!r} moves {self.device_type} pools, not "
                                  f"{kv_cache.device.type} ones")
        return KvReceiver(kv_cache, worker_id, endpoint.local_address, timeout=timeout)

    def sender(self, worker_id: str, timeout: float) -> KvSender:
        return KvSender(worker_id, timeout=timeout, pair_secrets=True)


class NcclTransport(PairTransport):
    name = "nccl"
    device_type = "cuda"


class GlooTransport(PairTransport):
    name = "gloo"
    device_type = "cpu"
