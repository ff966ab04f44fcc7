"""``KvSender``: the prefill side of the KV transfer protocol (see transfer.py)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from .blocks import DEFAULT_MAX_MESSAGE_BYTES, BlockIds, check_block_ids, check_pool, head_bytes
from .channel import DEFAULT_TIMEOUT, PairChannel, new_pair_secret
from .channel_lru import channels_to_close
from .errors import KvTransferError
from .transfer import FirstTokenRef, _enqueue_send_on, initial_epoch

log = logging.getLogger(__name__)

class PendingSend:
    """A started send: ``wait()`` returns ``(num_bytes, seconds since start)`` or raises
    ``KvTransferError`` (the pair's channel is then broken and its epoch bumped)."""

    def __init__(self, sender: KvSender, pair: _SendPair, channel: PairChannel | None,
                 ops: list, num_bytes: int, deadline: float, t0: float, label: str) -> None:
        self._sender, self._pair, self._channel = sender, pair, channel
        self._ops, self.num_bytes, self._deadline, self._t0 = ops, num_bytes, deadline, t0
        self._label = label
        self._result: tuple[int, float] | None = None
        self._error: KvTransferError | None = None
        self._done = threading.Lock()

    def wait(self) -> tuple[int, float]:
        with self._done:   # once: a second wait returns the same outcome
            if self._result is None and self._error is None:
                try:
                    if self._channel is not None:
                        self._channel.synchronize(self._ops, self._deadline)
                    self._result = (self.num_bytes, time.perf_counter() - self._t0)
                except Exception as e:  # noqa: BLE001 - reported as KvTransferError
                    self._error = self._sender._failed(self._pair, self._channel, e, self._label)
                self._ops = []
                if self._channel is not None:
                    self._pair.inflight -= 1
                    self._pair.last_used = time.monotonic()
        if self._error is not None:
            raise self._error
        if self._result is None:    # set above unless an error was
            raise KvTransferError(f"{self._label}: send ended without a result")
        return self._result


@dataclass
class _SendPair:
    lock: threading.RLock = field(default_factory=threading.RLock)
    epoch: int = 0
    channel: PairChannel | None = None
    store_address: str = ""
    stream: torch.cuda.Stream | None = None
    staging: list = field(default_factory=lambda: [None, None])   # CPU staging, reused
    last: PendingSend | None = None   # CPU: the next send waits for it (shared staging)
    last_used: float = 0.0              # time.monotonic() of the channel's last use
    inflight: int = 0                   # sends started and not waited yet (the channel is busy)
    secret: str = ""                    # rendezvous secret of epoch secret_epoch (pair_secrets)
    secret_epoch: int = -1


class KvSender:
    """Prefill side: ships blocks of the local pool to decode workers, one pair channel (rank 0)
    per decode worker, built lazily per epoch.

    Per request, under ``lock(decode_id)`` (PushKV order == send order, one PushKV in flight per
    pair): ``next_epoch`` -> PushKV -> ``start_send``; ``PendingSend.wait()`` outside the lock.
    PushKV NOT_FOUND: skip the send; an unknown outcome (deadline, UNAVAILABLE): ``mark_broken``.
    A failed send breaks the channel and bumps the epoch. At most ``max_channels`` open, none
    idle past ``idle_close_s`` (:mod:`.channel_lru`).
    """

    def __init__(self, prefill_worker_id: str, *, timeout: float = DEFAULT_TIMEOUT,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 first_epoch: int | None = None, max_channels: int | None = None,
                 idle_close_s: float | None = None, pair_secrets: bool = False) -> None:
        from pdserve.common import env
        self.prefill_worker_id = prefill_worker_id
        self.pair_secrets = pair_secrets   # one-time rendezvous secret per epoch (channel.py)
        self.max_channels = env.kv_max_channels() if max_channels is None else int(max_channels)
        self.idle_close_s = env.kv_idle_close_s() if idle_close_s is None else float(idle_close_s)
        self.num_channels_opened = 0
        self.num_channels_closed_idle = 0
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
        """The pair's re-entrant lock; hold it across ``next_epoch`` + PushKV + ``start_send``."""
        return self._pair(decode_worker_id).lock

    def next_epoch(self, decode_worker_id: str) -> int:
        """The epoch for the next PushKV to this decode worker (closes an idle channel first)."""
        pair = self._pair(decode_worker_id)
        with pair.lock:
            now = time.monotonic()
            if (pair.channel is not None and pair.inflight == 0 and self.idle_close_s > 0
                    and now - pair.last_used >= self.idle_close_s):
                self._retire(pair)
            return pair.epoch

    def adopt_epoch(self, decode_worker_id: str, epoch: int, secret: str) -> None:
        """Make ``epoch`` (with ``secret``) the pair's current one, as another sender chose it: the
        channels of one tensor-parallel transfer share the epoch of its route (0, 0) (layout.py).
        A channel of another epoch is closed. Under ``lock()``."""
        if not self.pair_secrets and secret:
            raise KvTransferError("this sender's channels carry no pair secret")
        pair = self._pair(decode_worker_id)
        with pair.lock:
            if pair.epoch != int(epoch) and pair.channel is not None:
                ch, pair.channel = pair.channel, None
                ch.close()
                pair.staging = [None, None]
            pair.epoch = int(epoch)
            pair.secret, pair.secret_epoch = secret, int(epoch)

    def pair_secret(self, decode_worker_id: str) -> str:
        """The current epoch's secret for PushKV.pair_secret ("" unless ``pair_secrets``);
        take it after ``next_epoch`` under ``lock()``."""
        return self._secret_of(self._pair(decode_worker_id))

    def _secret_of(self, pair: _SendPair) -> str:
        if not self.pair_secrets:
            return ""
        with pair.lock:
            if pair.secret_epoch != pair.epoch:   # a new epoch gets a new secret
                pair.secret, pair.secret_epoch = new_pair_secret(), pair.epoch
            return pair.secret

    def num_open_channels(self) -> int:
        with self._lock:
            return sum(1 for p in self._pairs.values() if p.channel is not None)

    def _retire(self, pair: _SendPair) -> None:
        """Close an idle channel (under pair.lock); its next transfer builds one of a new epoch."""
        ch, pair.channel = pair.channel, None
        if ch is not None:
            ch.close()
            self.num_channels_closed_idle += 1
        pair.staging = [None, None]
        pair.epoch += 1

    def _make_room(self, building: _SendPair) -> None:
        """Before opening a channel: close idle / least recently used ones (see channel_lru)."""
        with self._lock:
            open_pairs = {id(p): p for p in self._pairs.values() if p.channel is not None and p is not building}
        last = {k: p.last_used for k, p in open_pairs.items()}
        busy = {k for k, p in open_pairs.items() if p.inflight}
        for k in channels_to_close(last, time.monotonic(), self.max_channels, self.idle_close_s, busy, opening=1):
            p = open_pairs[k]
            if p.lock.acquire(blocking=False):     # never wait for another pair's transfer
                try:
                    if p.channel is not None and not p.inflight:
                        self._retire(p)
                finally:
                    p.lock.release()

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
                    ready_event: torch.cuda.Event | None = None,
                    first_token: FirstTokenRef | None = None) -> tuple[int, float]:
        """``start_send(...).wait()``: ``(num_bytes, seconds)`` once the data crossed."""
        return self.start_send(decode_worker_id, store_address, epoch, kv_cache, block_ids,
                               ready_event=ready_event, first_token=first_token).wait()

    def start_send(self, decode_worker_id: str, store_address: str, epoch: int,
                   kv_cache: torch.Tensor, block_ids: BlockIds, *,
                   ready_event: torch.cuda.Event | None = None,
                   first_token: FirstTokenRef | None = None,
                   heads: tuple[int, int] | None = None) -> PendingSend:
        """Start sending blocks ``block_ids`` of ``kv_cache`` for the receive a PushKV with
        ``epoch`` posted (``first_token`` only if posted ``with_first_token``).

        CUDA: enqueued behind ``ready_event`` (else the current stream), so it may be called
        before the prefill step finished; returns once enqueued. CPU: waits for the pair's
        previous send first. Bad input or a failed start raises ``KvTransferError`` now (epoch
        bumped); a failed transfer raises from ``PendingSend.wait``. ``heads``: only these KV
        heads ``[start, end)`` of each block cross (a route between tensor-parallel layouts,
        layout.py); the receive must name as many.
        """
        pair = self._pair(decode_worker_id)
        label = f"{self.prefill_worker_id}->{decode_worker_id}"
        with pair.lock:
            ch = None
            try:
                if self._closed:
                    raise KvTransferError("KvSender is closed")
                if int(epoch) != pair.epoch:
                    raise KvTransferError(
                        f"epoch {epoch} is not the current epoch {pair.epoch} of the pair "
                        f"{label}; take next_epoch() under lock() before PushKV")
                check_pool(kv_cache)
                ids = check_block_ids(block_ids, kv_cache.shape[0])
                if not ids:
                    if first_token is not None:
                        raise KvTransferError("a first token travels after at least one block")
                    return PendingSend(self, pair, None, [], 0, 0.0, time.perf_counter(), label)
                if not kv_cache.is_cuda and pair.last is not None:
                    pair.last.wait()          # its staging buffers are reused below
                    if int(epoch) != pair.epoch:
                        raise KvTransferError(f"the previous send of {label} failed")
                t0 = time.perf_counter()
                ch = self._channel(pair, decode_worker_id, store_address, kv_cache)
                deadline = time.monotonic() + self.timeout
                ops = _enqueue_send_on(ch, kv_cache, ids, self.max_message_bytes, deadline,
                                       ready_event, None if kv_cache.is_cuda else pair.staging,
                                       first_token, heads)
                pair.inflight += 1
                pair.last_used = time.monotonic()
                pending = PendingSend(self, pair, ch, ops, len(ids) * head_bytes(kv_cache, heads),
                                      deadline, t0, label)
                pair.last = None if kv_cache.is_cuda else pending
                return pending
            except Exception as e:
                raise self._failed(pair, ch if ch is not None else pair.channel, e, label) from e

    def _channel(self, pair: _SendPair, decode_worker_id: str, store_address: str,
                 kv_cache: torch.Tensor) -> PairChannel:
        """The pair's channel of the current epoch (built now if needed). Under pair.lock."""
        ch = pair.channel
        if (ch is None or ch.epoch != pair.epoch or ch.is_broken
                or pair.store_address != store_address or ch.device != _device_of(kv_cache)):
            if ch is not None:
                ch.close()
                pair.channel = None
            self._make_room(pair)
            if kv_cache.is_cuda and pair.stream is None:
                pair.stream = torch.cuda.Stream(kv_cache.device)
            ch = PairChannel(store_address, self.prefill_worker_id, decode_worker_id,
                             pair.epoch, 0, kv_cache.device, timeout=self.timeout,
                             stream=pair.stream, secret=self._secret_of(pair))
            pair.channel, pair.store_address = ch, store_address
            pair.last_used = time.monotonic()
            self.num_channels_opened += 1
        return ch

    def _failed(self, pair: _SendPair, ch: PairChannel | None, exc: BaseException,
                label: str) -> KvTransferError:
        """Break the pair's channel (only if ``ch`` is still it, or none was built); returns the
        error to raise."""
        with pair.lock:
            old = pair.epoch
            if ch is None or pair.channel is ch:
                self._break(pair, f"send failed: {exc}")
        msg = f"KV send {label} epoch {old} failed (next epoch {pair.epoch}): {exc}"
        log.warning(msg)
        return KvTransferError(msg)

    def close(self, wait: float = 1.0) -> None:
        """Abort every channel (a send in flight fails); waits up to ``wait`` s per pair for it.
        The sender is unusable afterwards."""
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

    def __enter__(self) -> KvSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _device_of(t: torch.Tensor) -> torch.device:
    d = t.device
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


