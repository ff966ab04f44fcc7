"""The one exception type of the KV transfer layer."""
from __future__ import annotations


class KvTransferError(RuntimeError):
    """A KV transfer (or the pair channel under it) failed: timeout, peer death, bad
    arguments, a superseded or broken epoch, or a closed sender/receiver.

    The message names the pair (prefill worker, decode worker, epoch) where one is known.
    A failed transfer leaves its channel broken; the sender bumps its epoch for the next one.
    """
