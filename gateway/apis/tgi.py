"""Text Generation Inference (TGI) compatible API: ``/generate``, ``/generate_stream``, and
TGI's root routes: ``POST /`` (either, by the body's ``stream``) and ``GET /info``, which
TGI's documentation points clients at (``InferenceClient("http://host:port")``). TGI has
one model; requests here go to the default model (``TOKENSPOUT_DEFAULT_MODEL``).

A thin adapter over the gateway's service. TGI's last stream event is a token event that
also carries ``generated_text`` and ``details``, so each token is written when the next
event shows whether it was the last (``TgiStream``). Logprobs are always asked of the
engine: TGI's token has one. Errors are TGI's ``{"error": ..., "error_type": ...}``
(``huggingface_hub`` raises ``ValidationError``, ``OverloadedError``, ``GenerationError``
from them).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Response, Router, get, post
from litestar.response import Stream

from gateway import __version__
from gateway.core.ask import GenerationAsk
from gateway.core.auth import api_key_check
from gateway.core.choices import Choices
from gateway.core.errors import (
    HANDLED,
    AnyRequest,
    BadEngineOutput,
    BadRequest,
    ending_with_error,
    request_error,
)
from gateway.core.generation_stream import Collected, TokenPiece, final_error, per_token
from gateway.core.service import GatewayService
from gateway.core.walk import walk
from gateway.tenants.caller import caller_of
from gateway.transport import sse
from wire import Cancelled, Done, Error, SamplingParams, Started, Token

STOP_SEQUENCES = 8


class Parameters(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(gt=0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(gt=0)] | None = None
    stop: Annotated[list[str], msgspec.Meta(max_length=STOP_SEQUENCES)] | None = None
    seed: int | None = None
    details: bool = False
    return_full_text: bool | None = False
    do_sample: bool = False
    frequency_penalty: Annotated[float, msgspec.Meta(ge=-2, le=2)] | None = None
    repetition_penalty: float | None = None
    decoder_input_details: bool = False
    best_of: int | None = None
    watermark: bool = False
    grammar: Any | None = None
    top_n_tokens: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    truncate: int | None = None
    typical_p: float | None = None
    adapter_id: str | None = None


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    inputs: str
    parameters: Parameters = msgspec.field(default_factory=Parameters)
    stream: bool = False


class TokenOut(msgspec.Struct):
    id: int
    text: str
    logprob: float
    special: bool


class StreamDetails(msgspec.Struct):
    finish_reason: str
    generated_tokens: int
    input_length: int
    seed: int | None


class StreamEvent(msgspec.Struct):
    index: int
    token: TokenOut
    generated_text: str | None
    details: StreamDetails | None
    top_tokens: list[TokenOut] | None = None
    """With ``top_n_tokens``: the most likely tokens at this position."""


class Details(msgspec.Struct, omit_defaults=True):
    finish_reason: str
    generated_tokens: int
    seed: int | None
    prefill: list[TokenOut]
    tokens: list[TokenOut]
    top_tokens: list[list[TokenOut]] = []
    """With ``top_n_tokens``: per token, the most likely tokens at its position."""


class Generated(msgspec.Struct, omit_defaults=True):
    generated_text: str
    details: Details | None = None


class Info(msgspec.Struct):
    """TGI's ``GET /info`` fields (router v3), as far as they mean something here."""

    model_id: str
    model_sha: str | None
    model_pipeline_tag: str | None
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    validation_workers: int
    max_client_batch_size: int
    router: str
    version: str
    sha: str | None
    docker_label: str | None


class TgiError(msgspec.Struct):
    error: str
    error_type: str


UNSUPPORTED: dict[str, object] = {
    "decoder_input_details": False,
    "best_of": 1,
    "watermark": False,
    "grammar": None,
    "truncate": None,
    "typical_p": None,
    "adapter_id": None,
}
"""Parameters accepted only at their neutral value (or left out); others answer 422."""

ERROR_TYPES = {422: "validation", 413: "validation", 429: "overloaded"}


