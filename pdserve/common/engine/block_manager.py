"""Paged KV-cache blocks: free/used pools, reference counts and hash-chained prefix caching.

A full block gets a hash (pdserve/common/hashing.py) and can be reused by any sequence with the
same hash chain; a freed block keeps its hash and contents until the pool hands it out again
(least recently freed last: the eviction order).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pdserve.common.engine.sequence import Sequence
from pdserve.common.hashing import NO_PARENT, block_hash


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_PARENT
        self.token_ids: list[int] = []

    def set_hash(self, h: int, token_ids: list[int]) -> None:
        self.hash = h
        self.token_ids = list(token_ids)

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = NO_PARENT
        self.token_ids = []


class BlockManager:
    """Owns the block pool of one worker's KV cache.

    ``allocate`` once per WAITING sequence with an empty table, for its whole prompt; it sets
    ``num_cached_tokens`` and never hits the last prompt block (the prefill needs a token to
    compute); a sequence that will fork (``Sequence.num_forks``) also takes one block per fork,
    kept in ``fork_block_ids`` until ``fork`` hands them out. ``may_append`` before every decode
    step, after ``can_append``. ``on_stored`` /
    ``on_evicted`` (optional) hear of hashes entering and leaving the cache (router's index).
    """

    def __init__(self, num_blocks: int, block_size: int,
                 on_stored: Callable[[int], None] | None = None,
                 on_evicted: Callable[[int], None] | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # insertion order = eviction order (the oldest freed block is handed out first)
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.on_stored = on_stored
        self.on_evicted = on_evicted
        self.num_hit_tokens = 0      # prompt tokens served from the cache
        self.num_query_tokens = 0    # prompt tokens looked up

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self.used_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block_id)

    def is_whole(self) -> bool:
        """True when no block is referenced: every block is free."""
        return (self.num_free_blocks == self.num_blocks and not self.used_block_ids
                and all(b.ref_count == 0 for b in self.blocks))

    def _take_free_block(self, block_id: int, keep_hash: bool = False) -> Block:
        """Move a free block to the used pool; unless ``keep_hash``, its cached contents are evicted."""
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"block {block_id} is referenced"
        del self.free_block_ids[block_id]
        self.used_block_ids.add(block_id)
        if keep_hash:
            block.ref_count = 1
            return block
        if block.hash != NO_PARENT and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
            if self.on_evicted:
                self.on_evicted(block.hash)
        block.reset()
        return block

    def _allocate_new_block(self) -> Block:
        return self._take_free_block(next(iter(self.free_block_ids)))

    def _release_block(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} released twice"
        if block.ref_count == 0:
            self.used_block_ids.remove(block_id)
            self.free_block_ids[block_id] = None  # most recently freed: evicted last

    def _register(self, block: Block, h: int, token_ids: list[int]) -> None:
        block.set_hash(h, token_ids)
        if self.hash_to_block_id.get(h) != block.block_id:
            self.hash_to_block_id[h] = block.block_id
            if self.on_stored:
                self.on_stored(h)

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Block ids of the leading full blocks of ``seq`` found in the cache (never the last;
        none while it needs prompt logprobs: every position must be computed)."""
        hits: list[int] = []
        if seq.needs_prompt_logprobs:
            return hits
        parent = NO_PARENT
        for i in range((seq.num_tokens - 1) // self.block_size):
            token_ids = seq.block(i)
            parent = block_hash(token_ids, parent)
            block_id = self.hash_to_block_id.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != token_ids:
                break
            hits.append(block_id)
        return hits

    def num_blocks_needed(self, seq: Sequence) -> int:
        """Blocks ``allocate(seq)`` would take out of the free pool (cached free blocks included)."""
        hits = self._prefix_hits(seq)
        return seq.num_blocks - len(hits) + sum(self.blocks[b].ref_count == 0 for b in hits) + seq.num_forks

    def prefix_hit_tokens(self, seq: Sequence) -> int:
        """Leading tokens of ``seq`` that ``allocate`` would find in the cache."""
        return len(self._prefix_hits(seq)) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_blocks_needed(seq) <= self.num_free_blocks

    def allocate(self, seq: Sequence, register: bool = True) -> None:
        """Give ``seq`` a block table for all its tokens, reusing cached prefix blocks; with
        ``register=False`` new full blocks stay private until ``register_blocks`` (imported KV)."""
        assert not seq.block_table, f"{seq} already has blocks"
        hits = self._prefix_hits(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self._take_free_block(block_id, keep_hash=True)
            else:
                block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(len(hits), seq.num_blocks):
            seq.block_table.append(self._allocate_new_block().block_id)
        seq.fork_block_ids = [self._allocate_new_block().block_id for _ in range(seq.num_forks)]
        if register:
            self.register_blocks(seq)
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_prefix_hit_tokens = seq.num_cached_tokens
        self.num_hit_tokens += seq.num_cached_tokens
        self.num_query_tokens += seq.num_tokens

    def register_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Offer the full blocks of ``seq``'s first ``num_tokens`` tokens (default: all of them)
        to the prefix cache: their KV is, or is about to be, there."""
        parent = NO_PARENT
        upto = seq.num_tokens if num_tokens is None else min(num_tokens, seq.num_tokens)
        for i in range(upto // self.block_size):
            token_ids = seq.block(i)
            parent = block_hash(token_ids, parent)
            block = self.blocks[seq.block_table[i]]
            if block.hash != parent:
                self._register(block, parent, token_ids)

    def deallocate(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (in reverse, so a prefix outlives its suffix)."""
        for block_id in seq.fork_block_ids:
            self._release_block(block_id)
        seq.fork_block_ids = []
        for block_id in reversed(seq.block_table):
            self._release_block(block_id)
        seq.block_table.clear()
        seq.num_cached_tokens = 0

    def fork(self, seq: Sequence, child: Sequence) -> tuple[int, int]:
        """Give ``child`` (a new sample of ``seq``, same prompt, no blocks) ``seq``'s blocks
        before the one holding the prompt's last token, shared (one more reference each), and
        one of ``seq``'s fork blocks for that last block: the copy-on-write. Returns (source,
        destination) of the block copy the KV cache must make before ``child`` computes."""
        assert not child.block_table and seq.fork_block_ids, (seq, child)
        last = (seq.num_prompt_tokens - 1) // self.block_size
        for block_id in seq.block_table[:last]:
            self.blocks[block_id].ref_count += 1
            child.block_table.append(block_id)
        dst = seq.fork_block_ids.pop()
        child.block_table.append(dst)
        return seq.block_table[last], dst

    def can_append(self, seq: Sequence) -> bool:
        """Room for the KV of ``seq``'s newest token (a new block only when the last one is full)."""
        needs_block = len(seq.block_table) < seq.num_blocks
        return self.num_free_blocks >= int(needs_block)

    def may_append(self, seq: Sequence) -> None:
        """Before a decode step: add a block if the newest token starts one; hash a block it fills."""
        if len(seq.block_table) < seq.num_blocks:
            seq.block_table.append(self._allocate_new_block().block_id)
        if seq.num_tokens % self.block_size == 0 and seq.last_token >= 0:
            self.register_block(seq, seq.num_blocks - 1)

    def register_block(self, seq: Sequence, i: int) -> None:
        """Offer full block ``i`` of ``seq`` to the prefix cache once its tokens are known and the
        step computing its last token's KV is under way; needs block ``i-1`` registered."""
        parent = self.blocks[seq.block_table[i - 1]].hash if i > 0 else NO_PARENT
        if i > 0 and parent == NO_PARENT:
            return  # an earlier block was never registered: the chain is broken here
        token_ids = seq.block(i)
        self._register(self.blocks[seq.block_table[i]], block_hash(token_ids, parent), token_ids)
