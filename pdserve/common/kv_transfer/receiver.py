"""``KvReceiver``: the decode side of the KV transfer protocol (see transfer.py).

One record per prefill worker (:class:`_RecvPeer`): its epochs, its pair channel and, only while
it has receives queued or a channel open, one receive thread. A peer's thread ends as soon as it
has neither (a failed join, a failed receive, an idle channel closed, an eviction), so a peer
that goes away, or a forged PushKV naming a peer that never joins, leaves no thread behind. At
most ``max_peers`` peers hold a thread or a channel: opening another first closes the least
recently used idle ones (:mod:`.channel_lru`); records without either are kept for their epochs
(to refuse a broken or stale one at once), at most ``max_records`` of them.
"""
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
from .channel import DEFAULT_TIMEOUT, PairChannel, channel_prefix
from .channel_lru import channels_to_close
from .errors import KvTransferError
from .store import KvStoreServer
from .transfer import _recv_blocks_on

log = logging.getLogger(__name__)

#: Records of prefill workers kept beyond the live ones (each a few hundred bytes: epochs only).
DEFAULT_MAX_RECORDS = 1024


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
    """The receive state of one prefill worker. Its thread runs the posts in order and exists
    only while there is a post queued or running or a channel open. Fields are read and written
    under ``cond``, except ``channel`` / ``staging`` / ``stream``, which the thread uses outside."""

    def __init__(self, owner: KvReceiver, prefill_id: str) -> None:
        self.owner = owner
        self.prefill_id = prefill_id
        self.cond = threading.Condition()
        self.queue: deque[_Post] = deque()
        self.epoch: int | None = None        # newest epoch posted
        self.broken_epoch: int | None = None  # an epoch known broken on this side
        self.channel: PairChannel | None = None
        self.stream: torch.cuda.Stream | None = None   # CUDA: made with the channel
        self.staging: list | None = None if owner.kv_cache.is_cuda else [None, None]
        self.stopping = False
        self.busy = False                    # a receive is running
        self.last_used = time.monotonic()    # end of the channel's last receive (or the last post)
        self.thread: threading.Thread | None = None

    # ---- under self.cond -------------------------------------------------------------------
    def _superseded(self, epoch: int) -> bool:
        return self.stopping or (self.epoch is not None and epoch < self.epoch)

    @property
    def is_live(self) -> bool:
        """Holds a thread or a channel (counts toward ``max_peers``)."""
        return self.thread is not None or self.channel is not None

    @property
    def is_active(self) -> bool:
        """A receive is queued or running: never evicted."""
        return self.busy or bool(self.queue)

    def check_epoch(self, epoch: int) -> None:
        """Raise ``KvTransferError`` for a stale or broken epoch."""
        if self.epoch is not None and epoch < self.epoch:
            raise KvTransferError(f"stale channel epoch {epoch} from {self.prefill_id} (current {self.epoch})")
        if epoch == self.broken_epoch:
            raise KvTransferError(f"channel epoch {epoch} from {self.prefill_id} is broken on this decode "
                                  "worker; use a new epoch")

    def accept(self, post: _Post) -> PairChannel | None:
        """Queue ``post`` (starting the thread if none runs); returns a channel of an older
        epoch to abort. Raises ``KvTransferError`` for a stale or broken epoch."""
        epoch = post.epoch
        self.check_epoch(epoch)
        to_abort = None
        if self.epoch is None or epoch > self.epoch:
            self.epoch = epoch
            ch = self.channel
            if ch is not None and ch.epoch != epoch:
                to_abort = ch
        self.last_used = time.monotonic()
        if not post.ids:
            post.future.set_result(Received(0, None, None))
            return to_abort
        self.queue.append(post)
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=f"kv-recv-{self.prefill_id}", daemon=True)
            self.thread.start()
        self.cond.notify()
        return to_abort

    def _idle_left(self) -> float | None:
        """Seconds until the open channel counts as idle; None: never (no idle close)."""
        idle_s = self.owner.idle_close_s
        if idle_s <= 0:
            return None
        return idle_s - (time.monotonic() - self.last_used)

    def _next(self) -> _Post | None:
        """The next post to run, or None when the thread must end: stopping, nothing queued and
        no channel open, or the channel idle for ``idle_close_s``."""
        while not self.stopping:
            if self.queue:
                return self.queue.popleft()
            if self.channel is None:
                return None
            left = self._idle_left()
            if left is not None and left <= 0:
                return None
            self.cond.wait(left)
        return None

    def _retire(self) -> PairChannel | None:
        """Take the channel away (the caller closes it); its epoch is refused from now on (the
        sender closes an idle channel after half the receiver's idle time and moves on)."""
        ch, self.channel = self.channel, None
        if ch is not None:
            self.broken_epoch = ch.epoch
        return ch

    def retire_if_idle(self, now: float, idle_s: float) -> PairChannel | None:
        """Take the channel away if unused for ``idle_s`` with nothing queued or running (its
        thread then ends; the caller closes the channel, outside any lock); its epoch is
        refused from now on."""
        with self.cond:
            if self.channel is None or self.is_active or now - self.last_used < idle_s:
                return None
            self.cond.notify_all()
            return self._retire()

    def close_if_idle(self, now: float, idle_s: float) -> bool:
        """:meth:`retire_if_idle`, closing the channel; True if there was one to close."""
        ch = self.retire_if_idle(now, idle_s)
        if ch is None:
            return False
        ch.close()
        return True

    # ---- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        owner = self.owner
        if owner.kv_cache.is_cuda:
            torch.cuda.set_device(owner.kv_cache.device)
        while True:
            with self.cond:
                item = self._next()
                if item is None:
                    idle = not self.stopping and self.channel is not None
                    ch, left = self._release()
                else:
                    superseded = self._superseded(item.epoch)
                    broken = item.epoch == self.broken_epoch
                    self.busy = True
            if item is None:
                if idle:
                    owner.num_channels_closed_idle += 1
                _close_and_fail(ch, left, f"KV receiver closed; receive from {self.prefill_id} cancelled")
                return
            try:
                self._receive(item, superseded, broken)
            finally:
                with self.cond:
                    self.busy = False
                    self.last_used = time.monotonic()

    def _release(self) -> tuple[PairChannel | None, list[_Post]]:
        """Under cond, as the thread ends: give up the thread, the channel (returned, to close
        outside cond) and the posts left (returned, to fail: only when stopping)."""
        ch = self._retire()
        left = list(self.queue)
        self.queue.clear()
        self.thread = None
        self.stream = None
        if self.staging is not None:
            self.staging = [None, None]
        return ch, left

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
        if owner.kv_cache.is_cuda and self.stream is None:
            self.stream = torch.cuda.Stream(owner.kv_cache.device)

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


