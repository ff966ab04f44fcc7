"""The one exception type of the KV transfer layer."""
from __future__ import annotations


class KvTransferError(RuntimeError):
    """A KV transfer or its pair channel failed (timeout, peer death, bad arguments, stale or
    broken epoch, closed endpoint); the message names the pair where known."""
