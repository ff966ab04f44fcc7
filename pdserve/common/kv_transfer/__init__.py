"""KV-cache transfer between prefill and decode workers (docs/design.md, "KV cache and
transfer").

* ``KvStoreServer`` (store.py): the TCPStore a decode worker hosts (port 50054 by default).
* ``PairChannel`` (channel.py): a 2-rank Gloo (CPU) / NCCL (CUDA) process group for one
  (prefill worker, decode worker, epoch), built without a global default group.
* ``gather_blocks`` / ``scatter_blocks`` (blocks.py): whole blocks of the paged pool
  ``kv_cache[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
* ``KvSender`` / ``KvReceiver`` (sender.py, receiver.py; protocol in transfer.py): the ordered
  transfer protocol behind PushKV, with the first token optionally carried after the blocks.

No gRPC, protobuf or pickle here: tensors cross as raw bytes.
"""
from .blocks import DEFAULT_MAX_MESSAGE_BYTES, bytes_per_block, gather_blocks, plan_chunks, scatter_blocks
from .channel import DEFAULT_TIMEOUT, PairChannel, channel_prefix, new_pair_secret
from .errors import KvTransferError
from .receiver import KvReceiver, Received
from .sender import KvSender, PendingSend
from .store import KvStoreServer
from .transfer import FirstTokenRef, initial_epoch

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES", "DEFAULT_TIMEOUT", "FirstTokenRef",
    "KvReceiver", "KvSender", "KvStoreServer", "KvTransferError", "PairChannel", "PendingSend",
    "Received", "bytes_per_block", "channel_prefix", "gather_blocks", "new_pair_secret",
    "initial_epoch", "plan_chunks", "scatter_blocks",
]
