"""``inference.GRPCInferenceService`` (KServe Open Inference Protocol v2) on the router.

Each inference request is converted (pdserve.router.kserve.convert) into a pdserve.v1
GenerateRequest and takes Generate's own path. Errors are domain exceptions mapped by the error
interceptor; on ModelStreamInfer a request's error is sent as ``error_message``
(``"<STATUS>: <details>"``) and the stream goes on. A request refused by admission control is
RESOURCE_EXHAUSTED with ``retry-after`` trailing metadata (seconds) on ModelInfer, as on Generate;
on ModelStreamInfer its error response carries the parameter ``retry_after`` (seconds) instead.
Readiness is the server's health status.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from grpc_health.v1 import health_pb2

from pdserve.common.grpc_utils import NotFound, Service, status_for
from pdserve.kserve import grpc_predict_v2_pb2 as pb
from pdserve.kserve import grpc_predict_v2_pb2_grpc as pb_grpc
from pdserve.router.kserve.convert import (
    KNOBS,
    STREAM,
    TEXT_INPUT,
    TEXT_OUTPUT,
    InferCall,
    to_generate,
    to_infer_response,
)
from pdserve.router.servicer import VERSION, GenerationServicer

log = logging.getLogger(__name__)
MODEL_VERSION = "1"
PLATFORM = "pdserve"
EXTENSIONS = ("parameters", "model_stream_infer")
_DONE = object()    # a stream task finished
RETRY_AFTER = "retry_after"     # parameter of a ModelStreamInfer error refused by admission control (s)


class KServeServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, generation: GenerationServicer) -> None:
        self.generation = generation
        self.model = generation.spec.name
        self.health: Any = None     # the server's grpc.health.v1 servicer (bind_health)

    def bind_health(self, health_servicer: Any) -> None:
        """Answer readiness from ``health_servicer`` (the server's grpc.health.v1)."""
        self.health = health_servicer

    async def _serving(self, context: Any) -> bool:
        if self.health is None:
            return False
        reply = await self.health.Check(health_pb2.HealthCheckRequest(service=""), context)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def _check_model(self, name: str, version: str) -> None:
        if name != self.model:
            raise NotFound(f"unknown model {name!r} (this server serves {self.model!r})")
        if version not in ("", MODEL_VERSION):
            raise NotFound(f"unknown version {version!r} of model {name!r} (only {MODEL_VERSION!r})")

    # ---- health and metadata --------------------------------------------------------
    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self._serving(context))

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        self._check_model(request.name, request.version)
        return pb.ModelReadyResponse(ready=await self._serving(context))

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Any) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="pdserve", version=VERSION, extensions=list(EXTENSIONS))

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        self._check_model(request.name, request.version)
        meta = pb.ModelMetadataResponse(name=self.model, versions=[MODEL_VERSION], platform=PLATFORM)
        meta.inputs.add(name=TEXT_INPUT, datatype="BYTES", shape=[1])
        meta.inputs.add(name=STREAM, datatype="BOOL", shape=[1])
        for name, (_, kind) in KNOBS.items():
            datatype = {"int": "INT64", "float": "FP32", "bool": "BOOL", "strings": "BYTES"}[kind]
            meta.inputs.add(name=name, datatype=datatype, shape=[-1] if kind == "strings" else [1])
        meta.outputs.add(name=TEXT_OUTPUT, datatype="BYTES", shape=[-1])
        return meta

    # ---- inference ------------------------------------------------------------------
    def _call(self, request: pb.ModelInferRequest, default_stream: bool) -> InferCall:
        self._check_model(request.model_name, request.model_version)
        return to_generate(request, default_stream)

    async def _generate(self, call: InferCall, request_id: str, time_remaining: float | None,
                        method: str, stream: bool) -> AsyncIterator[pb.ModelInferResponse]:
        """Responses of one request: one per engine step when ``stream``, else one at the end."""
        job = self.generation.job(call.request, time_remaining)
        version = call.model_version or MODEL_VERSION
        texts: list[str] = []
        async for r in self.generation.flow.generate(job, method):
            last = r if r.finish_reason is not None else None
            if stream:
                yield to_infer_response(self.model, version, request_id, r.text, last, call.raw_output)
            else:
                texts.append(r.text)
                if last is not None:
                    yield to_infer_response(self.model, version, request_id, "".join(texts), last,
                                            call.raw_output)

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        call = self._call(request, default_stream=False)
        responses = [r async for r in self._generate(call, request.id, context.time_remaining(),
                                                     "ModelInfer", False)]
        return responses[-1]

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[pb.ModelInferRequest],
                               context: Any) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request of the stream runs concurrently; responses are interleaved (by ``id``).
        When the stream ends early (cancel, deadline, disconnect), every request is cancelled."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()
        reader = asyncio.ensure_future(self._read(request_iterator, queue))
        reading = True
        try:
            while reading or tasks:
                item = await queue.get()
                if item is _DONE:
                    continue
                if item is None:            # the client closed its side
                    reading = False
                elif isinstance(item, BaseException):
                    raise item
                elif isinstance(item, pb.ModelInferRequest):
                    task = asyncio.ensure_future(self._stream_one(item, context, queue))
                    tasks.add(task)
                    task.add_done_callback(_finished(tasks, queue))
                else:
                    yield item
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    @staticmethod
    async def _read(request_iterator: AsyncIterator[pb.ModelInferRequest], queue: asyncio.Queue) -> None:
        try:
            async for request in request_iterator:
                queue.put_nowait(request)
            queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - re-raised by the stream's handler
            queue.put_nowait(e)

    async def _stream_one(self, request: pb.ModelInferRequest, context: Any, queue: asyncio.Queue) -> None:
        try:
            call = self._call(request, default_stream=True)
            async for response in self._generate(call, request.id, context.time_remaining(),
                                                  "ModelStreamInfer", call.stream):
                queue.put_nowait(pb.ModelStreamInferResponse(infer_response=response))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - sent as this request's error_message
            mapped = status_for(e)
            if mapped is None:
                log.error("ModelStreamInfer request %r failed", request.id, exc_info=e)
                message = f"INTERNAL: internal error: {type(e).__name__}: {e}"
            else:
                log.debug("ModelStreamInfer request %r -> %s: %s", request.id, mapped[0].name, mapped[1])
                message = f"{mapped[0].name}: {mapped[1]}"
            error = pb.ModelStreamInferResponse(error_message=message)
            error.infer_response.model_name = self.model
            error.infer_response.id = request.id
            retry_after = getattr(e, "retry_after_s", 0)    # refused by admission control
            if retry_after:
                error.infer_response.parameters[RETRY_AFTER].int64_param = retry_after
            queue.put_nowait(error)


def _finished(tasks: set[asyncio.Task], queue: asyncio.Queue) -> Any:
    """A done-callback: forget the task and wake the stream's handler."""
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        queue.put_nowait(_DONE)
    return done


def service(kserve: KServeServicer) -> Service:
    """The KServe v2 service (GRPCInferenceService), for build_server."""
    return Service(pb.DESCRIPTOR.services_by_name["GRPCInferenceService"],
                   pb_grpc.add_GRPCInferenceServiceServicer_to_server, kserve)
