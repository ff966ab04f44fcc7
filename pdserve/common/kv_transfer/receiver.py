"""``KvReceiver``: the decode side of the KV transfer protocol (see transfer.py).

One record per prefill worker (:class:`~.recv_peer.RecvPeer`): its epochs, its pair channel and,
only while it has receives queued or a channel open, one receive thread. A peer's thread ends as
soon as it has neither (a failed join, a failed receive, an idle channel closed, an eviction), so
a peer that goes away, or a forged PushKV naming a peer that never joins, leaves no thread behind.
At most ``max_peers`` peers hold a thread or a channel: opening another first closes the least
recently used idle ones (:mod:`.channel_lru`); records without either are kept for their epochs
(to refuse a broken or stale one at once), at most ``max_records`` of them.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import torch

from .blocks import DEFAULT_MAX_MESSAGE_BYTES, BlockIds, bytes_per_block, check_block_ids, check_pool, head_range
from .channel import DEFAULT_TIMEOUT, PairChannel, channel_prefix
from .channel_lru import channels_to_close
from .errors import KvTransferError
from .recv_peer import Post, RecvPeer, fail
from .store import KvStoreServer

log = logging.getLogger(__name__)

#: Records of prefill workers kept beyond the live ones (each a few hundred bytes: epochs only).
DEFAULT_MAX_RECORDS = 1024


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
        self._peers: dict[str, RecvPeer] = {}
        self._lock = threading.Lock()    # taken before any peer's cond, never under one
        self._closed = False

    def expected_bytes(self, num_blocks: int) -> int:
        """Bytes a transfer of ``num_blocks`` blocks carries (to check PushKV.num_bytes)."""
        return int(num_blocks) * self.block_bytes

    def _peer_list(self) -> list[RecvPeer]:
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
             with_first_token: bool = False, secret: str = "",
             heads: tuple[int, int] | None = None) -> Future:
        """Post the receive announced by one PushKV. Raises ``KvTransferError`` at once (PushKV
        answers an error, nothing is sent) for a stale or broken epoch, a bad prefill worker id
        or bad block ids. ``heads``: only these KV heads ``[start, end)`` of each block arrive (a
        route between tensor-parallel layouts, layout.py); the others are untouched."""
        epoch = int(epoch)
        channel_prefix(prefill_worker_id, self.decode_worker_id, epoch)   # checks the ids
        ids = check_block_ids(block_ids, self.kv_cache.shape[0])
        if with_first_token and not ids:
            raise KvTransferError("a first token travels after at least one block")
        self.close_idle()
        future: Future = Future()
        future.set_running_or_notify_cancel()  # not cancellable: the data may be in flight
        if heads is not None:
            head_range(self.kv_cache, heads)
        post = Post(epoch, ids, future, time.monotonic(), with_first_token, secret, heads)
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

    def _record(self, prefill_worker_id: str) -> RecvPeer:
        """The record of a prefill worker, made if new (forgetting dormant ones beyond
        ``max_records``). Under self._lock."""
        peer = self._peers.get(prefill_worker_id)
        if peer is None:
            self._forget_dormant(keep=self.max_records - 1)
            peer = self._peers[prefill_worker_id] = RecvPeer(self, prefill_worker_id)
        return peer

    def _make_room(self, opening: RecvPeer) -> list[PairChannel]:
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
    def _signal_stop(peer: RecvPeer) -> threading.Thread | None:
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
    def _join(peer: RecvPeer, thread: threading.Thread | None, timeout: float) -> None:
        if thread is not None:
            thread.join(timeout)
        with peer.cond:
            left = list(peer.queue)
            peer.queue.clear()
        for item in left:
            fail(item, KvTransferError("KvReceiver closed"))

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
