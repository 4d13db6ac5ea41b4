"""Open Inference Protocol (KServe v2 / Triton) generate extension:
``POST /v2/models/{model}/generate``, ``POST /v2/models/{model}/generate_stream`` and
``GET /v2/models/{model}/ready``.

A thin adapter over the gateway's service: ``text_input`` in, ``text_output`` out (the whole
text, or one SSE event per engine step). Errors are the protocol's ``{"error": "..."}``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from litestar import Response, Router, get, post
from litestar.response import Stream

from gateway.core.ask import GenerationAsk
from gateway.core.auth import api_key_check
from gateway.core.choices import Choices
from gateway.core.errors import (
    HANDLED,
    AnyRequest,
    BadRequest,
    Unavailable,
    ending_with_error,
    request_error,
)
from gateway.core.generation_stream import final_error
from gateway.core.service import GatewayService
from gateway.core.walk import walk
from gateway.tenants.caller import caller_of
from gateway.transport import sse
from wire import Cancelled, Done, Error, SamplingParams, Started, Token


class Parameters(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_tokens: int | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    stop: str | Annotated[list[str], msgspec.Meta(max_length=8)] | None = None
    seed: int | None = None
    stream: bool | None = None
    """Triton clients send it; the path decides whether the answer streams."""


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    text_input: str
    parameters: Parameters = msgspec.field(default_factory=Parameters)
    id: str | None = None


class GenerateResponse(msgspec.Struct, omit_defaults=True):
    model_name: str
    text_output: str
    finish_reason: str | None = None
    id: str | None = None


class Ready(msgspec.Struct):
    name: str
    ready: bool


class OipError(msgspec.Struct):
    error: str


def oip_error(request: AnyRequest, exc: Exception) -> Response[OipError]:
    error = request_error(request, exc)
    return Response(OipError(error.message), status_code=error.status, headers=error.headers())


def sampling_of(service: GatewayService, given: Parameters) -> SamplingParams:
    """The generate extension's parameters (REST body or gRPC tensors) as sampling
    parameters, with the gateway's defaults and limits."""
    return service.sampling(
        max_tokens=given.max_tokens,
        temperature=given.temperature,
        top_p=given.top_p,
        top_k=given.top_k,
        stop=[given.stop] if isinstance(given.stop, str) else given.stop,
        seed=given.seed,
    )


async def _start(
    service: GatewayService, model: str, data: GenerateRequest, request: AnyRequest
) -> Choices:
    if not data.text_input.strip():
        raise BadRequest("`text_input` must not be empty", field="text_input")
    sampling = sampling_of(service, data.parameters)
    caller = caller_of(request.scope)
    return await service.generate(
        GenerationAsk(caller=caller, sampling=sampling, model=model, prompt=data.text_input)
    )


@post("/{model:str}/generate", summary="OIP generate", status_code=200)
async def generate(
    service: GatewayService, model: str, data: GenerateRequest, request: AnyRequest
) -> GenerateResponse:
    (whole,) = await (await _start(service, model, data, request)).collect()
    return GenerateResponse(whole.model or model, whole.text, whole.final.finish_reason, data.id)


class OipStream(sse.SseSpelling):
    """The generate extension's stream: one event per delivery of tokens, then one with the
    finish reason; ``model``: the path's, until a ``started`` event names the model."""

    def __init__(self, model: str, request_id: str | None) -> None:
        self.model = model
        self.request_id = request_id

    def started(self, choice: int, event: Started, out: list[bytes]) -> None:
        self.model = event.model

    def token(self, choice: int, event: Token, out: list[bytes]) -> None:
        out.append(sse.json_frame(GenerateResponse(self.model, event.text, None, self.request_id)))

    def done(self, choice: int, event: Done, out: list[bytes]) -> None:
        finished = GenerateResponse(self.model, "", event.finish_reason, self.request_id)
        out.append(sse.json_frame(finished))

    def ended_early(self, choice: int, event: Cancelled | Error, out: list[bytes]) -> None:
        out.append(sse.json_frame(OipError(final_error(event).message)))


@post("/{model:str}/generate_stream", summary="OIP generate_stream", status_code=200)
async def generate_stream(
    service: GatewayService, model: str, data: GenerateRequest, request: AnyRequest
) -> Stream:
    choices = await _start(service, model, data, request)
    chunks = ending_with_error(
        walk(choices.batches(), OipStream(model, data.id)),
        lambda error: sse.json_frame(OipError(error.message)),
    )
    return sse.response(chunks, background=choices.on_response_end())


@get("/{model:str}/ready", summary="OIP model readiness: a live worker serves the model")
async def model_ready(service: GatewayService, model: str) -> Response[Ready]:
    """200 when a live worker serves ``model`` (a name or alias); 503 when its last worker
    left; 404 for a name no worker ever registered."""
    try:
        await service.resolve_model(model)
    except Unavailable:
        return Response(Ready(model, False), status_code=503)
    return Response(Ready(model, True), status_code=200)


oip_router = Router(
    path="/v2/models",
    route_handlers=[generate, generate_stream, model_ready],
    before_request=api_key_check,
    tags=["open-inference-protocol"],
    exception_handlers={kind: oip_error for kind in HANDLED},
)