def tgi_error(request: AnyRequest, exc: Exception) -> Response[TgiError]:
    error = request_error(request, exc)
    kind = ERROR_TYPES.get(error.status, "generation" if error.status >= 500 else error.code)
    return Response(
        TgiError(error.message, kind), status_code=error.status, headers=error.headers()
    )


def _sampling(service: GatewayService, given: Parameters) -> SamplingParams:
    for name, neutral in UNSUPPORTED.items():
        value = getattr(given, name)
        if value is not None and value != neutral:
            raise BadRequest(f"`{name}` is not supported", code="unsupported_parameter", field=name)
    sampling = given.do_sample or any(
        value is not None for value in (given.temperature, given.top_p, given.top_k)
    )
    # TGI decodes greedily unless asked to sample (do_sample, or a sampling parameter).
    temperature = (given.temperature or 1.0) if sampling else 0.0
    return service.sampling(
        named={"max_tokens": "max_new_tokens", "top_logprobs": "top_n_tokens"},
        max_tokens=given.max_new_tokens,
        temperature=temperature,
        top_p=given.top_p,
        top_k=given.top_k,
        stop=given.stop,
        seed=given.seed,
        frequency_penalty=given.frequency_penalty,
        repetition_penalty=given.repetition_penalty,
        logprobs=True,
        top_logprobs=given.top_n_tokens,
    )


def _finish_reason(engine_reason: str, stop: list[str] | None) -> str:
    """TGI names three endings; the engine says ``stop`` for both EOS and a stop string."""
    if engine_reason == "length":
        return "length"
    return "stop_sequence" if stop else "eos_token"


def _token(piece: TokenPiece) -> TokenOut:
    if piece.logprob is None:
        raise BadEngineOutput("logprobs were requested from the engine but it sent none")
    return TokenOut(piece.id, piece.text, piece.logprob, special=False)


def _top_tokens(piece: TokenPiece) -> list[TokenOut] | None:
    if piece.top is None:
        return None
    return [TokenOut(top.id, top.token, top.logprob, special=False) for top in piece.top]


async def _start(service: GatewayService, data: GenerateRequest, request: AnyRequest) -> Choices:
    if not data.inputs.strip():
        raise BadRequest("`inputs` must not be empty", field="inputs")
    sampling = _sampling(service, data.parameters)
    caller = caller_of(request.scope)
    return await service.generate(
        GenerationAsk(caller=caller, sampling=sampling, prompt=data.inputs)
    )


def generated(whole: Collected, data: GenerateRequest) -> Generated:
    """The answer of a ``/generate`` that does not stream."""
    prefix = data.inputs if data.parameters.return_full_text else ""
    if not data.parameters.details:
        return Generated(prefix + whole.text)
    tokens = [_token(piece) for piece in whole.pieces]
    tops = (
        [_top_tokens(piece) or [] for piece in whole.pieces] if data.parameters.top_n_tokens else []
    )
    details = Details(
        _finish_reason(whole.final.finish_reason, data.parameters.stop),
        whole.final.usage.completion_tokens,
        data.parameters.seed,
        [],
        tokens,
        tops,
    )
    return Generated(prefix + whole.text, details)


class TgiStream(sse.SseSpelling):
    """TGI's stream events: each token is held until the next event says whether it was
    the last, which carries the whole text and the details."""

    def __init__(self, data: GenerateRequest) -> None:
        self.data = data
        self.held: TokenPiece | None = None
        self.index = 0
        self.text = [data.inputs] if data.parameters.return_full_text else []
        self.input_length = 0

    def started(self, choice: int, event: Started, out: list[bytes]) -> None:
        self.input_length = event.prompt_tokens

    def token(self, choice: int, event: Token, out: list[bytes]) -> None:
        self.text.append(event.text)
        for piece in per_token(event):
            if self.held is not None:
                self.index += 1
                out.append(_frame(self._event(self.held, self.index)))
            self.held = piece

    def done(self, choice: int, event: Done, out: list[bytes]) -> None:
        if self.held is None:
            out.append(_frame(TgiError("the engine produced no tokens", "incomplete_generation")))
            return
        parameters = self.data.parameters
        details = StreamDetails(
            _finish_reason(event.finish_reason, parameters.stop),
            event.usage.completion_tokens,
            self.input_length,
            parameters.seed,
        )
        last = self._event(self.held, self.index + 1)
        last.generated_text, last.details = "".join(self.text), details
        out.append(_frame(last))

    def ended_early(self, choice: int, event: Cancelled | Error, out: list[bytes]) -> None:
        if self.held is not None:  # what the engine made before it failed still counts
            out.append(_frame(self._event(self.held, self.index + 1)))
        out.append(_frame(TgiError(final_error(event).message, "generation")))

    @staticmethod
    def _event(piece: TokenPiece, index: int) -> StreamEvent:
        return StreamEvent(index, _token(piece), None, None, _top_tokens(piece))