def _close_and_fail(ch: PairChannel | None, left: list[_Post], why: str) -> None:
    """Close a channel given up and fail the posts that will not run (outside any lock)."""
    if ch is not None:
        ch.close()
    for item in left:
        _fail(item, KvTransferError(f"{why} (epoch {item.epoch})"))


class KvReceiver:
    """Decode side: receives blocks into the local pool, in post order per prefill worker.

    ``post`` (PushKV handler) returns a Future of ``Received`` once the blocks are in
    ``kv_cache``, or of ``KvTransferError``. The blocks must stay reserved until the future is
    done, whatever the request's fate: the sender may still be writing them. Per prefill worker
    one pair channel (rank 1) and CUDA side stream, and a daemon thread while it has work or an
    open channel (module docstring). ``timeout`` bounds each receive from its start and each
    join; ``max_message_bytes`` must equal the senders'; channels idle for ``idle_close_s``
    close (their thread ends) and their epoch is refused; at most ``max_peers`` prefill workers
    hold a thread or channel (None: ``PDSERVE_KV_MAX_CHANNELS``; 0: no cap), beyond which the
    least recently used idle ones are closed like idle ones.
    """

    def __init__(self, kv_cache: torch.Tensor, decode_worker_id: str,
                 store: KvStoreServer | str, *, timeout: float = DEFAULT_TIMEOUT,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 idle_close_s: float | None = None, max_peers: int | None = None,
                 max_records: int = DEFAULT_MAX_RECORDS) -> None:
        from pdserve.common import env
        check_pool(kv_cache)
        self.idle_close_s = 2 * env.kv_idle_close_s() if idle_close_s is None else float(idle_close_s)
        self.max_peers = env.kv_max_channels() if max_peers is None else int(max_peers)
        self.max_records = int(max_records)
        self.num_channels_closed_idle = 0
        self.num_channels_evicted = 0
        self.kv_cache = kv_cache
        self.decode_worker_id = decode_worker_id
        self.store_address = store.local_address if isinstance(store, KvStoreServer) else store
        self.timeout = float(timeout)
        self.max_message_bytes = int(max_message_bytes)
        self.block_bytes = bytes_per_block(kv_cache)
        self._peers: dict[str, _RecvPeer] = {}
        self._lock = threading.Lock()    # taken before any peer's cond, never under one
        self._closed = False

    def expected_bytes(self, num_blocks: int) -> int:
        """Bytes a transfer of ``num_blocks`` blocks carries (to check PushKV.num_bytes)."""
        return int(num_blocks) * self.block_bytes

    def _peer_list(self) -> list[_RecvPeer]:
        with self._lock:
            return list(self._peers.values())

    def num_open_channels(self) -> int:
        return sum(1 for p in self._peer_list() if p.channel is not None)

    def num_threads(self) -> int:
        """Receive threads running now (one per prefill worker with work or an open channel)."""
        return sum(1 for p in self._peer_list() if p.thread is not None)

    def num_peers(self) -> int:
        """Prefill workers remembered (live or not)."""
        with self._lock:
            return len(self._peers)

    def close_idle(self, now: float | None = None) -> int:
        """Close the channels unused for ``idle_close_s``; returns how many were closed."""
        if self.idle_close_s <= 0:
            return 0
        now = time.monotonic() if now is None else now
        n = sum(1 for p in self._peer_list() if p.close_if_idle(now, self.idle_close_s))
        self.num_channels_closed_idle += n
        return n

    def epoch_of(self, prefill_worker_id: str) -> int | None:
        """The newest epoch posted by this prefill worker (None if none yet)."""
        peer = self._peers.get(prefill_worker_id)
        return None if peer is None else peer.epoch

    def post(self, prefill_worker_id: str, epoch: int, block_ids: BlockIds, *,
             with_first_token: bool = False, secret: str = "") -> Future:
        """Post the receive announced by one PushKV. Raises ``KvTransferError`` at once (PushKV
        answers an error, nothing is sent) for a stale or broken epoch, a bad prefill worker id
        or bad block ids."""
        epoch = int(epoch)
        channel_prefix(prefill_worker_id, self.decode_worker_id, epoch)   # checks the ids
        ids = check_block_ids(block_ids, self.kv_cache.shape[0])
        if with_first_token and not ids:
            raise KvTransferError("a first token travels after at least one block")
        self.close_idle()
        future: Future = Future()
        future.set_running_or_notify_cancel()  # not cancellable: the data may be in flight
        post = _Post(epoch, ids, future, time.monotonic(), with_first_token, secret)
        with self._lock:
            if self._closed:
                raise KvTransferError("KvReceiver is closed")
            peer = self._record(prefill_worker_id)
            with peer.cond:
                peer.check_epoch(epoch)         # a refused post makes no room
            evicted = self._make_room(peer) if ids else []
            with peer.cond:
                to_abort = peer.accept(post)
        for ch in evicted:
            ch.close()
        if to_abort is not None:
            to_abort.abort(f"superseded by epoch {epoch}")
        return future

    def _record(self, prefill_worker_id: str) -> _RecvPeer:
        """The record of a prefill worker, made if new (forgetting dormant ones beyond
        ``max_records``). Under self._lock."""
        peer = self._peers.get(prefill_worker_id)
        if peer is None:
            self._forget_dormant(keep=self.max_records - 1)
            peer = self._peers[prefill_worker_id] = _RecvPeer(self, prefill_worker_id)
        return peer

    def _make_room(self, opening: _RecvPeer) -> list[PairChannel]:
        """Before ``opening`` goes live: retire the least recently used idle live peers beyond
        ``max_peers`` (as idle ones are: their thread ends, their epoch is refused); active ones
        are never retired, so a transfer never waits for another peer's. Returns the channels to
        close outside the lock. Under self._lock."""
        with opening.cond:
            if opening.is_live or self.max_peers <= 0:
                return []
        last_used, active = {}, set()
        for pid, p in self._peers.items():
            with p.cond:
                if p is opening or not p.is_live:
                    continue
                last_used[pid] = p.last_used
                if p.is_active:
                    active.add(pid)
        now = time.monotonic()
        retired = []
        for pid in channels_to_close(last_used, now, self.max_peers, 0.0, active, opening=1):
            ch = self._peers[pid].retire_if_idle(now, 0.0)
            if ch is not None:
                retired.append(ch)
                log.info("KV receiver: closing the channel of %s (more than %d prefill workers)",
                         pid, self.max_peers)
        self.num_channels_evicted += len(retired)
        return retired

    def _forget_dormant(self, keep: int) -> None:
        """Forget the least recently used records that hold nothing, down to ``keep`` records
        (under self._lock)."""
        excess = len(self._peers) - max(0, keep)
        if excess <= 0:
            return
        dormant = []
        for pid, p in self._peers.items():
            with p.cond:
                if not p.is_live and not p.is_active:
                    dormant.append((p.last_used, pid))
        for _, pid in sorted(dormant)[:excess]:
            del self._peers[pid]

    def drop_peer(self, prefill_worker_id: str, join_timeout: float = 1.0) -> None:
        """Forget a prefill worker: stop its thread, close its channel, fail its receives."""
        with self._lock:
            peer = self._peers.pop(prefill_worker_id, None)
        if peer is not None:
            self._join(peer, self._signal_stop(peer), join_timeout)

    @staticmethod
    def _signal_stop(peer: _RecvPeer) -> threading.Thread | None:
        """Tell the peer's thread to stop and abort its channel (a receive in flight fails); the
        thread releases what it holds as it ends. Returns it, to join (None: none runs)."""
        with peer.cond:
            peer.stopping = True
            ch = peer.channel
            thread = peer.thread
            peer.cond.notify_all()
        if ch is not None:
            ch.abort("receiver closed")
        return thread

    @staticmethod
    def _join(peer: _RecvPeer, thread: threading.Thread | None, timeout: float) -> None:
        if thread is not None:
            thread.join(timeout)
        with peer.cond:
            left = list(peer.queue)
            peer.queue.clear()
        for item in left:
            _fail(item, KvTransferError("KvReceiver closed"))

    def close(self, join_timeout: float = 2.0) -> None:
        """Stop every thread and channel; pending receives fail. A thread in a Gloo receive ends
        at its timeout (daemon threads)."""
        with self._lock:
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
        threads = [self._signal_stop(peer) for peer in peers]
        deadline = time.monotonic() + join_timeout
        for peer, thread in zip(peers, threads):
            self._join(peer, thread, max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> KvReceiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
