"""KV-cache transfer between prefill and decode workers: the transport interface and its registry
(transport.py), the pair-channel transports behind it (NCCL on GPU, Gloo on CPU), block
gather/scatter (docs/design.md, "KV cache and transfer"). No gRPC, protobuf or pickle here:
tensors cross as raw bytes."""
from .blocks import DEFAULT_MAX_MESSAGE_BYTES, bytes_per_block, gather_blocks, plan_chunks, scatter_blocks
from .channel import DEFAULT_TIMEOUT, PairChannel, channel_prefix, new_pair_secret
from .errors import KvTransferError
from .receiver import KvReceiver
from .sender import KvSender, PendingSend
from .store import KvStoreServer
from .transfer import FirstTokenRef, initial_epoch
from .transport import KvTransport, Received, get_transport, register_transport, resolve_transport_name

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES", "DEFAULT_TIMEOUT", "FirstTokenRef",
    "KvReceiver", "KvSender", "KvStoreServer", "KvTransferError", "KvTransport", "PairChannel", "PendingSend",
    "Received", "bytes_per_block", "channel_prefix", "gather_blocks", "get_transport", "new_pair_secret",
    "initial_epoch", "plan_chunks", "register_transport", "resolve_transport_name", "scatter_blocks",
]
