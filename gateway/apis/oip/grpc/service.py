"""``inference.GRPCInferenceService`` (KServe v2, with Triton's streaming ``ModelStreamInfer``)
over the gateway's service: the same sessions, relay, cancel and takeover as every transport.

- ``ServerLive``: the process runs; ``ServerReady``: Redis answers and a worker is alive.
- ``ModelReady`` / ``ModelMetadata``: from the workers' registry.
- ``ModelInfer``: one request, the whole text in one ``text_output``; errors are statuses.
- ``ModelStreamInfer``: any number of requests on one stream, each answered by one response
  per delivery of the relay (a token, or the tokens that arrived together;
  ``triton_final_response`` false) and a final one (true) with the last text, the finish
  reason and usage; a request's error is a response's ``error_message`` and the stream goes
  on. ``stream`` false: one whole response. Cancelling the RPC aborts every generation the
  stream still runs; a client that only closes its side gets every answer first.

The other RPCs of the service (model repository, shared memory, statistics, trace, logs)
answer ``UNIMPLEMENTED``: gRPC's own answer for a method no handler serves. The server
under it is the gateway's own (gateway/transport/http2.py); the messages are Triton's, the
token responses serialized by hand (``TokenResponses``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf.message import DecodeError

from gateway import __version__
from gateway.apis.oip.grpc.metadata import model_metadata
from gateway.apis.oip.grpc.protocol import pb
from gateway.apis.oip.grpc.tensors import LlmRequest, TokenResponses, read_request, text_response
from gateway.apis.oip.routes import sampling_of
from gateway.core.ask import GenerationAsk
from gateway.core.auth import ApiKeys, bearer
from gateway.core.choices import Choices
from gateway.core.errors import BadRequest, GatewayError, Unavailable, as_gateway_error
from gateway.core.generation_stream import final_error
from gateway.core.service import GatewayService
from gateway.core.walk import Spelling, walk
from gateway.tenants.caller import Caller
from gateway.transport.http2 import Call, GrpcError, Method, StatusCode
from wire import Cancelled, Done, Error, Token

SERVICE = "inference.GRPCInferenceService"

Send = Callable[[bytes], Awaitable[None]]
Metadata = dict[str, str]


class InferenceService:
    def __init__(self, service: GatewayService, api_keys: ApiKeys) -> None:
        self.service = service
        self.api_keys = api_keys

    def methods(self) -> dict[str, Method]:
        """The service's methods by path, for the server (gateway/transport/http2.py)."""
        unary: dict[str, tuple[Any, Callable[[Any, Metadata], Awaitable[Any]]]] = {
            "ServerLive": (pb.ServerLiveRequest, self.server_live),
            "ServerReady": (pb.ServerReadyRequest, self.server_ready),
            "ServerMetadata": (pb.ServerMetadataRequest, self.server_metadata),
            "ModelReady": (pb.ModelReadyRequest, self.model_ready),
            "ModelMetadata": (pb.ModelMetadataRequest, self.model_metadata),
            "ModelInfer": (pb.ModelInferRequest, self.model_infer),
        }
        methods = {
            f"/{SERVICE}/{name}": _unary(message, method)
            for name, (message, method) in unary.items()
        }
        methods[f"/{SERVICE}/ModelStreamInfer"] = self.model_stream_infer
        return methods

    async def server_live(self, _: pb.ServerLiveRequest, __: Metadata) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, _: pb.ServerReadyRequest, __: Metadata) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=(await self.service.readiness()).ready)

    async def server_metadata(
        self, _: pb.ServerMetadataRequest, __: Metadata
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="tokenspout", version=__version__)

    async def model_ready(
        self, request: pb.ModelReadyRequest, metadata: Metadata
    ) -> pb.ModelReadyResponse:
        """Ready: a live worker serves the name; not ready: it was registered but its last
        worker left; ``NOT_FOUND``: no worker ever registered it."""
        self.authorize(metadata)
        _named(request.name)
        try:
            await self.service.resolve_model(request.name)
        except Unavailable:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def model_metadata(
        self, request: pb.ModelMetadataRequest, metadata: Metadata
    ) -> pb.ModelMetadataResponse:
        self.authorize(metadata)
        model = await self.service.resolve_model(_named(request.name))
        workers = await self.service.workers_of(model)
        backend = workers[0].backend if workers else ""
        return model_metadata(request.name, backend)

    async def model_infer(
        self, request: pb.ModelInferRequest, metadata: Metadata
    ) -> pb.ModelInferResponse:
        caller = self.authorize(metadata)
        llm = read_request(request)
        (whole,) = await (await self._submit(llm, caller)).collect()
        return text_response(
            llm,
            llm.model,
            whole.text,
            finish_reason=whole.final.finish_reason,
            prompt_tokens=whole.final.usage.prompt_tokens,
            completion_tokens=whole.final.usage.completion_tokens,
        )

    async def model_stream_infer(self, call: Call) -> None:
        """Answers of every request the client sends on ``call``, as they come. A stream
        without a valid API key ends ``UNAUTHENTICATED`` before any; every other error is
        a request's own, in its ``error_message``."""
        try:
            caller = self.authorize(call.metadata)
        except GatewayError as error:
            raise _status(error) from None
        running: set[asyncio.Task[None]] = set()
        try:
            while (message := await call.receive()) is not None:
                task = asyncio.create_task(self._stream_one(message, call.send, caller))
                running.add(task)
                task.add_done_callback(running.discard)
            while running:  # the client closed its side: answer what it asked first
                await asyncio.wait(set(running))
        finally:
            # The client cancelled the call (or went away): stop what it still runs.
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _stream_one(self, message: bytes, send: Send, caller: Caller) -> None:
        """One request of a stream, answered on it; never raises (the stream goes on)."""
        try:
            request = _decoded(pb.ModelInferRequest, message)
        except GatewayError as error:
            await send(_error("", "", error))
            return
        try:
            llm = read_request(request)
            choices = await self._submit(llm, caller)
        except Exception as exc:
            await send(_error(request.model_name, request.id, as_gateway_error(exc)))
            return
        try:
            if llm.parameters.stream is False:
                (whole,) = await choices.collect()
                await send(_final(llm, whole.final, whole.text))
                return
            async for responses in walk(choices.batches(), StreamResponses(llm)):
                for response in responses:
                    await send(response)
        except Exception as exc:
            await send(_error(llm.model, llm.id, as_gateway_error(exc)))
        finally:
            await choices.close()

    async def _submit(self, llm: LlmRequest, caller: Caller) -> Choices:
        sampling = sampling_of(self.service, llm.parameters)
        ask = GenerationAsk(caller=caller, sampling=sampling, model=llm.model, prompt=llm.prompt)
        return await self.service.generate(ask)

    def authorize(self, metadata: Metadata) -> Caller:
        """401 without a valid key; the call (and every request sent on it) serves the
        key's tenant: its caller."""
        caller = Caller()
        self.api_keys.require(caller, bearer(metadata.get("authorization")))
        return caller


