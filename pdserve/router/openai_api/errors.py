"""OpenAI's error shape and the HTTP status of every failure the request path can raise.

The body is ``{"error": {"message", "type", "param", "code"}}``, as OpenAI sends it, so the
official SDKs raise their own classes (400 BadRequestError, 401 AuthenticationError, 404
NotFoundError, 413, 429 RateLimitError, 5xx InternalServerError). The request path names
fields as the gRPC API does (``params.top_p``, ``chat.messages[0].role``, ``token_ids.ids[3]``);
:func:`openai_param` renames them to the fields of the JSON body the client sent.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import grpc
import grpc.aio

from pdserve.common.grpc_utils import InvalidArgument, PdserveError

# gRPC status -> (HTTP status, OpenAI error type)
_BY_CODE: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "invalid_request_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
_INDEX = re.compile(r"^(chat\.messages|token_ids\.ids)(\[\d+\])?(.*)$")


@dataclass(eq=False)
class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int = 0      # Retry-After of a 429 / 503 (0: 1 s)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()

    def headers(self) -> dict[str, str]:
        """Retry-After on overload answers (the SDKs honour it when they retry): the refusal's
        own estimate (pdserve.router.admission), else 1 s."""
        return {"retry-after": str(self.retry_after_s or 1)} if self.status in (429, 503) else {}


def bad_request(param: str, message: str) -> ApiError:
    """400 naming ``param`` (the message starts with it, as the gRPC API's do)."""
    return ApiError(400, f"{param}: {message}", param=param)


def openai_param(field: str, prompt_field: str = "prompt", max_tokens_field: str = "max_tokens") -> str:
    """The JSON body's name of a field the request path named (see the module docstring)."""
    if field.startswith("params."):
        field = field[len("params."):]
        return max_tokens_field if field == "max_tokens" else field
    if field in ("text", "input", "token_ids", "token_ids.ids"):
        return prompt_field
    if field == "chat":
        return "messages"
    m = _INDEX.match(field)
    if m:
        base = "messages" if m.group(1) == "chat.messages" else prompt_field
        return base + (m.group(2) or "") + m.group(3)
    return field


def from_exception(exc: BaseException, prompt_field: str = "prompt", max_tokens_field: str = "max_tokens") -> ApiError:
    """The answer to a failure of the request path (validation, placement, a worker)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidArgument) and exc.field:
        param = openai_param(exc.field, prompt_field, max_tokens_field)
        detail = exc.message[len(exc.field) + 2:] if exc.message.startswith(exc.field + ": ") else exc.message
        return bad_request(param, detail)
    if isinstance(exc, PdserveError):
        status, kind = _BY_CODE.get(exc.code, (500, "server_error"))
        return ApiError(status, exc.message or type(exc).__name__, kind, code=exc.code.name.lower(),
                        retry_after_s=getattr(exc, "retry_after_s", 0))
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc) or "invalid request")
    if isinstance(exc, grpc.aio.AioRpcError):
        status, kind = _BY_CODE.get(exc.code(), (500, "server_error"))
        return ApiError(status, exc.details() or exc.code().name, kind, code=exc.code().name.lower())
    return ApiError(500, f"internal error: {type(exc).__name__}", "server_error")
