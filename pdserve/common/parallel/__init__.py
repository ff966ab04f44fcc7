"""Tensor parallelism inside one worker: the rank group and its collectives (group.py), how a
model's heads, MLP columns and vocabulary are split over the ranks (sharding.py), and the
Megatron-style layers built on them (linear.py: column / row parallel; embedding.py: vocab
parallel embedding and LM head). At one rank every layer is a plain matmul with no collective.
The rank processes and the per-step broadcast are the engine's (pdserve/common/engine/ranks.py)."""
from .group import RankFailure, RankGroup, tp_rank, tp_size
from .sharding import HeadShard, check_tensor_parallel, head_shard, split_evenly, vocab_shard

__all__ = ["HeadShard", "RankFailure", "RankGroup", "check_tensor_parallel", "head_shard", "split_evenly",
           "tp_rank", "tp_size", "vocab_shard"]
