"""A 2-rank process group for one (prefill worker, decode worker, epoch): the pair channel.

Rank 0 is the prefill worker (sender), rank 1 the decode worker (receiver); Gloo for CPU
tensors, NCCL for CUDA tensors; tensors cross as raw bytes. The store prefix ends with the
epoch's one-time ``secret``, so only a client that knows it can find or plant rendezvous keys;
the secret never appears in logs (``prefix`` omits it). Construction returns once both ranks
joined and handshook, or raises ``KvTransferError`` after ``timeout`` seconds. A timeout or a
failure breaks the channel for good (``is_broken``); a new epoch builds a new one.
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from .. import env
from .errors import KvTransferError
from .process_group import POLL_SLEEP_S, abort_pg, cap_ctas, fine_timer_slack, nccl_available, seconds
from .store import connect_store

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0
_HANDSHAKE_MAGIC = 0x5044_4B56  # "PDKV"
_JOIN_KEY = "pdserve_join/0"


_SECRET_RE = re.compile(r"[0-9a-f]{32}")


def new_pair_secret() -> str:
    """A fresh one-time rendezvous secret: 128 random bits as 32 hex characters."""
    return secrets.token_hex(16)


def channel_prefix(prefill_id: str, decode_id: str, epoch: int, secret: str = "") -> str:
    """The store prefix of one pair channel (with the secret as its last part, when given)."""
    for name, value in (("prefill_id", prefill_id), ("decode_id", decode_id)):
        if not value or "/" in value:
            raise KvTransferError(f"{name} {value!r} must be non-empty and contain no '/'")
    if secret and not _SECRET_RE.fullmatch(secret):
        raise KvTransferError("pair secret must be 32 lowercase hex characters")
    name = f"pdserve/{prefill_id}/{decode_id}/{int(epoch)}"
    return f"{name}/{secret}" if secret else name


def _wire(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (what crosses the wire)."""
    if not t.is_contiguous():
        raise KvTransferError("pair channel tensors must be contiguous")
    return t.reshape(-1).view(torch.uint8)


class Op:
    """A started send or receive; holds its tensor alive until waited."""

    __slots__ = ("work", "tensor", "done")

    def __init__(self, work, tensor) -> None:
        self.work = work
        self.tensor = tensor
        self.done = False


