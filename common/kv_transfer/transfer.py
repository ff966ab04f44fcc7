"""The KV transfer protocol over pair channels: ``KvSender`` (prefill) and ``KvReceiver``
(decode).

Ordering contract (protos/pdserve/v1/worker.proto, PushKV): the decode worker posts its
receives in PushKV call order; the prefill worker sends in the order its PushKV calls
returned and never has two PushKV in flight to the same decode worker. Both sides then issue
the same messages in the same order on the pair channel.

A transfer of ``n`` blocks is cut into ``plan_chunks(n, bytes_per_block, max_message_bytes)``
messages (one message unless it is larger than ``max_message_bytes``). A run of consecutive
block ids is sent from / received into the pool directly; other blocks go through a staging
buffer (``gather_blocks`` / ``scatter_blocks``), double-buffered so that the gather (scatter)
of one chunk overlaps the transfer of the next (previous) one.

Epochs: each (prefill, decode) pair has a current epoch, chosen by the prefill worker and
carried in PushKV. Any failure of a send makes the prefill worker bump its epoch; a post with a
newer epoch makes the decode worker abort the old channel (failing the receives still queued
on it) and join a fresh one. See ``KvSender`` and ``KvReceiver``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .blocks import (DEFAULT_MAX_MESSAGE_BYTES, BlockIds, bytes_per_block, check_block_ids,
                     check_pool, contiguous_range, gather_blocks, plan_chunks, scatter_blocks)
from .channel import DEFAULT_TIMEOUT, PairChannel
from .errors import KvTransferError
from .store import KvStoreServer

log = logging.getLogger(__name__)


def initial_epoch() -> int:
    """A fresh epoch for a new sender: microseconds since the Unix epoch, so that a restarted
    prefill worker always uses a larger epoch than its previous incarnation did."""
    return time.time_ns() // 1000


# ============================================================================ data path
def _staging(slots: list, slot: int, n: int, kv_cache: torch.Tensor) -> torch.Tensor:
    need = n * kv_cache[0].numel()
    buf = slots[slot]
    if buf is None or buf.numel() < need:
        buf = torch.empty(need, dtype=kv_cache.dtype, device=kv_cache.device)
        slots[slot] = buf
    return buf


def _send_blocks_on(ch: PairChannel, kv_cache: torch.Tensor, ids: list[int],
                    max_message_bytes: int, deadline: float,
                    ready_event: "torch.cuda.Event | None" = None,
                    staging: list | None = None) -> int:
    """Send the blocks ``ids`` of ``kv_cache`` over ``ch``; returns once all has crossed.
    ``staging``: two reusable buffer slots (CPU; on CUDA the caching allocator reuses)."""
    block_bytes = bytes_per_block(kv_cache)
    chunks = plan_chunks(len(ids), block_bytes, max_message_bytes)
    stream = ch.stream
    if stream is not None:
        if ready_event is not None:
            stream.wait_event(ready_event)
        else:
            stream.wait_stream(torch.cuda.current_stream(kv_cache.device))
    slots: list = staging if staging is not None else [None, None]
    last: list = [None, None]   # the last send from each staging buffer
    ops: list = []              # every send: each must be waited (a Gloo send is cancelled
                                # if its Work is dropped before completion)
    ctx = torch.cuda.stream(stream) if stream is not None else _Null()
    with ctx:  # staging buffers are allocated on (and freed in the order of) the side stream
        for i, (s, e) in enumerate(chunks):
            sub = ids[s:e]
            slot = i % 2
            rng = contiguous_range(sub)
            if rng is not None:
                ops.append(ch.isend(kv_cache[rng[0]:rng[1]], tag=i))
                continue
            if last[slot] is not None:  # the buffer is free once its last send is done
                ch.wait(last[slot], deadline)
            buf = _staging(slots, slot, len(sub), kv_cache)
            msg = gather_blocks(kv_cache, sub, out=buf, stream=stream)
            last[slot] = ch.isend(msg, tag=i)
            ops.append(last[slot])
        ch.synchronize(ops, deadline)
    return len(ids) * block_bytes


def _recv_blocks_on(ch: PairChannel, kv_cache: torch.Tensor, ids: list[int],
                    max_message_bytes: int, deadline: float,
                    staging: list | None = None) -> int:
    """Receive the blocks ``ids`` of ``kv_cache`` over ``ch`` and scatter them into the pool.
    On return the data has landed (CPU) or the scatter is enqueued on ``ch.stream`` after the
    completed receive (CUDA)."""
    block_bytes = bytes_per_block(kv_cache)
    chunks = plan_chunks(len(ids), block_bytes, max_message_bytes)
    stream = ch.stream
    slots: list = staging if staging is not None else [None, None]
    posted: list = [None] * len(chunks)   # (work, buffer or None)

    def post(i: int) -> None:
        s, e = chunks[i]
        sub = ids[s:e]
        rng = contiguous_range(sub)
        if rng is not None:
            posted[i] = (ch.irecv(kv_cache[rng[0]:rng[1]], tag=i), None)
        else:
            buf = _staging(slots, i % 2, len(sub), kv_cache)
            view = buf[:len(sub) * kv_cache[0].numel()]
            posted[i] = (ch.irecv(view, tag=i), view)

    ctx = torch.cuda.stream(stream) if stream is not None else _Null()
    with ctx:
        for i in range(min(2, len(chunks))):
            post(i)
        for i, (s, e) in enumerate(chunks):
            work, view = posted[i]
            ch.wait(work, deadline)
            if view is not None:
                scatter_blocks(kv_cache, ids[s:e], view, stream=stream)
            if i + 2 < len(chunks):
                post(i + 2)   # reuses slot i % 2: ordered after the scatter above
        ch.synchronize([p[0] for p in posted], deadline)
    return len(ids) * block_bytes


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ============================================================================ sender
@dataclass
class _SendPair:
    lock: threading.RLock = field(default_factory=threading.RLock)
    epoch: int = 0
    channel: PairChannel | None = None
    store_address: str = ""
    stream: object = None
    # CPU staging buffers, reused across transfers (fresh host memory costs page faults);
    # on CUDA the caching allocator does this job
    staging: list = field(default_factory=lambda: [None, None])


class KvSender:
    """Prefill side: ships blocks of the local pool to decode workers.

    One pair channel per decode worker, created lazily at the first send of an epoch (rank 0).
    ``send_blocks`` runs in the caller's thread and blocks until the data has crossed.

    How a prefill worker uses it for one request (the lock keeps PushKV order == send order,
    and never two PushKV to one decode worker in flight)::

        with sender.lock(decode_id):
            epoch = sender.next_epoch(decode_id)
            stub.PushKV(..., channel_epoch=epoch, block_ids=ids, ...)   # receive posted
            nbytes, secs = sender.send_blocks(decode_id, store_address, epoch, kv_cache, ids)

    If PushKV fails with NOT_FOUND nothing was posted: skip the send. If it fails in a way that
    leaves it unknown whether the receive was posted (deadline, UNAVAILABLE), call
    ``mark_broken(decode_id)``. Any failure of ``send_blocks`` marks the channel broken and
    bumps the pair's epoch itself.
    """

    def __init__(self, prefill_worker_id: str, *, timeout: float = DEFAULT_TIMEOUT,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 first_epoch: int | None = None) -> None:
        self.prefill_worker_id = prefill_worker_id
        self.timeout = float(timeout)
        self.max_message_bytes = int(max_message_bytes)
        self._first_epoch = initial_epoch() if first_epoch is None else int(first_epoch)
        self._pairs: dict[str, _SendPair] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _pair(self, decode_worker_id: str) -> _SendPair:
        with self._lock:
            if self._closed:
                raise KvTransferError("KvSender is closed")
            pair = self._pairs.get(decode_worker_id)
            if pair is None:
                pair = self._pairs[decode_worker_id] = _SendPair(epoch=self._first_epoch)
            return pair

    def lock(self, decode_worker_id: str) -> threading.RLock:
        """The (re-entrant) lock of the pair; ``send_blocks`` takes it too. Hold it across
        ``next_epoch`` + PushKV + ``send_blocks``."""
        return self._pair(decode_worker_id).lock

    def next_epoch(self, decode_worker_id: str) -> int:
        """The epoch to put in the next PushKV to this decode worker."""
        return self._pair(decode_worker_id).epoch

    def mark_broken(self, decode_worker_id: str, reason: str = "marked broken") -> int:
        """Abort the pair's channel and bump its epoch; returns the new epoch."""
        pair = self._pair(decode_worker_id)
        with pair.lock:
            self._break(pair, reason)
            return pair.epoch

    def _break(self, pair: _SendPair, reason: str) -> None:
        if pair.channel is not None:
            pair.channel.abort(reason)
            pair.channel.close()
            pair.channel = None
        pair.staging = [None, None]  # an aborted operation may still touch the old ones
        pair.epoch += 1

    def send_blocks(self, decode_worker_id: str, store_address: str, epoch: int,
                    kv_cache: torch.Tensor, block_ids: BlockIds, *,
                    ready_event: "torch.cuda.Event | None" = None) -> tuple[int, float]:
        """Send blocks ``block_ids`` of ``kv_cache`` (in that order) to the decode worker,
        whose matching receive was posted by a PushKV with ``epoch``.

        CUDA: the gather waits for ``ready_event`` if given, else for the calling thread's
        current stream (where the KV was written). Returns ``(num_bytes, seconds)`` once the
        data has crossed (seconds: from before the gather to completion; channel set-up not
        included). Raises ``KvTransferError`` (the epoch is then bumped).
        """
        pair = self._pair(decode_worker_id)
        with pair.lock:
            try:
                if self._closed:
                    raise KvTransferError("KvSender is closed")
                if int(epoch) != pair.epoch:
                    raise KvTransferError(
                        f"epoch {epoch} is not the current epoch {pair.epoch} of the pair "
                        f"{self.prefill_worker_id}->{decode_worker_id}; take next_epoch() under "
                        "lock() before PushKV")
                check_pool(kv_cache)
                ids = check_block_ids(block_ids, kv_cache.shape[0])
                if not ids:
                    return 0, 0.0
                ch = pair.channel
                if (ch is None or ch.epoch != pair.epoch or ch.is_broken
                        or pair.store_address != store_address
                        or ch.device != _device_of(kv_cache)):
                    if ch is not None:
                        ch.close()
                        pair.channel = None
                    if kv_cache.is_cuda and pair.stream is None:
                        pair.stream = torch.cuda.Stream(kv_cache.device)
                    ch = PairChannel(store_address, self.prefill_worker_id, decode_worker_id,
                                     pair.epoch, 0, kv_cache.device, timeout=self.timeout,
                                     stream=pair.stream)
                    pair.channel, pair.store_address = ch, store_address
                t0 = time.perf_counter()
                deadline = time.monotonic() + self.timeout
                nbytes = _send_blocks_on(ch, kv_cache, ids, self.max_message_bytes, deadline,
                                         ready_event,
                                         None if kv_cache.is_cuda else pair.staging)
                return nbytes, time.perf_counter() - t0
            except Exception as e:
                old = pair.epoch
                self._break(pair, f"send failed: {e}")
                msg = (f"KV send {self.prefill_worker_id}->{decode_worker_id} epoch {old} failed "
                       f"(next epoch {pair.epoch}): {e}")
                log.warning(msg)
                raise KvTransferError(msg) from e

    def close(self, wait: float = 1.0) -> None:
        """Abort every channel (no peer needed); a send in flight fails. The sender cannot be
        used afterwards. Waits up to ``wait`` seconds per pair for a send in flight to end
        (a Gloo send ends at its timeout or when the peer drops; it then cleans up itself)."""
        with self._lock:
            self._closed = True
            pairs = list(self._pairs.values())
        for pair in pairs:
            ch = pair.channel
            if ch is not None:
                ch.abort("sender closed")
        for pair in pairs:
            if not pair.lock.acquire(timeout=wait):
                continue
            try:
                ch, pair.channel = pair.channel, None
                if ch is not None:
                    ch.close()
            finally:
                pair.lock.release()

    def __enter__(self) -> "KvSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _device_of(t: torch.Tensor) -> torch.device:
    d = t.device
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


