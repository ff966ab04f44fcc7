"""Cancel until answered: the router's Cancel of a request on a worker is tried again (no answer:
UNAVAILABLE, DEADLINE_EXCEEDED) after CANCEL_BACKOFF_S, doubling up to CANCEL_BACKOFF_MAX_S, for
at most CANCEL_RETRY_S (a lease and then some: by then a reservation has expired anyway), or
until the worker is known gone. Any other answer, an error of the worker's own included, ends it."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import grpc
import grpc.aio

log = logging.getLogger(__name__)

CANCEL_BACKOFF_S = 0.1
CANCEL_BACKOFF_MAX_S = 2.0
CANCEL_RETRY_S = 45.0
RETRY_CANCEL_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def cancel_until_answered(call: Callable[[], Awaitable[object]], request_id: str, key: str,
                                gone: Callable[[], bool]) -> None:
    """Run ``call`` (one Cancel rpc of ``request_id`` on worker ``key``) until answered, given up,
    or ``gone()`` (the worker is down, closed or restarted: it holds nothing of the request any
    more). Never raises."""
    started, delay, tries = time.monotonic(), CANCEL_BACKOFF_S, 0
    while True:
        tries += 1
        try:
            await call()
            if tries > 1:
                log.info("Cancel %s on %s answered after %d tries", request_id, key, tries)
            return
        except grpc.aio.AioRpcError as e:
            code = e.code()
        if code not in RETRY_CANCEL_CODES:          # answered (an error of its own): done
            log.debug("Cancel %s on %s: %s", request_id, key, code.name)
            return
        is_gone = gone()
        if is_gone or time.monotonic() - started + delay > CANCEL_RETRY_S:
            log.log(logging.DEBUG if is_gone else logging.WARNING, "Cancel %s on %s: %s after %d tries; %s",
                    request_id, key, code.name, tries,
                    "the worker is gone" if is_gone else "giving up (its lease ends it)")
            return
        await asyncio.sleep(delay)
        delay = min(delay * 2, CANCEL_BACKOFF_MAX_S)
