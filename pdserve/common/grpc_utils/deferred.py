"""A servicer that exists before the object serving it: the server answers while a worker loads.

A worker's gRPC server starts (health NOT_SERVING) before its model is loaded, so that callers
get a clear answer instead of a refused connection. Until :meth:`Deferred.bind` every rpc of the
service fails with :class:`Unavailable` (``reason``); afterwards each call goes to the bound
servicer's method of the same name. The servicer is therefore built whole, after loading.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from pdserve.common.grpc_utils.errors import Unavailable


class Deferred:
    """Stands in for a servicer of ``service``; register it with the generated add-function."""

    def __init__(self, service: ServiceDescriptor, reason: str) -> None:
        self.reason = reason
        self._target: Any = None
        for method in service.methods:
            setattr(self, method.name, self._forward(method))

    def bind(self, servicer: Any) -> None:
        """From now on calls go to ``servicer``."""
        self._target = servicer

    def _method(self, name: str) -> Callable:
        if self._target is None:
            raise Unavailable(self.reason)
        return getattr(self._target, name)

    def _forward(self, method: MethodDescriptor) -> Callable:
        name = method.name
        if method.server_streaming:
            async def stream(request, context):
                async for response in self._method(name)(request, context):
                    yield response
            return stream

        async def unary(request, context):
            return await self._method(name)(request, context)
        return unary
