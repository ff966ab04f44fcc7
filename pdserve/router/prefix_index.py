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

    Prompts are remembered by their first block's bytes: up to ``PROMPTS_PER_KEY`` recent
    prompts per first block (e.g. the conversations going on over one system prompt), at most
    ``max_prompts`` in all (the least recently used first block's dropped first). A new prompt
    takes the hashes of the longest remembered prompt that is a whole prefix of it (a multi-turn
    chat's previous turn: one C-level ``startswith`` per remembered prompt); failing that, of the
    most recent one, compared byte for byte (a binary search over the number of equal leading
    blocks, each step one C-level comparison). Only the rest is hashed. Exact, not probabilistic:
    a hash is reused only for identical token bytes, so a system prompt or an earlier turn shared
    by many requests is hashed once. A prompt that extends a remembered one replaces it."""

    PROMPTS_PER_KEY = 8

    def __init__(self, max_prompts: int = 1024) -> None:
        self.max_prompts = max_prompts
        # first block -> [(prompt bytes up to its last full block, chain)], most recent last
        self._last: dict[bytes, list[tuple[bytes, list[int]]]] = {}
        self._num_prompts = 0
        self.num_reused_blocks = 0

    def chain(self, token_ids: Sequence[int], block_size: int) -> list[int]:
        num_blocks = len(token_ids) // block_size
        if num_blocks == 0:
            return []
        step = block_size * 4
        data = token_bytes(token_ids)
        key = data[:step]
        known = self._last.pop(key, None)
        if known is None:
            known = []
        same, base = self._reusable(data, num_blocks, step, known)
        if base is not None:
            self.num_reused_blocks += same
            old_chain = base[1]
            if same == num_blocks:
                self._remember(key, known)
                return old_chain[:num_blocks]
            chain = extend_chain(data, block_size, num_blocks, old_chain[:same])
            if same == len(old_chain):
                known.remove(base)                   # the prompt it extends: replaced
                self._num_prompts -= 1
        else:
            chain = extend_chain(data, block_size, num_blocks, [])
        known.append((data[:num_blocks * step], chain))
        self._num_prompts += 1
        if len(known) > self.PROMPTS_PER_KEY:
            del known[0]
            self._num_prompts -= 1
        self._remember(key, known)
        return chain

    @staticmethod
    def _reusable(data: bytes, num_blocks: int, step: int,
                  known: list[tuple[bytes, list[int]]]) -> tuple[int, tuple[bytes, list[int]] | None]:
        """(equal leading blocks, the remembered prompt they come from), or (0, None)."""
        if not known:
            return 0, None
        best: tuple[bytes, list[int]] | None = None
        for entry in known:                             # whole prefixes first: the longest
            if data.startswith(entry[0]) and (best is None or len(entry[1]) > len(best[1])):
                best = entry
        if best is not None:
            return min(len(best[1]), num_blocks), best
        old, old_chain = latest = known[-1]
        lo, hi = 1, min(num_blocks, len(old_chain))     # block 0 is equal (the key)
        while lo < hi:                                  # largest equal leading block count
            mid = (lo + hi + 1) // 2
            if data[:mid * step] == old[:mid * step]:
                lo = mid
            else:
                hi = mid - 1
        return lo, latest

    def _remember(self, key: bytes, known: list[tuple[bytes, list[int]]]) -> None:
        """Puts ``key``'s prompts back as the most recently used; drops the least recently used
        keys' prompts past ``max_prompts``."""
        self._last[key] = known
        while self._num_prompts > self.max_prompts and self._last:
            self._num_prompts -= len(self._last.pop(next(iter(self._last))))


# A worker that reports no pool size: at most this many hashes are kept for it.
DEFAULT_MAX_BLOCKS_PER_WORKER = 1 << 20
# Bitmasks whose workers' names match() remembers (cleared when full or when a worker's bit changes).
MAX_NAMED_MASKS = 4096


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
        self._named: dict[int, tuple[str, ...]] = {}   # bitmask -> its workers' names (match's memo)

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
            self._named.clear()
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
        self._named.clear()                          # its bit may name another worker later
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
        until no worker is left: O(prefix blocks); the workers of each bitmask that ends a run are
        named once and remembered (masks repeat: the same workers hold the same prefixes), so the
        answer costs one dict update per distinct run length, not a Python step per worker."""
        result: dict[str, int] = {}
        owners = self._owners
        active = owners.get(hash_chain[0], 0) if hash_chain else 0
        if workers is not None:
            bits = self._bit
            active &= sum(bits.get(w, 0) for w in set(workers))
        if not active:
            return result
        get = owners.get
        for i, h in enumerate(hash_chain[1:], 1):
            kept = active & get(h, 0)
            if kept != active:
                result.update(dict.fromkeys(self._named_bits(active & ~kept), i))
                active = kept
                if not active:
                    return result
        result.update(dict.fromkeys(self._named_bits(active), len(hash_chain)))
        return result

    def _named_bits(self, mask: int) -> tuple[str, ...]:
        names = self._named.get(mask)
        if names is None:
            if len(self._named) >= MAX_NAMED_MASKS:
                self._named.clear()
            out = []
            m = mask
            while m:
                low = m & -m
                out.append(self._names[low])
                m ^= low
            names = self._named[mask] = tuple(out)
        return names
