"""OpenAI-compatible API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

A thin adapter: each request becomes one ask of the gateway's service (its ``n`` choices,
each a stateless generation); the request is checked in gateway/apis/openai/asks.py, its
events spelled in chunks.py, its errors in errors.py. Chat and (legacy) completions differ
only in what their ``Endpoint`` says; both are answered here, by the Litestar routes and by
the hot routes ahead of Litestar (gateway/apis/openai/hot.py) alike.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import msgspec
from litestar import Response, Router, get, post
from litestar.response import Stream

from gateway.apis.openai.asks import chat_ask, completion_ask
from gateway.apis.openai.chunks import (
    ChatChunks,
    Chunks,
    ChunkStream,
    CompletionChunks,
    chat_completion_body,
    completion_body,
    failure_frames,
)
from gateway.apis.openai.errors import openai_error
from gateway.apis.openai.schema import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelCard,
    ModelList,
    SamplingFields,
)
from gateway.core.ask import GenerationAsk
from gateway.core.auth import api_key_check
from gateway.core.choices import Choices
from gateway.core.errors import HANDLED, AnyRequest, ending_with_error
from gateway.core.generation_stream import Collected
from gateway.core.service import GatewayService
from gateway.core.walk import walk
from gateway.tenants.caller import Caller, caller_of
from gateway.transport import sse

PREFIX, CHAT_COMPLETIONS, COMPLETIONS = "/v1", "/chat/completions", "/completions"
"""The routes' paths: the router's prefix and each route's own (gateway/apis/openai/hot.py
serves the same two ahead of Litestar)."""

Body = TypeVar("Body", ChatCompletionRequest, CompletionRequest)


@dataclass(frozen=True)
class Endpoint(Generic[Body]):
    """What one endpoint makes of its request: its ask, its answer's id, the chunks it
    streams and the answer it gives whole."""

    ask: Callable[[GatewayService, Body, Caller], GenerationAsk]
    id_prefix: str
    chunks: Callable[[str, int, bool], Chunks]
    """Its stream's chunks: (completion id, created, whether logprobs were asked)."""
    whole: Callable[[str, int, str, list[Collected], bool], msgspec.Struct]
    """Its whole answer: (completion id, created, model asked for, choices, logprobs)."""
    wants_logprobs: Callable[[Body], bool]


CHAT: Endpoint[ChatCompletionRequest] = Endpoint(
    chat_ask, "chatcmpl-", ChatChunks, chat_completion_body, lambda body: bool(body.logprobs)
)
COMPLETION: Endpoint[CompletionRequest] = Endpoint(
    completion_ask,
    "cmpl-",
    CompletionChunks,
    completion_body,
    lambda body: body.logprobs is not None,
)


def _include_usage(body: SamplingFields) -> tuple[bool, bool]:
    """``stream_options``: a last chunk with the usage; every chunk with the usage so far."""
    options = body.stream_options
    usage = options is not None and options.include_usage
    return usage, usage and options is not None and options.continuous_usage_stats


class Streamed(NamedTuple):
    """A streamed answer: its body, and its choices, to close when the response ends (the
    Litestar route's background task; the hot route closes them)."""

    chunks: AsyncIterator[bytes]
    choices: Choices


async def answer(
    endpoint: Endpoint[Body], service: GatewayService, body: Body, caller: Caller
) -> msgspec.Struct | Streamed:
    """The answer to ``body``, its generations queued for ``caller``: streamed (its chunks
    as they come), or whole once every choice has ended."""
    include_usage, continuous_usage = _include_usage(body)
    choices = await service.generate(endpoint.ask(service, body, caller))
    completion_id, created = endpoint.id_prefix + choices.generation_id, int(time.time())
    logprobs = endpoint.wants_logprobs(body)
    if not body.stream:
        wholes = await choices.collect()
        return endpoint.whole(completion_id, created, body.model, wholes, logprobs)
    stream = ChunkStream(
        endpoint.chunks(completion_id, created, logprobs),
        body.model,
        choices.n,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
    )
    chunks = ending_with_error(walk(choices.batches(), stream, choices.n), failure_frames)
    return Streamed(chunks, choices)


async def _answer(
    endpoint: Endpoint[Body], service: GatewayService, body: Body, request: AnyRequest
) -> Response[Any] | Stream:
    answered = await answer(endpoint, service, body, caller_of(request.scope))
    if isinstance(answered, Streamed):
        return sse.response(answered.chunks, background=answered.choices.on_response_end())
    return Response(answered)


@post(CHAT_COMPLETIONS, summary="OpenAI chat completions", status_code=200)
async def chat_completions(
    service: GatewayService, data: ChatCompletionRequest, request: AnyRequest
) -> Response[ChatCompletion] | Stream:
    return await _answer(CHAT, service, data, request)


@post(COMPLETIONS, summary="OpenAI (legacy) completions", status_code=200)
async def completions(
    service: GatewayService, data: CompletionRequest, request: AnyRequest
) -> Response[Completion] | Stream:
    return await _answer(COMPLETION, service, data, request)


@get("/models", summary="The models (and aliases) that have a live engine worker")
async def models(service: GatewayService) -> ModelList:
    cards: dict[str, ModelCard] = {}
    for worker in await service.live_workers():
        created = int(worker.started_at)
        for name in worker.names:  # as vLLM does: one card per served name
            if name not in cards or cards[name].created > created:
                cards[name] = ModelCard(
                    name, "model", created, "tokenspout", worker.model, worker.max_model_len
                )
    return ModelList("list", sorted(cards.values(), key=lambda card: card.id))


openai_router = Router(
    path=PREFIX,
    route_handlers=[chat_completions, completions, models],
    tags=["openai"],
    exception_handlers={kind: openai_error for kind in HANDLED},
    before_request=api_key_check,
)
