"""Which KV blocks each worker holds, by block hash, fed by the workers' ``StreamKvEvents``.

Hashes are the chain of :mod:`pdserve.common.hashing` (each hash covers every token up to the end of
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

from collections.abc import Iterable, Sequence

from pdserve.common.hashing import extend_chain, token_bytes


class PromptHasher:
    """:func:`~pdserve.common.hashing.block_hash_chain` that reuses the hashes of an earlier
    prompt sharing a prefix.

    Prompts are remembered by their first block's bytes (the most recent prompt per first block,
    at most ``max_prompts`` of them, oldest dropped first). A new prompt is compared byte for
    byte with the remembered one (a binary search over the number of equal leading blocks, each
    step one C-level comparison): the equal blocks take the remembered hashes, only the rest is
    hashed. Exact, not probabilistic: a hash is reused only for identical token bytes, so a
    system prompt or an earlier turn shared by many requests is hashed once."""

    def __init__(self, max_prompts: int = 1024) -> None:
        self.max_prompts = max_prompts
        self._last: dict[bytes, tuple[bytes, list[int]]] = {}   # first block -> (prompt bytes, chain)
        self.num_reused_blocks = 0

    def chain(self, token_ids: Sequence[int], block_size: int) -> list[int]:
        num_blocks = len(token_ids) // block_size
        if num_blocks == 0:
            return []
        step = block_size * 4
        data = token_bytes(token_ids)
        key = data[:step]
        known = self._last.get(key)
        same = 0
        if known is not None:
            old, old_chain = known
            lo, hi = 1, min(num_blocks, len(old_chain))     # block 0 is equal (the key)
            while lo < hi:                                  # largest equal leading block count
                mid = (lo + hi + 1) // 2
                if data[:mid * step] == old[:mid * step]:
                    lo = mid
                else:
                    hi = mid - 1
            same = lo
            self.num_reused_blocks += same
            if same == num_blocks:
                return old_chain[:num_blocks]
            chain = extend_chain(data, block_size, num_blocks, old_chain[:same])
        else:
            chain = extend_chain(data, block_size, num_blocks, [])
        self._last.pop(key, None)
        self._last[key] = (data, chain)
        if len(self._last) > self.max_prompts:
            del self._last[next(iter(self._last))]
        return chain


# A worker that reports no pool size: at most this many hashes are kept for it.
DEFAULT_MAX_BLOCKS_PER_WORKER = 1 << 20


class PrefixIndex:
    """Worker views as sets of hashes, and per hash a bitmask of the workers holding it (one bit
    per worker, reused after the worker leaves): a longest-prefix match is one integer AND per
    block of the request, whatever the number of workers."""

    def __init__(self, max_blocks_per_worker: int = DEFAULT_MAX_BLOCKS_PER_WORKER) -> None:
        self._blocks: dict[str, set[int]] = {}      # worker -> hashes it holds
        self._owners: dict[int, int] = {}           # hash -> bitmask of the workers holding it
        self._bit: dict[str, int] = {}              # worker -> its bit (1 << i)
        self._names: dict[int, str] = {}            # bit -> worker
        self._seq: dict[str, int] = {}              # worker -> number of the last change applied
        self._cap: dict[str, int] = {}              # worker -> most hashes it can hold
        self.max_blocks_per_worker = max_blocks_per_worker
        self.num_resyncs = 0                        # views dropped for a gap or an overflow
        self.hasher = PromptHasher()                # the router's prompts, hashed for match()

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
        held = self._blocks.get(worker)
        if held is None:
            held = self._blocks[worker] = set()
        bit = self._bit_of(worker)
        owners = self._owners
        for h in evicted:
            if h in held:
                held.discard(h)
                mask = owners.get(h, 0) & ~bit
                if mask:
                    owners[h] = mask
                else:
                    owners.pop(h, None)
        for h in stored:
            if h not in held:
                held.add(h)
                owners[h] = owners.get(h, 0) | bit
        if len(held) > self._cap.get(worker, self.max_blocks_per_worker):
            return self._drop(worker)
        return True

    def _bit_of(self, worker: str) -> int:
        bit = self._bit.get(worker)
        if bit is None:
            i = 0
            while (1 << i) in self._names:
                i += 1
            bit = 1 << i
            self._bit[worker] = bit
            self._names[bit] = worker
        return bit

    def _drop(self, worker: str) -> bool:
        self.remove_worker(worker)
        self.num_resyncs += 1
        return False

    def remove_worker(self, worker: str) -> None:
        """Forget a worker (it went down, restarted, or left DNS)."""
        self._seq.pop(worker, None)
        self._cap.pop(worker, None)
        bit = self._bit.pop(worker, None)
        held = self._blocks.pop(worker, ())
        if bit is None:
            return
        del self._names[bit]
        owners = self._owners
        for h in held:
            mask = owners.get(h, 0) & ~bit
            if mask:
                owners[h] = mask
            else:
                owners.pop(h, None)

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
        out; ``workers`` restricts the answer to those names). One AND per block of the chain
        until no worker is left: O(prefix blocks)."""
        result: dict[str, int] = {}
        owners = self._owners
        active = owners.get(hash_chain[0], 0) if hash_chain else 0
        if workers is not None:
            bits = self._bit
            active &= sum(bits.get(w, 0) for w in set(workers))
        i = 1
        n = len(hash_chain)
        while active and i < n:
            kept = active & owners.get(hash_chain[i], 0)
            if kept != active:
                self._name_bits(active & ~kept, i, result)
                active = kept
            i += 1
        if active:
            self._name_bits(active, n, result)
        return result

    def _name_bits(self, mask: int, blocks: int, out: dict[str, int]) -> None:
        names = self._names
        while mask:
            low = mask & -mask
            out[names[low]] = blocks
            mask ^= low
