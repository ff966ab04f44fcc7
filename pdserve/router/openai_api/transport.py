"""HTTP plumbing of the API: bounded request bodies, JSON answers, and responses that end their
work when the client goes away.

A generation runs while a watcher waits for ``http.disconnect``; whichever ends first ends the
other, so a client that leaves cancels its generation at once. A streamed response sends its
headers with its first event, so a request that fails before any output still gets its status.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pdserve.router.openai_api.errors import ApiError, from_exception
from pdserve.router.openai_api.responses import DONE

log = logging.getLogger(__name__)
DRAIN_FACTOR = 4          # an oversized body is read (and dropped) up to this many times the limit
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class ClientGone(Exception):
    """The client disconnected before its answer was complete."""


async def read_json(request: Request, max_bytes: int) -> dict:
    """The request body as a JSON object: 413 over ``max_bytes``, 400 when it is no JSON object.

    An oversized body is read to its end and dropped (up to ``DRAIN_FACTOR`` times the limit)
    before the 413 goes out: a client still sending would otherwise see a reset connection
    instead of the answer.
    """
    declared = request.headers.get("content-length")
    too_big = declared is not None and declared.isdigit() and int(declared) > max_bytes
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                too_big = True
                if size > DRAIN_FACTOR * max_bytes:
                    break
            elif not too_big:
                chunks.append(chunk)
    except ClientDisconnect as e:
        raise ClientGone() from e
    if too_big:
        raise ApiError(413, f"request body of {declared or 'more than ' + str(size)} bytes is over the limit "
                            f"of {max_bytes} bytes", code="request_too_large")
    try:
        body = json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(obj, separators=(",", ":"), ensure_ascii=False), status_code=status,
                    headers=headers, media_type="application/json")


def error_response(err: ApiError) -> Response:
    return Response(err.json_bytes(), status_code=err.status, headers=err.headers(), media_type="application/json")


async def _send_error(send: Send, err: ApiError) -> None:
    headers = [(b"content-type", b"application/json")] + [(k.encode(), v.encode()) for k, v in err.headers().items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": err.json_bytes(), "more_body": False})


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Watched(Response):
    """Runs ``work(send)`` and cancels it when the client disconnects first."""

    def __init__(self, work: Callable[[Send], Awaitable[None]], what: str) -> None:
        self.work = work
        self.what = what
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self.work(send))
        watcher = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, watcher):
                task.cancel()
            await asyncio.gather(work, watcher, return_exceptions=True)
        if work.cancelled():
            log.info("%s: client disconnected; request cancelled", self.what)
            return
        error = work.exception()
        if error is not None:
            raise error


def whole(produce: Callable[[], Awaitable[dict]], what: str) -> Watched:
    """A JSON answer computed by ``produce()`` (errors in OpenAI's shape)."""
    async def work(send: Send) -> None:
        try:
            obj = await produce()
        except Exception as e:  # noqa: BLE001 - every failure is answered
            await _send_error(send, from_exception(e))
            return
        body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    return Watched(work, what)


def event_stream(events: AsyncGenerator[bytes, None], what: str) -> Watched:
    """Server-sent events; an error after the first event is sent as an ``error`` event."""
    async def work(send: Send) -> None:
        try:
            try:
                first = await events.__anext__()
            except StopAsyncIteration:
                first = b""
            except Exception as e:  # noqa: BLE001 - nothing sent yet: a real status
                await _send_error(send, from_exception(e))
                return
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            try:
                async for event in events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            except Exception as e:  # noqa: BLE001 - the status is sent: tell the client in the stream
                log.warning("%s failed mid-stream: %s", what, e)
                err = from_exception(e)
                await send({"type": "http.response.body", "body": b"data: " + err.json_bytes() + b"\n\n" + DONE,
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await events.aclose()
    return Watched(work, what)