# ============================================================================ receiver
@dataclass
class _Post:
    epoch: int
    ids: list[int]
    future: Future
    posted_at: float


class _RecvPeer:
    """The receive state of one prefill worker; its thread runs the posts in order."""

    def __init__(self, owner: "KvReceiver", prefill_id: str) -> None:
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
            if superseded:
                _fail(item, KvTransferError(
                    f"KV receive from {self.prefill_id} epoch {item.epoch} superseded by epoch "
                    f"{self.epoch}: the sender restarted its channel; nothing was received"))
                continue
            if broken:
                _fail(item, KvTransferError(
                    f"KV receive from {self.prefill_id}: channel epoch {item.epoch} is broken"))
                continue
            try:
                ch = self._channel_for(item.epoch)
                deadline = time.monotonic() + owner.timeout
                nbytes = _recv_blocks_on(ch, owner.kv_cache, item.ids, owner.max_message_bytes,
                                         deadline, self.staging)
                event = ch.record_event()
                item.future.set_result((nbytes, event))
            except Exception as e:  # noqa: BLE001 - every failure goes to the future
                with self.cond:
                    if not self._superseded(item.epoch):
                        self.broken_epoch = item.epoch
                    ch, self.channel = self.channel, None
                if ch is not None:
                    ch.close()
                if self.staging is not None:
                    self.staging = [None, None]  # an aborted receive may still write the old
                err = e if isinstance(e, KvTransferError) else KvTransferError(str(e))
                _fail(item, KvTransferError(
                    f"KV receive of {len(item.ids)} blocks from {self.prefill_id} epoch "
                    f"{item.epoch} failed: {err}"))
        # stopping: release the channel and fail what is left
        with self.cond:
            ch, self.channel = self.channel, None
            left = list(self.queue)
            self.queue.clear()
        if ch is not None:
            ch.close()
        for item in left:
            _fail(item, KvTransferError(f"KV receiver closed; receive from {self.prefill_id} "
                                        f"epoch {item.epoch} cancelled"))

    def _channel_for(self, epoch: int) -> PairChannel:
        ch = self.channel
        if ch is not None and ch.epoch == epoch and not ch.is_broken:
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
                         cancel=cancel)
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

    ``post`` is called by the PushKV handler before it answers; it returns a
    ``concurrent.futures.Future`` that resolves to ``(num_bytes, event)`` once the blocks are
    in ``kv_cache`` (``event`` is None on CPU; on CUDA a ``torch.cuda.Event`` after the
    scatter, which the decode step's stream must wait on), or raises ``KvTransferError``
    (timeout, peer death, superseded epoch, receiver closed). The blocks must stay reserved
    until the future is done, whatever the request's fate (cancel included): the sender may
    still be writing them.

    Thread model: one daemon thread per prefill worker (created at its first post), each with
    its own pair channel (rank 1) and, on CUDA, its own side stream; so many prefill workers
    can send at once, each in order.

    ``timeout`` applies to each receive from the moment its thread starts it (after the
    earlier receives from the same prefill worker), and to joining a new channel.
    ``max_message_bytes`` must equal the senders' (both cut a transfer the same way).
    """

    def __init__(self, kv_cache: torch.Tensor, decode_worker_id: str,
                 store: KvStoreServer | str, *, timeout: float = DEFAULT_TIMEOUT,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        check_pool(kv_cache)
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

    def epoch_of(self, prefill_worker_id: str) -> int | None:
        """The newest epoch posted by this prefill worker (None if none yet)."""
        peer = self._peers.get(prefill_worker_id)
        return None if peer is None else peer.epoch

    def post(self, prefill_worker_id: str, epoch: int, block_ids: BlockIds) -> Future:
        """Post the receive announced by one PushKV. Raises ``KvTransferError`` at once (so
        PushKV can answer an error and nothing is sent) when the epoch is older than one
        already posted, or is known broken here, or the block ids are bad."""
        epoch = int(epoch)
        ids = check_block_ids(block_ids, self.kv_cache.shape[0])
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
                future.set_result((0, None))
            else:
                peer.queue.append(_Post(epoch, ids, future, time.monotonic()))
                peer.cond.notify()
        if to_abort is not None:
            to_abort.abort(f"superseded by epoch {epoch}")
        return future

    def drop_peer(self, prefill_worker_id: str, join_timeout: float = 1.0) -> None:
        """Forget a prefill worker (gone for good): stop its thread, close its channel, fail
        its pending receives."""
        with self._lock:
            peer = self._peers.pop(prefill_worker_id, None)
        if peer is not None:
            self._stop(peer, join_timeout)

    def _stop(self, peer: _RecvPeer, join_timeout: float) -> None:
        with peer.cond:
            peer.stopping = True
            ch = peer.channel
            peer.cond.notify_all()
        if ch is not None:
            ch.abort("receiver closed")
        peer.thread.join(join_timeout)

    def close(self, join_timeout: float = 2.0) -> None:
        """Stop every thread and channel; pending receives fail with KvTransferError. A thread
        blocked in a Gloo receive ends at its timeout (daemon threads: they never keep the
        process alive)."""
        with self._lock:
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
        for peer in peers:
            with peer.cond:
                peer.stopping = True
                ch = peer.channel
                peer.cond.notify_all()
            if ch is not None:
                ch.abort("receiver closed")
        deadline = time.monotonic() + join_timeout
        for peer in peers:
            peer.thread.join(max(0.0, deadline - time.monotonic()))
            with peer.cond:
                left = list(peer.queue)
                peer.queue.clear()
            for item in left:
                _fail(item, KvTransferError("KvReceiver closed"))

    def __enter__(self) -> "KvReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
