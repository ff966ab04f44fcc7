"""``KvReceiver``: the decode side of the KV transfer protocol (see transfer.py)."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .blocks import DEFAULT_MAX_MESSAGE_BYTES, BlockIds, bytes_per_block, check_block_ids, check_pool
from .channel import DEFAULT_TIMEOUT, PairChannel
from .errors import KvTransferError
from .store import KvStoreServer
from .transfer import _recv_blocks_on

log = logging.getLogger(__name__)

class Received(NamedTuple):
    """What a receive future resolves to."""
    num_bytes: int
    event: torch.cuda.Event | None          # CUDA: after the scatter; the decode step waits on it
    first_token: tuple[int, float] | None     # (token id, logprob) when posted with_first_token


@dataclass
class _Post:
    epoch: int
    ids: list[int]
    future: Future
    posted_at: float
    with_first_token: bool = False
    secret: str = ""          # the epoch's rendezvous secret (PushKV.pair_secret)


class _RecvPeer:
    """The receive state of one prefill worker; its thread runs the posts in order."""

    def __init__(self, owner: KvReceiver, prefill_id: str) -> None:
        self.owner = owner
        self.prefill_id = prefill_id
        self.cond = threading.Condition()
        self.queue: deque[_Post] = deque()
        self.epoch: int | None = None        # newest epoch posted
        self.broken_epoch: int | None = None  # an epoch known broken on this side
        self.channel: PairChannel | None = None
        self.stream = (torch.cuda.Stream(owner.kv_cache.device)
                       if owner.kv_cache.is_cuda else None)
        self.staging: list | None = None if owner.kv_cache.is_cuda else [None, None]
        self.stopping = False
        self.busy = False                    # a receive is running (under cond)
        self.last_used = time.monotonic()    # end of the channel's last receive
        self.thread = threading.Thread(target=self._run, name=f"kv-recv-{prefill_id}",
                                       daemon=True)

    # called under self.cond
    def _superseded(self, epoch: int) -> bool:
        return self.stopping or (self.epoch is not None and epoch < self.epoch)

    def _run(self) -> None:
        owner = self.owner
        if owner.kv_cache.is_cuda:
            torch.cuda.set_device(owner.kv_cache.device)
        while True:
            with self.cond:
                while not self.queue and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    break
                item = self.queue.popleft()
                superseded = self._superseded(item.epoch)
                broken = item.epoch == self.broken_epoch
                self.busy = True
            try:
                self._receive(item, superseded, broken)
            finally:
                with self.cond:
                    self.busy = False
                    self.last_used = time.monotonic()
        with self.cond:
            ch, self.channel = self.channel, None
            left = list(self.queue)
            self.queue.clear()
        if ch is not None:
            ch.close()
        for item in left:
            _fail(item, KvTransferError(f"KV receiver closed; receive from {self.prefill_id} "
                                        f"epoch {item.epoch} cancelled"))

    def close_if_idle(self, now: float, idle_s: float) -> bool:
        """Close the channel if unused for ``idle_s`` with nothing queued or running; its epoch
        is then refused (the sender closes after half that and moves to a new epoch)."""
        with self.cond:
            ch = self.channel
            if ch is None or self.busy or self.queue or now - self.last_used < idle_s:
                return False
            self.channel = None
            self.broken_epoch = ch.epoch
        ch.close()
        return True

    def _receive(self, item: _Post, superseded: bool, broken: bool) -> None:
        owner = self.owner
        if superseded:
            _fail(item, KvTransferError(
                f"KV receive from {self.prefill_id} epoch {item.epoch} superseded by epoch "
                f"{self.epoch}: the sender restarted its channel; nothing was received"))
            return
        if broken:
            _fail(item, KvTransferError(
                f"KV receive from {self.prefill_id}: channel epoch {item.epoch} is broken"))
            return
        try:
            ch = self._channel_for(item.epoch, item.secret)
            deadline = time.monotonic() + owner.timeout
            nbytes, first = _recv_blocks_on(ch, owner.kv_cache, item.ids,
                                            owner.max_message_bytes, deadline, self.staging,
                                            item.with_first_token)
            event = ch.record_event()
            item.future.set_result(Received(nbytes, event, first))
        except Exception as e:  # noqa: BLE001 - every failure goes to the future
            with self.cond:
                if not self._superseded(item.epoch):
                    self.broken_epoch = item.epoch
                failed, self.channel = self.channel, None
            if failed is not None:
                failed.close()
            if self.staging is not None:
                self.staging = [None, None]  # an aborted receive may still write the old
            err = e if isinstance(e, KvTransferError) else KvTransferError(str(e))
            _fail(item, KvTransferError(
                f"KV receive of {len(item.ids)} blocks from {self.prefill_id} epoch "
                f"{item.epoch} failed: {err}"))

    def _channel_for(self, epoch: int, secret: str = "") -> PairChannel:
        ch = self.channel
        if ch is not None and ch.epoch == epoch and not ch.is_broken:
            if ch.secret != secret:
                raise KvTransferError(f"PushKV from {self.prefill_id} epoch {epoch} carries another "
                                      "pair secret than the one its channel was built with")
            return ch
        if ch is not None:
            ch.close()
            self.channel = None
        owner = self.owner

        def cancel() -> bool:
            with self.cond:
                return self._superseded(epoch)

        ch = PairChannel(owner.store_address, self.prefill_id, owner.decode_worker_id, epoch,
                         1, owner.kv_cache.device, timeout=owner.timeout, stream=self.stream,
                         cancel=cancel, secret=secret)
        with self.cond:
            if self._superseded(epoch):
                ch.close()
                raise KvTransferError(f"epoch {epoch} superseded while joining")
            self.channel = ch
        return ch


def _fail(item: _Post, exc: BaseException) -> None:
    if not item.future.done():
        item.future.set_exception(exc)


class KvReceiver:
    """Decode side: receives blocks into the local pool, in post order per prefill worker.

    ``post`` (PushKV handler) returns a Future of ``Received`` once the blocks are in
    ``kv_cache``, or of ``KvTransferError``. The blocks must stay reserved until the future is
    done, whatever the request's fate: the sender may still be writing them. One daemon thread,
    pair channel (rank 1) and CUDA side stream per prefill worker. ``timeout`` bounds each
    receive from its start and each join; ``max_message_bytes`` must equal the senders';
    channels idle for ``idle_close_s`` close at the next post and their epoch is refused.
    """

    def __init__(self, kv_cache: torch.Tensor, decode_worker_id: str,
                 store: KvStoreServer | str, *, timeout: float = DEFAULT_TIMEOUT,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 idle_close_s: float | None = None) -> None:
        from pdserve.common import env
        check_pool(kv_cache)
        self.idle_close_s = 2 * env.kv_idle_close_s() if idle_close_s is None else float(idle_close_s)
        self.num_channels_closed_idle = 0
        self.kv_cache = kv_cache
        self.decode_worker_id = decode_worker_id
        self.store_address = store.local_address if isinstance(store, KvStoreServer) else store
        self.timeout = float(timeout)
        self.max_message_bytes = int(max_message_bytes)
        self.block_bytes = bytes_per_block(kv_cache)
        self._peers: dict[str, _RecvPeer] = {}
        self._lock = threading.Lock()
        self._closed = False

    def expected_bytes(self, num_blocks: int) -> int:
        """Bytes a transfer of ``num_blocks`` blocks carries (to check PushKV.num_bytes)."""
        return int(num_blocks) * self.block_bytes

    def num_open_channels(self) -> int:
        with self._lock:
            peers = list(self._peers.values())
        return sum(1 for p in peers if p.channel is not None)

    def close_idle(self, now: float | None = None) -> int:
        """Close the channels unused for ``idle_close_s``; returns how many were closed."""
        if self.idle_close_s <= 0:
            return 0
        now = time.monotonic() if now is None else now
        with self._lock:
            peers = list(self._peers.values())
        n = sum(1 for p in peers if p.close_if_idle(now, self.idle_close_s))
        self.num_channels_closed_idle += n
        return n

    def epoch_of(self, prefill_worker_id: str) -> int | None:
        """The newest epoch posted by this prefill worker (None if none yet)."""
        peer = self._peers.get(prefill_worker_id)
        return None if peer is None else peer.epoch

    def post(self, prefill_worker_id: str, epoch: int, block_ids: BlockIds, *,
             with_first_token: bool = False, secret: str = "") -> Future:
        """Post the receive announced by one PushKV. Raises ``KvTransferError`` at once (PushKV
        answers an error, nothing is sent) for a stale or broken epoch or bad block ids."""
        epoch = int(epoch)
        ids = check_block_ids(block_ids, self.kv_cache.shape[0])
        self.close_idle()
        if with_first_token and not ids:
            raise KvTransferError("a first token travels after at least one block")
        with self._lock:
            if self._closed:
                raise KvTransferError("KvReceiver is closed")
            peer = self._peers.get(prefill_worker_id)
            if peer is None:
                peer = self._peers[prefill_worker_id] = _RecvPeer(self, prefill_worker_id)
                peer.thread.start()
        future: Future = Future()
        future.set_running_or_notify_cancel()  # not cancellable: the data may be in flight
        to_abort = None
        with peer.cond:
            if peer.epoch is not None and epoch < peer.epoch:
                raise KvTransferError(
                    f"stale channel epoch {epoch} from {prefill_worker_id} (current "
                    f"{peer.epoch})")
            if epoch == peer.broken_epoch:
                raise KvTransferError(
                    f"channel epoch {epoch} from {prefill_worker_id} is broken on this decode "
                    "worker; use a new epoch")
            if peer.epoch is None or epoch > peer.epoch:
                peer.epoch = epoch
                ch = peer.channel
                if ch is not None and ch.epoch != epoch:
                    to_abort = ch
            if not ids:
                future.set_result(Received(0, None, None))
            else:
                peer.queue.append(_Post(epoch, ids, future, time.monotonic(), with_first_token, secret))
                peer.cond.notify()
        if to_abort is not None:
            to_abort.abort(f"superseded by epoch {epoch}")
        return future

    def drop_peer(self, prefill_worker_id: str, join_timeout: float = 1.0) -> None:
        """Forget a prefill worker: stop its thread, close its channel, fail its receives."""
        with self._lock:
            peer = self._peers.pop(prefill_worker_id, None)
        if peer is not None:
            self._stop(peer, join_timeout)

    @staticmethod
    def _signal_stop(peer: _RecvPeer) -> None:
        """Tell the peer's thread to stop and abort its channel (a receive in flight fails)."""
        with peer.cond:
            peer.stopping = True
            ch = peer.channel
            peer.cond.notify_all()
        if ch is not None:
            ch.abort("receiver closed")

    def _stop(self, peer: _RecvPeer, join_timeout: float) -> None:
        self._signal_stop(peer)
        peer.thread.join(join_timeout)

    def close(self, join_timeout: float = 2.0) -> None:
        """Stop every thread and channel; pending receives fail. A thread in a Gloo receive ends
        at its timeout (daemon threads)."""
        with self._lock:
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
        for peer in peers:
            self._signal_stop(peer)
        deadline = time.monotonic() + join_timeout
        for peer in peers:
            peer.thread.join(max(0.0, deadline - time.monotonic()))
            with peer.cond:
                left = list(peer.queue)
                peer.queue.clear()
            for item in left:
                _fail(item, KvTransferError("KvReceiver closed"))

    def __enter__(self) -> KvReceiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
