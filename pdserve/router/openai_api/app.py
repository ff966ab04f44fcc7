"""The OpenAI-compatible HTTP API as a Starlette (ASGI) application.

    POST /v1/completions        POST /v1/chat/completions      (stream: true -> server-sent events)
    GET  /v1/models             GET  /health

Bearer-token auth (when a checker is given) guards /v1/*; /health stays open, as the gRPC
health service does. Every error, routing ones (404, 405) included, is OpenAI's JSON shape.
"""
from __future__ import annotations

import logging
from typing import Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pdserve.router.openai_api import slo_headers
from pdserve.router.openai_api.errors import ApiError
from pdserve.router.openai_api.front import OpenAIFront
from pdserve.router.openai_api.requests import ApiRequest, parse_chat, parse_completion
from pdserve.router.openai_api.settings import DEFAULT_MAX_BODY_BYTES
from pdserve.router.openai_api.transport import (
    ClientGone,
    error_response,
    event_stream,
    json_response,
    read_json,
    whole,
)

log = logging.getLogger(__name__)


class TokenChecker(Protocol):
    """What checks an ``Authorization`` header (``pdserve.common.security.tokens.BearerTokens``)."""

    def check(self, authorization: str | None) -> bool: ...


class Api:
    """The request handlers over an :class:`OpenAIFront`."""

    def __init__(self, front: OpenAIFront, auth: TokenChecker | None, max_body_bytes: int) -> None:
        self.front = front
        self.auth = auth
        self.max_body_bytes = max_body_bytes

    def _authorize(self, request: Request) -> None:
        if self.auth is not None and not self.auth.check(request.headers.get("authorization")):
            raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer <token>')",
                           code="invalid_api_key")

    async def health(self, request: Request) -> Response:
        flow = self.front.flow
        if flow.draining:
            return json_response({"status": "draining"}, 503)
        return json_response({"status": "ok"})

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return json_response(self.front.models())

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion)

    async def _generate(self, request: Request, parse) -> Response:
        self._authorize(request)
        try:
            body = await read_json(request, self.max_body_bytes)
        except ClientGone:
            return Response(status_code=499)
        api: ApiRequest = parse(body)
        slo_headers.apply(api.inputs, request.headers)
        model = self.front.model_name(api.model)
        jobs = self.front.jobs(api)
        what = f"{request.url.path} {api.id}"
        if api.stream:
            return event_stream(self.front.stream(api, jobs, model), what)
        return whole(lambda: self.front.complete(api, jobs, model), what)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    if exc.status >= 500:
        log.warning("%s %s: %s", request.method, request.url.path, exc.message)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                   code=code))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(ApiError(500, f"internal error: {type(exc).__name__}", "server_error"))


def build_app(front: OpenAIFront, auth: TokenChecker | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """The ASGI application (run it with :class:`pdserve.router.openai_api.server.HttpServer`)."""
    api = Api(front, auth, max_body_bytes)
    routes = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={
        ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error})