def _frame(event: msgspec.Struct) -> bytes:
    return sse.json_frame(event)


def _stream_response(choices: Choices, data: GenerateRequest) -> Stream:
    # Inside a stream every failure is a `generation` error, as the engine's own are.
    chunks = ending_with_error(
        walk(choices.batches(), TgiStream(data)),
        lambda error: _frame(TgiError(error.message, "generation")),
    )
    return sse.response(chunks, background=choices.on_response_end())


async def _generate_or_stream(
    service: GatewayService, data: GenerateRequest, request: AnyRequest
) -> Response[Generated] | Stream:
    choices = await _start(service, data, request)
    if data.stream:
        return _stream_response(choices, data)
    (whole,) = await choices.collect()
    return Response(generated(whole, data), status_code=200)


@post(
    "/",
    summary="TGI's root: generate, or generate_stream with `stream: true`",
    status_code=200,
    before_request=api_key_check,
    tags=["tgi"],
    exception_handlers={kind: tgi_error for kind in HANDLED},
)
async def compat_generate(
    service: GatewayService, data: GenerateRequest, request: AnyRequest
) -> Response[Generated] | Stream:
    """Where ``InferenceClient("http://host:port")`` posts, as TGI's own ``POST /`` (the
    web chat is ``GET /``). Not in ``tgi_router``: two routers on one path would each bring
    an OPTIONS handler, which Litestar refuses; gateway/server/app.py registers it after the web
    chat's router."""
    return await _generate_or_stream(service, data, request)


@post(
    "/generate", summary="TGI generate (streams when the body says `stream: true`)", status_code=200
)
async def generate(
    service: GatewayService, data: GenerateRequest, request: AnyRequest
) -> Response[Generated] | Stream:
    """``stream: true`` makes it ``generate_stream``, as TGI's ``POST /`` does."""
    return await _generate_or_stream(service, data, request)


@post("/generate_stream", summary="TGI generate_stream (text/event-stream)", status_code=200)
async def generate_stream(
    service: GatewayService, data: GenerateRequest, request: AnyRequest
) -> Stream:
    return _stream_response(await _start(service, data, request), data)


@get("/info", summary="TGI info: the default model and this gateway's limits")
async def info(service: GatewayService) -> Info:
    settings = service.settings
    model = await service.resolve_model(None)
    workers = await service.workers_of(model)
    contexts = [w.max_model_len for w in workers if w.max_model_len is not None]
    if contexts:
        max_total = min(contexts)
        max_input = max_total - 1
    else:  # no fixed context (synthetic): what the gateway itself lets in
        max_input = settings.max_message_chars
        max_total = max_input + settings.max_tokens_limit
    return Info(
        model_id=model,
        model_sha=None,
        model_pipeline_tag="text-generation",
        max_concurrent_requests=settings.max_inflight_per_model or settings.max_inflight,
        max_best_of=1,
        max_stop_sequences=STOP_SEQUENCES,
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        validation_workers=1,
        max_client_batch_size=1,
        router="tokenspout",
        version=__version__,
        sha=None,
        docker_label=None,
    )


tgi_router = Router(
    path="/",
    route_handlers=[generate, generate_stream, info],
    before_request=api_key_check,
    tags=["tgi"],
    exception_handlers={kind: tgi_error for kind in HANDLED},
)