def _named(name: str) -> str:
    if not name:
        raise BadRequest("`name` is required", field="name")
    return name


class StreamResponses(Spelling[bytes, list[bytes]]):
    """A request's responses on a ``ModelStreamInfer`` stream: what arrived together in as
    few as it takes: one for the tokens' joined text, carried by the final response when
    the generation ends with them (as Triton's decoupled models send their last output),
    unless the client asked for an empty final response. A reader that fell behind gets
    its tokens in fewer responses. Started and heartbeats say nothing here (HTTP/2 keeps
    its connection alive itself)."""

    def __init__(self, llm: LlmRequest) -> None:
        self.llm = llm
        self.tokens = TokenResponses(llm, llm.model)
        self.text: list[str] = []
        """The text of this delivery's tokens, not answered yet."""

    def token(self, choice: int, event: Token, out: list[bytes]) -> None:
        self.text.append(event.text)

    def done(self, choice: int, event: Done, out: list[bytes]) -> None:
        if not self.llm.empty_final:
            out.append(_final(self.llm, event, self._take_text()))
            return
        self.delivered(out)
        out.append(_final(self.llm, event, None))

    def ended_early(self, choice: int, event: Cancelled | Error, out: list[bytes]) -> None:
        self.delivered(out)
        out.append(_error(self.llm.model, self.llm.id, final_error(event)))

    def delivered(self, out: list[bytes]) -> None:
        text = self._take_text()
        if text:
            out.append(self.tokens.token(text))

    def write(self, out: list[bytes], last: bool) -> list[bytes]:
        return out

    def _take_text(self) -> str:
        text = "".join(self.text)
        self.text.clear()
        return text


def _final(llm: LlmRequest, done: Done, text: str | None) -> bytes:
    response = text_response(
        llm,
        llm.model,
        text,
        final=True,
        finish_reason=done.finish_reason,
        prompt_tokens=done.usage.prompt_tokens,
        completion_tokens=done.usage.completion_tokens,
    )
    return bytes(pb.ModelStreamInferResponse(infer_response=response).SerializeToString())


def _error(model: str, request_id: str, error: GatewayError) -> bytes:
    """A request's error on the stream; its response names the request, and is its last."""
    response = pb.ModelInferResponse(model_name=model, id=request_id)
    response.parameters["triton_final_response"].bool_param = True
    message = pb.ModelStreamInferResponse(error_message=error.message, infer_response=response)
    return bytes(message.SerializeToString())


def _status(error: GatewayError) -> GrpcError:
    return GrpcError(StatusCode[error.grpc_code], error.message)


def _decoded(message_type: Any, message: bytes) -> Any:
    try:
        return message_type.FromString(message)
    except DecodeError:
        name = message_type.DESCRIPTOR.name
        raise BadRequest(f"the request is not a {name} message") from None


def _unary(message_type: Any, method: Callable[[Any, Metadata], Awaitable[Any]]) -> Method:
    """A method of one request and one response; its errors end the call with their status."""

    async def call_method(call: Call) -> None:
        message = await call.receive()
        if message is None:
            raise GrpcError(StatusCode.INVALID_ARGUMENT, "the call sent no request message")
        try:
            response = await method(_decoded(message_type, message), call.metadata)
        except Exception as exc:
            raise _status(as_gateway_error(exc)) from None
        await call.send(response.SerializeToString())

    return call_method
