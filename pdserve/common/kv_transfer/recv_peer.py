"""One prefill worker's side of a :class:`~.receiver.KvReceiver`: its posts, in order, its
epochs, its pair channel and, only while it has receives queued or a channel open, its receive
thread (:class:`RecvPeer`). A post resolves to :class:`~.transport.Received` or fails with
``KvTransferError``; the receiver decides which peers exist and which of them may hold a channel.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from .channel import PairChannel
from .errors import KvTransferError
from .transfer import _recv_blocks_on
from .transport import Received


class PeerOwner(Protocol):
    """What a peer reads of its receiver (``KvReceiver`` is one): the pool and the ids its channel
    joins with, the limits of a receive, the idle time (read at each wait: it may change), and the
    count of channels closed idle, which the peer's thread bumps as it ends."""
    kv_cache: torch.Tensor
    decode_worker_id: str
    store_address: str
    timeout: float
    max_message_bytes: int
    idle_close_s: float
    num_channels_closed_idle: int


@dataclass
class Post:
    """One receive a PushKV announced: blocks ``ids`` of the pool over the channel of ``epoch``;
    ``future`` resolves to :class:`Received` or fails."""
    epoch: int
    ids: list[int]
    future: Future
    posted_at: float
    with_first_token: bool = False
    secret: str = ""          # the epoch's rendezvous secret (PushKV.pair_secret)
    heads: tuple[int, int] | None = None   # only these KV heads of each block (None: all)


class RecvPeer:
    """The receive state of one prefill worker. Its thread runs the posts in order and exists
    only while there is a post queued or running or a channel open. Fields are read and written
    under ``cond``, except ``channel`` / ``staging`` / ``stream``, which the thread uses outside."""

    def __init__(self, owner: PeerOwner, prefill_id: str) -> None:
        self.owner = owner
        self.prefill_id = prefill_id
        self.cond = threading.Condition()
        self.queue: deque[Post] = deque()
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

    def accept(self, post: Post) -> PairChannel | None:
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

    def _next(self) -> Post | None:
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
                close_and_fail(ch, left, f"KV receiver closed; receive from {self.prefill_id} cancelled")
                return
            try:
                self._receive(item, superseded, broken)
            finally:
                with self.cond:
                    self.busy = False
                    self.last_used = time.monotonic()

    def _release(self) -> tuple[PairChannel | None, list[Post]]:
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

    def _receive(self, item: Post, superseded: bool, broken: bool) -> None:
        owner = self.owner
        if superseded:
            fail(item, KvTransferError(
                f"KV receive from {self.prefill_id} epoch {item.epoch} superseded by epoch "
                f"{self.epoch}: the sender restarted its channel; nothing was received"))
            return
        if broken:
            fail(item, KvTransferError(
                f"KV receive from {self.prefill_id}: channel epoch {item.epoch} is broken"))
            return
        try:
            ch = self._channel_for(item.epoch, item.secret)
            deadline = time.monotonic() + owner.timeout
            nbytes, first = _recv_blocks_on(ch, owner.kv_cache, item.ids,
                                            owner.max_message_bytes, deadline, self.staging,
                                            item.with_first_token, item.heads)
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
            fail(item, KvTransferError(
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


def fail(item: Post, exc: BaseException) -> None:
    """Fail the post's future with ``exc`` unless it is done already."""
    if not item.future.done():
        item.future.set_exception(exc)


def close_and_fail(ch: PairChannel | None, left: list[Post], why: str) -> None:
    """Close a channel given up and fail the posts that will not run (outside any lock)."""
    if ch is not None:
        ch.close()
    for item in left:
        fail(item, KvTransferError(f"{why} (epoch {item.epoch})"))
