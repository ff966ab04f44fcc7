"""The KV transport seam: a toy transport (an in-process mailbox on the CPU) registered from this
file alone, and the same transfer through the registry over it and over the Gloo pair channels;
the registry's names and errors."""
from __future__ import annotations

import itertools
import time
from collections import deque
from concurrent.futures import Future

import pytest
import torch
from kv_pools import check_landed, poisoned_pool, source_pool

from pdserve.common.kv_transfer import (
    FirstTokenRef,
    KvTransferError,
    KvTransport,
    Received,
    gather_blocks,
    get_transport,
    register_transport,
    resolve_transport_name,
    scatter_blocks,
)
from pdserve.common.kv_transfer.blocks import BlockIds, check_block_ids
from pdserve.common.kv_transfer.transfer import parse_first_token
from pdserve.common.kv_transfer.transport import available_transports

pytestmark = pytest.mark.timeout(120)

TOY = "toy-mailbox"
_RECEIVERS: dict[str, ToyReceiver] = {}      # endpoint address -> the receiver listening there
_PORTS = itertools.count(1)


class ToyEndpoint:
    def __init__(self, port: int) -> None:
        self.port = port or next(_PORTS)
        self.local_address = f"toy:{self.port}"

    def close(self) -> None:
        _RECEIVERS.pop(self.local_address, None)


class ToyPending:
    def __init__(self, num_bytes: int, t0: float) -> None:
        self.num_bytes, self._seconds = num_bytes, time.perf_counter() - t0

    def wait(self) -> tuple[int, float]:
        return self.num_bytes, self._seconds


class ToyReceiver:
    """Posts queue per (prefill worker, epoch); a delivery lands in the oldest one."""

    def __init__(self, kv_cache: torch.Tensor, endpoint: ToyEndpoint) -> None:
        self.kv_cache = kv_cache
        self.posts: dict[tuple[str, int], deque[tuple[list[int], Future, bool]]] = {}
        _RECEIVERS[endpoint.local_address] = self

    def post(self, prefill_worker_id: str, epoch: int, block_ids: BlockIds, *,
             with_first_token: bool = False, secret: str = "") -> Future:
        ids = check_block_ids(block_ids, self.kv_cache.shape[0])
        future: Future = Future()
        self.posts.setdefault((prefill_worker_id, int(epoch)), deque()).append((ids, future, with_first_token))
        return future

    def deliver(self, prefill_worker_id: str, epoch: int, blocks: torch.Tensor,
                first_token: tuple[int, float] | None) -> None:
        queue = self.posts.get((prefill_worker_id, epoch))
        if not queue:
            raise KvTransferError(f"no receive posted by {prefill_worker_id} epoch {epoch}")
        ids, future, with_first = queue.popleft()
        scatter_blocks(self.kv_cache, ids, blocks)
        future.set_result(Received(blocks.numel() * blocks.element_size(), None, first_token if with_first else None))

    def close(self) -> None:
        for queue in self.posts.values():
            for _, future, _ in queue:
                future.set_exception(KvTransferError("toy receiver closed"))


class ToySender:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.epochs: dict[str, int] = {}

    def next_epoch(self, decode_worker_id: str) -> int:
        return self.epochs.setdefault(decode_worker_id, 1)

    def pair_secret(self, decode_worker_id: str) -> str:
        return ""

    def start_send(self, decode_worker_id: str, store_address: str, epoch: int, kv_cache: torch.Tensor,
                   block_ids: BlockIds, *, ready_event: torch.cuda.Event | None = None,
                   first_token: FirstTokenRef | None = None) -> ToyPending:
        t0 = time.perf_counter()
        if epoch != self.epochs.get(decode_worker_id):
            raise KvTransferError(f"epoch {epoch} is not the pair's current one")
        blocks = gather_blocks(kv_cache, check_block_ids(block_ids, kv_cache.shape[0]))
        token = parse_first_token(first_token.message()) if first_token is not None else None
        _RECEIVERS[store_address].deliver(self.worker_id, epoch, blocks, token)
        return ToyPending(blocks.numel() * blocks.element_size(), t0)

    def mark_broken(self, decode_worker_id: str, reason: str = "marked broken") -> int:
        self.epochs[decode_worker_id] = self.epochs.get(decode_worker_id, 0) + 1
        return self.epochs[decode_worker_id]

    def close(self) -> None:
        pass


class ToyTransport(KvTransport):
    name = TOY

    def listen(self, host: str, port: int, bind_host: str | None = None) -> ToyEndpoint:
        return ToyEndpoint(port)

    def receiver(self, kv_cache, worker_id, endpoint, timeout) -> ToyReceiver:
        return ToyReceiver(kv_cache, endpoint)

    def sender(self, worker_id: str, timeout: float) -> ToySender:
        return ToySender(worker_id)


register_transport(TOY, f"{__name__}:ToyTransport")


@pytest.mark.parametrize("name", [TOY, "gloo"])
def test_a_transfer_through_the_registry(name):
    """What the workers do, by transport name: listen, receive into a pool, PushKV's post, send."""
    transport = get_transport(name)
    assert transport.name == name
    src, dst = source_pool(1, "float32"), poisoned_pool("float32")
    src_ids, dst_ids = [3, 4, 5, 9], [10, 2, 7, 8]
    token_ids, logprobs = torch.tensor([5, 17]), torch.tensor([-0.5, -1.25])
    endpoint = transport.listen("127.0.0.1", 0)
    receiver = transport.receiver(dst, "decode-0", endpoint, 10.0)
    sender = transport.sender("prefill-0", 10.0)
    try:
        epoch = sender.next_epoch("decode-0")
        future = receiver.post("prefill-0", epoch, dst_ids, with_first_token=True,
                               secret=sender.pair_secret("decode-0"))
        pending = sender.start_send("decode-0", endpoint.local_address, epoch, src, src_ids,
                                    first_token=FirstTokenRef(token_ids, logprobs, 1))
        num_bytes, _ = pending.wait()
        got = future.result(timeout=30)
    finally:
        sender.close()
        receiver.close()
        endpoint.close()
    assert got.num_bytes == num_bytes == len(src_ids) * src[0].numel() * src.element_size()
    assert got.first_token == (17, -1.25)
    assert check_landed(dst, src, src_ids, dst_ids, set(dst_ids)) == []


def test_the_registry_names_and_errors():
    assert {"nccl", "gloo", TOY} <= set(available_transports())
    assert resolve_transport_name("auto", "cuda") == "nccl"
    assert resolve_transport_name("auto", "cpu") == "gloo"
    assert resolve_transport_name(TOY, "cuda") == TOY
    assert get_transport(TOY) is get_transport(TOY)
    with pytest.raises(ValueError, match="unknown KV transport"):
        get_transport("carrier-pigeon")
    with pytest.raises(KvTransferError, match="moves cuda pools"):      # NCCL: GPU pools only
        get_transport("nccl").receiver(poisoned_pool("float32"), "decode-0", ToyEndpoint(0), 1.0)
