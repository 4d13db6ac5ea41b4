"""``inference.GRPCInferenceService`` (KServe v2, with Triton's streaming ``ModelStreamInfer``)
over ``GenerationStream``: the same sessions, relay, cancel and takeover as every transport.

- ``ServerLive``: the process runs; ``ServerReady``: Redis answers and a worker is alive.
- ``ModelReady`` / ``ModelMetadata``: from the workers' registry (``store.models``).
- ``ModelInfer``: one request, the whole text in one ``text_output``; errors are statuses.
- ``ModelStreamInfer``: any number of requests on one stream, each answered by one response
  per delivery of the relay (a token, or the tokens that arrived together;
  ``triton_final_response`` false) and a final one (true) with the last text, the finish
  reason and usage; a request's error is a response's ``error_message`` and the stream goes
  on. ``stream`` false: one whole response. Cancelling the RPC aborts every generation the
  stream still runs; a client that only closes its side gets every answer first.

The other RPCs of the service (model repository, shared memory, statistics, trace, logs)
answer ``UNIMPLEMENTED``: gRPC's own answer for a method no handler serves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from gateway import __version__
from gateway.auth import ApiKeys, bearer
from gateway.errors import BadRequest, GatewayError, Unavailable, as_gateway_error
from gateway.generation_stream import GenerationItem, GenerationStream, final_error
from gateway.grpc import metadata
from gateway.grpc.protocol import pb
from gateway.grpc.tensors import LlmRequest, read_request, text_response
from gateway.relay import RelayHub
from gateway.routes.health import check_readiness
from gateway.routes.oip import sampling_of
from gateway.sessions import SessionStore
from gateway.settings import Settings
from wire import Cancelled, Done, Error, Token

log = logging.getLogger("tokenspout.grpc")

SERVICE = "inference.GRPCInferenceService"
STREAM_BUFFER = 64
"""Responses waiting for a slow stream reader before its generations wait too (their feeds
then fall back to reading Redis, as a slow SSE reader's do)."""

Put = Callable[[pb.ModelStreamInferResponse], Awaitable[None]]


class InferenceService:
    def __init__(
        self, store: SessionStore, hub: RelayHub, settings: Settings, api_keys: ApiKeys
    ) -> None:
        self.store = store
        self.hub = hub
        self.settings = settings
        self.api_keys = api_keys

    async def server_live(self, _: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, _: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=(await check_readiness(self.store)).ready)

    async def server_metadata(
        self, _: pb.ServerMetadataRequest, context: Any
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="tokenspout", version=__version__)

    async def model_ready(
        self, request: pb.ModelReadyRequest, context: Any
    ) -> pb.ModelReadyResponse:
        """Ready: a live worker serves the name; not ready: it was registered but its last
        worker left; ``NOT_FOUND``: no worker ever registered it."""
        self.authorize(context)
        _named(request.name)
        try:
            await self.store.models.resolve(request.name)
        except Unavailable:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def model_metadata(
        self, request: pb.ModelMetadataRequest, context: Any
    ) -> pb.ModelMetadataResponse:
        self.authorize(context)
        model = await self.store.models.resolve(_named(request.name))
        workers = (await self.store.models.snapshot()).live.get(model, [])
        backend = workers[0].backend if workers else ""
        return metadata.model_metadata(request.name, backend)

    async def model_infer(
        self, request: pb.ModelInferRequest, context: Any
    ) -> pb.ModelInferResponse:
        self.authorize(context)
        llm = read_request(request)
        generation = await self._submit(llm)
        whole = await generation.collect()
        return text_response(
            llm,
            llm.model,
            whole.text,
            finish_reason=whole.final.finish_reason,
            prompt_tokens=whole.final.usage.prompt_tokens,
            completion_tokens=whole.final.usage.completion_tokens,
        )

    async def model_stream_infer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Answers of every request the client sends, as they come (callers authorize)."""
        responses: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue(STREAM_BUFFER)
        running: set[asyncio.Task[None]] = set()

        async def read_requests() -> None:
            try:
                async for request in requests:
                    task = asyncio.create_task(self._stream_one(request, responses.put))
                    running.add(task)
                    task.add_done_callback(running.discard)
                while running:  # the client closed its side: answer what it asked first
                    await asyncio.wait(set(running))
            finally:
                await responses.put(None)

        reader = asyncio.create_task(read_requests(), name="grpc stream requests")
        try:
            while (response := await responses.get()) is not None:
                yield response
            await reader
        finally:
            # The client cancelled the RPC (or went away): stop what it still runs.
            for task in (reader, *running):
                task.cancel()
            await asyncio.gather(reader, *running, return_exceptions=True)

    async def _stream_one(self, request: pb.ModelInferRequest, put: Put) -> None:
        """One request of a stream, answered on it; never raises (the stream goes on)."""
        try:
            llm = read_request(request)
            generation = await self._submit(llm)
        except Exception as exc:
            await put(_error(request.model_name, request.id, as_gateway_error(exc)))
            return
        try:
            if llm.parameters.stream is False:
                whole = await generation.collect()
                await put(_final(llm, whole.final, whole.text))
                return
            async for items in generation.batches():
                await _answer(llm, items, put)
        except Exception as exc:
            await put(_error(llm.model, llm.id, as_gateway_error(exc)))
        finally:
            await generation.close()

    async def _submit(self, llm: LlmRequest) -> GenerationStream:
        params = sampling_of(self.store, llm.parameters)
        return await GenerationStream.submit(
            self.store, self.hub, self.settings, params, model=llm.model, prompt=llm.prompt
        )

    def authorize(self, context: Any) -> None:
        given = dict(context.invocation_metadata() or ()).get("authorization")
        self.api_keys.require(bearer(given))


def _named(name: str) -> str:
    if not name:
        raise BadRequest("`name` is required", field="name")
    return name


async def _answer(llm: LlmRequest, items: list[GenerationItem], put: Put) -> None:
    """What arrived together in as few responses as it takes: one for the tokens' joined
    text, carried by the final response when the generation ends with them (as Triton's
    decoupled models send their last output), unless the client asked for an empty final
    response. Per token, a gRPC message costs far more than an SSE chunk; a reader that
    fell behind gets its tokens in fewer of them. Started and Heartbeat say nothing here
    (gRPC keeps its connection alive itself)."""
    text = "".join(item.text for item in items if isinstance(item, Token))
    end = items[-1]
    if isinstance(end, Done) and not llm.empty_final:
        await put(_final(llm, end, text))
        return
    if text:
        response = text_response(llm, llm.model, text, final=False)
        await put(pb.ModelStreamInferResponse(infer_response=response))
    if isinstance(end, Done):
        await put(_final(llm, end, None))
    elif isinstance(end, Cancelled | Error):
        await put(_error(llm.model, llm.id, final_error(end)))


def _final(llm: LlmRequest, done: Done, text: str | None) -> pb.ModelStreamInferResponse:
    response = text_response(
        llm,
        llm.model,
        text,
        final=True,
        finish_reason=done.finish_reason,
        prompt_tokens=done.usage.prompt_tokens,
        completion_tokens=done.usage.completion_tokens,
    )
    return pb.ModelStreamInferResponse(infer_response=response)


def _error(model: str, request_id: str, error: GatewayError) -> pb.ModelStreamInferResponse:
    """A request's error on the stream; its response names the request, and is its last."""
    response = pb.ModelInferResponse(model_name=model, id=request_id)
    response.parameters["triton_final_response"].bool_param = True
    return pb.ModelStreamInferResponse(error_message=error.message, infer_response=response)


def _unary(method: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    """A unary method whose errors end the RPC with their gRPC status."""

    async def call(request: Any, context: Any) -> Any:
        try:
            return await method(request, context)
        except Exception as exc:
            error = as_gateway_error(exc)
        await context.abort(getattr(grpc.StatusCode, error.grpc_code), error.message)
        raise AssertionError("context.abort raises")  # pragma: no cover

    return call


def handler(service: InferenceService) -> Any:
    """The service's methods for ``grpc.aio.server().add_generic_rpc_handlers``."""

    def unary(method: Callable[[Any, Any], Awaitable[Any]], request: Any, response: Any) -> Any:
        return grpc.unary_unary_rpc_method_handler(
            _unary(method),
            request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )

    async def stream(requests: Any, context: Any) -> AsyncIterator[Any]:
        """A stream without a valid API key ends with ``UNAUTHENTICATED``; every other error
        is a request's own, in its ``error_message``."""
        try:
            service.authorize(context)
        except GatewayError as error:
            await context.abort(getattr(grpc.StatusCode, error.grpc_code), error.message)
        async for response in service.model_stream_infer(requests, context):
            yield response

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "ServerLive": unary(service.server_live, pb.ServerLiveRequest, pb.ServerLiveResponse),
            "ServerReady": unary(
                service.server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse
            ),
            "ServerMetadata": unary(
                service.server_metadata, pb.ServerMetadataRequest, pb.ServerMetadataResponse
            ),
            "ModelReady": unary(service.model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
            "ModelMetadata": unary(
                service.model_metadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse
            ),
            "ModelInfer": unary(service.model_infer, pb.ModelInferRequest, pb.ModelInferResponse),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                stream,
                request_deserializer=pb.ModelInferRequest.FromString,
                response_serializer=pb.ModelStreamInferResponse.SerializeToString,
            ),
        },
    )
