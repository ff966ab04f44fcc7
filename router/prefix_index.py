"""Which KV blocks each worker holds, by block hash, fed by the workers' ``StreamKvEvents``.

Hashes are the chain of :mod:`common.hashing` (each hash covers every token up to the end of
its block), so a request's cached prefix on a worker is the longest run of leading hashes of its
chain that the worker holds. Workers are named by the router's key for them (their address).

Correctness and bounds. Each worker's stream starts with a snapshot; later messages are
numbered (``KvEvents.seq``, +1 per message; a snapshot carries the number of the last change it
includes). :meth:`PrefixIndex.apply` ignores messages the snapshot already covers, and on any
other gap (a lost or reordered message) drops the worker's view and answers False: the caller
re-subscribes and the next snapshot repairs the view (the worker is simply not matched until
then). A worker's view is bounded by its KV pool (``KvEvents.num_total_blocks`` of the
snapshot, else ``max_blocks_per_worker``): a view that outgrows it cannot be right (missed
evictions) and is dropped the same way. So the index holds at most sum(pool sizes) hashes and
is never wrong for longer than one re-subscription.
"""
from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Sequence

import xxhash

_U64 = struct.Struct("<Q")
_xxh3 = xxhash.xxh3_64_intdigest


def hash_chain(token_ids: Sequence[int], block_size: int) -> list[int]:
    """:func:`common.hashing.block_hash_chain`, the same hashes (a unit test checks), about 2x
    faster: the ids are packed once and each block is hashed in one call."""
    data = array("i", token_ids).tobytes()
    step = block_size * 4
    out: list[int] = []
    parent = None
    for start in range(0, (len(token_ids) // block_size) * step, step):
        block = data[start:start + step]
        parent = _xxh3(block if parent is None else _U64.pack(parent) + block)
        out.append(parent)
    return out


# A worker that reports no pool size: at most this many hashes are kept for it.
DEFAULT_MAX_BLOCKS_PER_WORKER = 1 << 20


class PrefixIndex:
    def __init__(self, max_blocks_per_worker: int = DEFAULT_MAX_BLOCKS_PER_WORKER) -> None:
        self._blocks: dict[str, set[int]] = {}      # worker -> hashes it holds
        self._owners: dict[int, set[str]] = {}      # hash -> workers holding it
        self._seq: dict[str, int] = {}              # worker -> number of the last change applied
        self._cap: dict[str, int] = {}              # worker -> most hashes it can hold
        self.max_blocks_per_worker = max_blocks_per_worker
        self.num_resyncs = 0                        # views dropped for a gap or an overflow

    def apply(self, worker: str, stored: Iterable[int] = (), evicted: Iterable[int] = (),
              snapshot: bool = False, seq: int = 0, capacity: int = 0) -> bool:
        """One KvEvents message: ``snapshot`` replaces the worker's view with ``stored``.

        Returns False when the message shows that the view cannot be trusted (a gap in
        ``seq`` after a snapshot, or more hashes than ``capacity``): the view is dropped and
        the caller must re-subscribe. ``seq`` 0 (an unnumbered worker) is never checked.
        """
        if snapshot:
            self.remove_worker(worker)
            self._seq[worker] = seq
            self._cap[worker] = capacity or self.max_blocks_per_worker
        elif seq:
            last = self._seq.get(worker)
            if last is not None and seq <= last:
                return True                          # already in the snapshot
            if last is None or seq != last + 1:
                return self._drop(worker)
            self._seq[worker] = seq
        held = self._blocks.setdefault(worker, set())
        for h in evicted:
            if h in held:
                held.discard(h)
                owners = self._owners.get(h)
                if owners is not None:
                    owners.discard(worker)
                    if not owners:
                        del self._owners[h]
        for h in stored:
            if h not in held:
                held.add(h)
                self._owners.setdefault(h, set()).add(worker)
        if len(held) > self._cap.get(worker, self.max_blocks_per_worker):
            return self._drop(worker)
        return True

    def _drop(self, worker: str) -> bool:
        self.remove_worker(worker)
        self.num_resyncs += 1
        return False

    def remove_worker(self, worker: str) -> None:
        """Forget a worker (it went down, restarted, or left DNS)."""
        self._seq.pop(worker, None)
        self._cap.pop(worker, None)
        for h in self._blocks.pop(worker, ()):
            owners = self._owners.get(h)
            if owners is not None:
                owners.discard(worker)
                if not owners:
                    del self._owners[h]

    def __bool__(self) -> bool:
        """Whether any worker holds any block (else no request can match anything)."""
        return bool(self._owners)

    def num_blocks(self, worker: str) -> int:
        return len(self._blocks.get(worker, ()))

    def workers(self) -> list[str]:
        return list(self._blocks)

    def num_hashes(self) -> int:
        """Distinct block hashes held by any worker (the index's size)."""
        return len(self._owners)

    def match(self, hash_chain: Sequence[int], workers: Iterable[str] | None = None) -> dict[str, int]:
        """``{worker: leading blocks of hash_chain it holds}`` (workers without a match are left
        out; ``workers`` restricts the answer to those names)."""
        allowed = None if workers is None else set(workers)
        result: dict[str, int] = {}
        if not hash_chain:
            return result
        active = set(self._owners.get(hash_chain[0], ()))
        if allowed is not None:
            active &= allowed
        for i, h in enumerate(hash_chain[1:], start=1):
            if not active:
                break
            owners = self._owners.get(h, ())
            for w in [w for w in active if w not in owners]:
                result[w] = i
                active.discard(w)
        for w in active:
            result[w] = len(hash_chain)
        return result