class PairChannel:
    """One pair channel.

    ``store`` is ``"host:port"`` or a ``dist.Store``; ``rank`` 0 sends, 1 receives;
    ``device`` cpu -> Gloo, cuda -> NCCL; ``timeout`` (s) bounds the rendezvous and each
    ``send``/``recv``; ``cancel`` (rank 1) aborts the join when it returns True;
    ``secret`` must be the same on both ranks (empty: none); ``max_ctas`` caps the CTAs NCCL
    gives the communicator (None: ``PDSERVE_KV_CHANNEL_MAX_CTAS``; 0: NCCL's choice).
    """

    def __init__(self, store: str | dist.Store, prefill_id: str, decode_id: str, epoch: int,
                 rank: int, device: torch.device | str = "cpu", *,
                 timeout: float = DEFAULT_TIMEOUT,
                 stream: torch.cuda.Stream | None = None,
                 cancel: Callable[[], bool] | None = None,
                 high_priority: bool = False, secret: str = "", max_ctas: int | None = None) -> None:
        if rank not in (0, 1):
            raise KvTransferError(f"rank must be 0 (prefill) or 1 (decode), got {rank}")
        self.prefix = channel_prefix(prefill_id, decode_id, epoch)   # for logs: no secret
        self._store_prefix = channel_prefix(prefill_id, decode_id, epoch, secret)
        self.secret = secret
        self.prefill_id, self.decode_id = prefill_id, decode_id
        self.epoch = int(epoch)
        self.rank = rank
        self.peer = 1 - rank
        self.timeout = float(timeout)
        self.max_ctas = env.kv_channel_max_ctas() if max_ctas is None else int(max_ctas)
        if self.max_ctas < 0:
            raise KvTransferError(f"max_ctas must be >= 0, got {self.max_ctas}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cpu", "cuda"):
            raise KvTransferError(f"unsupported device {device}")
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.stream: torch.cuda.Stream | None = None    # set exactly when is_cuda
        if self.is_cuda:
            if not nccl_available():
                raise KvTransferError("CUDA pair channel needs torch.distributed with NCCL")
            self.stream = stream if stream is not None else torch.cuda.Stream(device)
        self._broken = False
        self._closed = False
        self._reason = ""
        self._lock = threading.Lock()
        self._pg = None
        self._store: dist.Store | None = None
        self._build(store, cancel, high_priority)

    @property
    def is_broken(self) -> bool:
        """True after a failure, a timeout, ``abort()`` or ``close()``."""
        return self._broken or self._closed

    @property
    def backend(self) -> str:
        return "nccl" if self.is_cuda else "gloo"

    def __repr__(self) -> str:
        state = "broken" if self._broken else ("closed" if self._closed else "open")
        return f"PairChannel({self.prefix}, rank {self.rank}, {self.backend}, {state})"

    def _error(self, what: str, exc: BaseException | None = None) -> KvTransferError:
        detail = f": {exc}" if exc is not None else ""
        return KvTransferError(f"pair channel {self.prefix} (rank {self.rank}, {self.backend}): "
                               f"{what}{detail}")

    def _build(self, store, cancel, high_priority) -> None:
        deadline = time.monotonic() + self.timeout
        client = connect_store(store, self.timeout) if isinstance(store, str) else store
        prefix_store = dist.PrefixStore(self._store_prefix, client)
        self._store = client
        if self.rank == 0:
            prefix_store.set(_JOIN_KEY, "1")
        else:
            self._wait_for_sender(prefix_store, deadline, cancel)
        # NCCL's communicator set-up has no timeout: build in a helper thread, give up at the deadline.
        result: dict = {}
        done = threading.Event()
        abandoned = threading.Event()

        def build() -> None:
            pg = None
            try:
                if self.is_cuda:
                    torch.cuda.set_device(self.device)
                pg = self._make_pg(prefix_store, deadline, high_priority)
                self._handshake(pg, deadline)
                result["pg"] = pg
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                result["error"] = e
            finally:
                done.set()
                if abandoned.is_set() and "pg" in result:
                    abort_pg(result.pop("pg"), self.is_cuda)

        thread = threading.Thread(target=build, name=f"kv-join-{self.prefix}", daemon=True)
        thread.start()
        if not done.wait(max(0.0, deadline - time.monotonic()) + 5.0):
            abandoned.set()
            self._broken = True
            raise self._error(f"rendezvous timed out after {self.timeout:.1f}s "
                              "(the peer did not join)")
        if "error" in result:
            self._broken = True
            raise self._error("rendezvous failed", result["error"]) from result["error"]
        self._pg = result["pg"]

    def _wait_for_sender(self, prefix_store, deadline: float, cancel) -> None:
        # Poll with check() (no blocking wait: a store wait that times out logs warnings).
        delay = 0.001
        while True:
            try:
                if prefix_store.check([_JOIN_KEY]):
                    return
            except Exception as e:  # noqa: BLE001 - the store went away
                raise self._error("KV store failed while waiting for the prefill worker", e) from e
            if cancel is not None and cancel():
                raise self._error("superseded by a newer epoch before the peer joined")
            if time.monotonic() >= deadline:
                raise self._error(f"the prefill worker did not join within {self.timeout:.1f}s")
            time.sleep(delay)
            delay = min(0.02, delay * 2)

    def _make_pg(self, prefix_store, deadline: float, high_priority: bool):
        left = max(1.0, deadline - time.monotonic())
        if not self.is_cuda:
            return dist.ProcessGroupGloo(prefix_store, self.rank, 2, seconds(left))
        # Unless set, do not let an NCCL error (a dead peer) kill this process.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        os.environ.setdefault("TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING", "false")
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = bool(high_priority)
        # Backstop only: this module aborts the group itself at its own timeout.
        opts._timeout = seconds(2 * self.timeout + 30.0)
        if self.max_ctas:
            cap_ctas(opts, self.max_ctas)
        for attr, value in (("group_name", self.prefix), ("global_ranks_in_group", [0, 1])):
            try:
                setattr(opts, attr, value)
            except Exception:  # noqa: BLE001 - optional fields of some torch versions
                pass
        pg = dist.ProcessGroupNCCL(prefix_store, self.rank, 2, opts)
        eager = getattr(pg, "eager_connect_single_device", None)
        if eager is not None:
            eager(self.device)
        return pg

    def _handshake(self, pg, deadline: float) -> None:
        t = torch.tensor([_HANDSHAKE_MAGIC, self.epoch], dtype=torch.int64)
        if self.is_cuda:
            t = t.to(self.device)
        if self.rank == 0:
            self._run([lambda: pg.send([t], self.peer, 0)], deadline, pg)
        else:
            t.zero_()
            self._run([lambda: pg.recv([t], self.peer, 0)], deadline, pg)
            got = t.tolist()
            if got != [_HANDSHAKE_MAGIC, self.epoch]:
                raise self._error(f"bad handshake {got}")

    def _pg_or_raise(self):
        pg = self._pg
        if pg is None or self.is_broken:
            raise self._error(f"channel is {'closed' if self._closed else 'broken'}"
                              + (f" ({self._reason})" if self._reason else ""))
        return pg

    def isend(self, tensor: torch.Tensor, tag: int = 0):
        """Start sending ``tensor``; returns an ``Op`` (CUDA: ordered after ``self.stream``)."""
        pg = self._pg_or_raise()
        try:
            if self.is_cuda:
                with torch.cuda.stream(self.stream):
                    return Op(pg.send([_wire(tensor)], self.peer, tag), tensor)
            return Op(pg.send([_wire(tensor)], self.peer, tag), tensor)
        except Exception as e:
            self._fail(f"send failed: {e}")
            raise self._error("send failed", e) from e

    def irecv(self, tensor: torch.Tensor, tag: int = 0):
        """Start receiving into ``tensor``; returns an ``Op`` (CUDA: ordered after ``self.stream``)."""
        pg = self._pg_or_raise()
        try:
            if self.is_cuda:
                with torch.cuda.stream(self.stream):
                    return Op(pg.recv([_wire(tensor)], self.peer, tag), tensor)
            return Op(pg.recv([_wire(tensor)], self.peer, tag), tensor)
        except Exception as e:
            self._fail(f"recv failed: {e}")
            raise self._error("recv failed", e) from e

    def wait(self, work: Op, deadline: float) -> None:
        """Order what follows after ``work``. CPU: block until it completed (or the deadline,
        a ``time.monotonic()`` value). CUDA: make ``self.stream`` wait for it (no CPU block)."""
        try:
            if self.is_cuda:
                with torch.cuda.stream(self.stream):
                    work.work.wait()
            elif not work.done:  # a Gloo work must be waited once only
                work.work.wait(seconds(deadline - time.monotonic()))
                work.done = True
        except Exception as e:
            self._fail(f"transfer failed: {e}")
            raise self._error("transfer failed", e) from e
        if self._broken:
            raise self._error("channel was aborted" + (f" ({self._reason})" if self._reason else ""))

    def synchronize(self, works: Iterable, deadline: float) -> None:
        """Block until every work completed; at ``deadline`` (monotonic) break the channel and raise."""
        works = [w for w in works if w is not None]
        if not self.is_cuda:
            for w in works:
                self.wait(w, deadline)
            return
        pending = works
        t_start = time.monotonic()
        fine_timer_slack()
        while pending:
            if self._broken:
                raise self._error("channel was aborted"
                                  + (f" ({self._reason})" if self._reason else ""))
            try:
                pending = [w for w in pending if not w.work.is_completed()]
            except Exception as e:
                self._fail(f"transfer failed: {e}")
                raise self._error("transfer failed", e) from e
            if not pending:
                break
            now = time.monotonic()
            if now >= deadline:
                what = f"timed out after {now - t_start:.1f}s"
                self._fail(what)
                self.abort(what)
                raise self._error(f"{what} (peer dead or stalled?)")
            # Yield first, then short sleeps (chosen by measurement: bench/NOTES.md).
            time.sleep(0 if now - t_start < 0.002 else POLL_SLEEP_S)
        for w in works:  # re-raise a recorded error (e.g. communicator aborted)
            self.wait(w, deadline)

    def _run(self, starts: list[Callable], deadline: float, pg=None):
        works = [Op(start(), None) for start in starts]
        self.synchronize(works, deadline)
        return works

    def send(self, tensor: torch.Tensor, tag: int = 0) -> torch.cuda.Event | None:
        """Send ``tensor`` and wait until it crossed; CUDA: returns an event after the send."""
        deadline = time.monotonic() + self.timeout
        if self.stream is not None:     # CUDA
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        work = self.isend(tensor, tag)
        self.synchronize([work], deadline)
        return self._record()

    def recv(self, tensor: torch.Tensor, tag: int = 0) -> torch.cuda.Event | None:
        """Receive into ``tensor``; CUDA: returns an event to wait on before reading it."""
        deadline = time.monotonic() + self.timeout
        if self.stream is not None:     # CUDA
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        work = self.irecv(tensor, tag)
        self.synchronize([work], deadline)
        return self._record()

    def _record(self) -> torch.cuda.Event | None:
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def record_event(self) -> torch.cuda.Event | None:
        """CUDA: an event after everything enqueued on the side stream so far; CPU: None."""
        return self._record()

    def _fail(self, reason: str) -> None:
        with self._lock:
            if not self._broken:
                self._reason = reason
            self._broken = True

    def abort(self, reason: str = "aborted") -> None:
        """Break the channel (any thread). NCCL aborts the communicator; Gloo only marks it
        broken, since destroying it under a waiting thread is unsafe: the owner calls ``close()``."""
        self._fail(reason)
        if not self.is_cuda:
            return
        with self._lock:
            pg, self._pg = self._pg, None
            self._store = None
        if pg is not None:
            abort_pg(pg, self.is_cuda)

    def close(self) -> None:
        """Release the channel; NCCL communicators are aborted, so it never waits for a peer."""
        with self._lock:
            self._closed = True
            pg, self._pg = self._pg, None
            self._store = None
        if pg is not None:
            abort_pg(pg, self.is_cuda)
