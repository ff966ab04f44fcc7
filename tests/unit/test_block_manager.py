"""BlockManager: hash chain, sharing, reference counts, eviction of unreferenced cached blocks."""
from __future__ import annotations

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.engine.sequence import Sequence
from pdserve.common.hashing import NO_PARENT, block_hash, block_hash_chain
from pdserve.common.sampling_params import SamplingParams

BS = 4


def seq(tokens: list[int]) -> Sequence:
    return Sequence(tokens, SamplingParams(max_tokens=8), BS)


def test_hash_chain_depends_on_every_earlier_token():
    a = block_hash_chain([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    b = block_hash_chain([1, 2, 3, 4, 5, 6, 7, 8], BS)
    c = block_hash_chain([0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert len(a) == 2 and a == b                      # the partial tail is not hashed
    assert a[0] == block_hash([1, 2, 3, 4]) and a[1] == block_hash([5, 6, 7, 8], a[0])
    assert c[1] != a[1]                                # same second block, different parent
    assert block_hash([5, 6, 7, 8], NO_PARENT) != a[1]


def test_allocate_shares_prefix_and_counts_refs():
    bm = BlockManager(16, BS)
    s1 = seq(list(range(10)))          # blocks [0..3] [4..7] [8,9]
    bm.allocate(s1)
    assert s1.num_cached_tokens == 0 and len(s1.block_table) == 3
    assert bm.num_free_blocks == 13 and bm.num_cached_blocks == 2
    s2 = seq(list(range(8)) + [50, 51, 52])
    assert bm.num_blocks_needed(s2) == 1
    bm.allocate(s2)
    assert s2.block_table[:2] == s1.block_table[:2] and s2.block_table[2] != s1.block_table[2]
    assert s2.num_cached_tokens == 8
    assert [bm.blocks[b].ref_count for b in s1.block_table] == [2, 2, 1]
    assert bm.num_hit_tokens == 8 and bm.num_query_tokens == 21
    bm.deallocate(s1)
    assert [bm.blocks[b].ref_count for b in s2.block_table] == [1, 1, 1]
    bm.deallocate(s2)
    assert bm.is_whole() and s2.block_table == []


def test_last_block_is_never_a_hit():
    bm = BlockManager(8, BS)
    s1 = seq(list(range(8)))
    bm.allocate(s1)
    table = list(s1.block_table)
    bm.deallocate(s1)
    s2 = seq(list(range(8)))           # identical prompt: its last block must be recomputed
    bm.allocate(s2)
    assert s2.num_cached_tokens == 4
    assert s2.block_table[0] == table[0] and s2.block_table[1] != table[1]
    bm.deallocate(s2)
    assert bm.is_whole()


def test_freed_cached_blocks_are_hit_until_evicted_oldest_first():
    bm = BlockManager(4, BS)
    s1 = seq([1, 2, 3, 4, 5])
    bm.allocate(s1)
    first = s1.block_table[0]
    bm.deallocate(s1)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 1   # freed but still cached
    s2 = seq([1, 2, 3, 4, 9])
    assert bm.num_blocks_needed(s2) == 2                            # the hit block leaves the free pool too
    bm.allocate(s2)
    assert s2.block_table[0] == first and s2.num_cached_tokens == 4
    bm.deallocate(s2)
    # fill the pool with unrelated sequences: the cached block is evicted (oldest freed first)
    evicted = []
    bm.on_evicted = evicted.append
    others = [seq([100 + i] * 4 + [7]) for i in range(2)]
    for s in others:
        bm.allocate(s)
    assert bm.num_free_blocks == 0
    assert block_hash([1, 2, 3, 4]) in evicted and block_hash([1, 2, 3, 4]) not in bm.hash_to_block_id
    for s in others:
        bm.deallocate(s)
    assert bm.is_whole()


def test_may_append_adds_block_and_registers_full_block():
    stored = []
    bm = BlockManager(8, BS, on_stored=stored.append)
    s = seq([1, 2, 3])
    bm.allocate(s)
    assert len(s.block_table) == 1 and stored == []
    s.append_token(4)                 # fills block 0
    assert bm.can_append(s)
    bm.may_append(s)
    assert len(s.block_table) == 1 and stored == [block_hash([1, 2, 3, 4])]
    s.append_token(5)                 # starts block 1
    bm.may_append(s)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6
    bm.deallocate(s)
    assert bm.is_whole()


def test_can_append_false_when_pool_empty():
    bm = BlockManager(1, BS)
    s = seq([1, 2, 3, 4])
    bm.allocate(s)
    s.append_token(5)
    assert not bm.can_append(s)
    bm.deallocate(s)
    assert bm.is_whole()


def test_unregistered_reservation_is_not_hit_until_registered():
    bm = BlockManager(8, BS)
    s1 = seq(list(range(9)))
    bm.allocate(s1, register=False)    # KV still in flight from a prefill worker
    s2 = seq(list(range(9)))
    assert bm.num_blocks_needed(s2) == 3
    bm.register_blocks(s1)
    assert bm.num_blocks_needed(s2) == 1
    bm.deallocate(s1)
    assert bm.is_whole()
