"""The simulated worker's KV pool: the engine's own ``BlockManager`` (pdserve/common/engine), so prefix
hits, LRU eviction order and the stored / evicted events are exactly the engine's.

Same interface as ``pdserve.loadtest.scripted_worker.BlockPool``: a request's blocks are the block table
of a ``Sequence`` kept here (allocate -> commit when its KV is there -> grow per generated
token -> release).
"""
from __future__ import annotations

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.engine.sequence import Sequence
from pdserve.common.grpc_utils import ResourceExhausted
from pdserve.common.sampling_params import SamplingParams

_PARAMS = SamplingParams()
_FILLER = 1      # token id of the tokens a simulated decode appends (their blocks never match)


class ManagedPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.stored: list[int] = []
        self.evicted: list[int] = []
        self.bm = BlockManager(num_blocks, block_size, on_stored=self.stored.append,
                               on_evicted=self.evicted.append)
        self._seqs: dict[int, Sequence] = {}        # id(block table) -> its sequence

    @property
    def by_hash(self) -> dict[int, int]:
        return self.bm.hash_to_block_id

    @property
    def hit_tokens(self) -> int:
        return self.bm.num_hit_tokens

    @property
    def query_tokens(self) -> int:
        return self.bm.num_query_tokens

    def allocate(self, ids: list[int]) -> tuple[list[int], int, list[int]]:
        """(block table, cached tokens, []) for a prompt; its blocks are registered by commit."""
        seq = Sequence(list(ids), _PARAMS, self.bs)
        if not self.bm.can_allocate(seq):
            raise ResourceExhausted(f"no free KV blocks ({self.bm.num_blocks_needed(seq)} needed, "
                                    f"{self.bm.num_free_blocks} free)")
        self.bm.allocate(seq, register=False)
        self._seqs[id(seq.block_table)] = seq
        return seq.block_table, seq.num_cached_tokens, []

    def commit(self, blocks: list[int], chain: list[int]) -> None:
        seq = self._seqs.get(id(blocks))
        if seq is not None:
            self.bm.register_blocks(seq)

    def grow(self, blocks: list[int], num_tokens: int) -> bool:
        seq = self._seqs.get(id(blocks))
        if seq is None:
            return False
        while seq.num_tokens < num_tokens:
            seq.append_token(_FILLER)
            if not self.bm.can_append(seq):
                return False
            self.bm.may_append(seq)
        return True

    def release(self, blocks: list[int]) -> None:
        seq = self._seqs.pop(id(blocks), None)
        if seq is not None:
            self.bm.deallocate(seq)

    def take_events(self) -> tuple[list[int], list[int]]:
        stored, evicted = self.stored[:], self.evicted[:]
        self.stored.clear()
        self.evicted.clear()
        return stored, evicted

    def counts(self) -> dict[str, int]:
        bm = self.bm
        return dict(num_used_blocks=bm.num_used_blocks, num_cached_blocks=bm.num_cached_blocks,
                    num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks)
