"""Long-lived client channels that follow rotated credentials: :class:`RenewingChannels` keeps
one channel per address and, when the credential files' stamp changes, makes new channels for
later calls and closes the old ones after ``grace_s``. A channel found in TRANSIENT_FAILURE (its
peer went away) is replaced the same way, so a call to a peer restarted at the same address
connects at once instead of failing until the old channel's reconnect backoff ends.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import grpc
import grpc.aio

from pdserve.common.grpc_utils.server import client_channel
from pdserve.common.security.config import default_client_security

log = logging.getLogger(__name__)
RETIRE_GRACE_S = 60.0


class RenewingChannels:
    def __init__(self, options: Sequence[tuple[str, Any]] = (), grace_s: float = RETIRE_GRACE_S) -> None:
        # its own subchannels: a new channel to a peer must not inherit a shared subchannel's backoff
        self.options = [*options, ("grpc.use_local_subchannel_pool", 1)]
        self.grace_s = grace_s
        self._stamp = default_client_security().files_stamp()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.num_renewals = 0
        self.num_reconnects = 0       # channels replaced because they were in TRANSIENT_FAILURE

    def get(self, address: str) -> grpc.aio.Channel:
        """The channel to ``address``, made anew if the credential files changed or it is in
        TRANSIENT_FAILURE."""
        self.renew_if_rotated()
        channel = self._channels.get(address)
        if channel is not None and channel.get_state() is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            asyncio.get_running_loop().call_later(self.grace_s, _close_later, [channel])
            self.num_reconnects += 1
            channel = None
        if channel is None:
            channel = self._channels[address] = client_channel(address, options=self.options)
        return channel

    def renew_if_rotated(self) -> bool:
        """Retire every channel when the credential files changed; True if they did."""
        stamp = default_client_security().files_stamp()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        self.num_renewals += 1
        old, self._channels = list(self._channels.values()), {}
        if old:
            log.info("client credentials changed on disk: %d channel(s) renewed", len(old))
            asyncio.get_running_loop().call_later(self.grace_s, _close_later, old)
        return True

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(grace=None)


def _close_later(channels: list[grpc.aio.Channel]) -> None:
    for channel in channels:
        asyncio.ensure_future(channel.close(grace=None))
