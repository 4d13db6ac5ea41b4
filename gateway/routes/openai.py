"""OpenAI-compatible API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

A thin adapter: each request becomes one stateless generation (``GenerationStream``); this
module only translates parameters in and events out, and spells errors the way the
``openai`` SDK expects (``{"error": {"message", "type", "param", "code"}}``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

import msgspec
from litestar import Response, Router, get, post
from litestar.response import Stream

from gateway import sse
from gateway.auth import ApiKeys, require_api_key
from gateway.errors import (
    HANDLED,
    AnyRequest,
    BadEngineOutput,
    BadRequest,
    GatewayError,
    as_gateway_error,
    ending_with_error,
)
from gateway.generation_stream import (
    Collected,
    GenerationItem,
    GenerationStream,
    Heartbeat,
    TokenPiece,
    final_error,
    per_token,
)
from gateway.relay import RelayHub
from gateway.routes.openai_schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ErrorDetail,
    ErrorOut,
    ModelCard,
    ModelList,
    TokenLogprob,
    UsageOut,
    _Sampling,
)
from gateway.sessions import SessionStore
from gateway.settings import Settings
from wire import (
    Cancelled,
    ChatMessage,
    Done,
    Error,
    Role,
    SamplingParams,
    Started,
    Token,
    Usage,
)

DONE_FRAME = sse.frame(b"[DONE]")
ROLES: dict[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}
ERROR_TYPES = {401: "invalid_request_error", 429: "rate_limit_error"}
VLLM_FIELDS = (
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)
"""vLLM's extra sampling fields that reach the engine as they are (wire.SamplingParams)."""


def _refuse(field: str, message: str) -> BadRequest:
    return BadRequest(message, code="unsupported_parameter", field=field)


def _sampling(body: _Sampling, max_tokens: int | None) -> dict[str, Any]:
    """The parameters every OpenAI endpoint shares, checked; refuses what is not supported."""
    if body.n not in (None, 1):
        raise _refuse("n", "n must be 1: tokenspout generates one choice per request")
    if body.logit_bias:
        raise _refuse("logit_bias", "logit_bias is not supported")
    if body.use_beam_search:
        raise _refuse("use_beam_search", "beam search is not supported")
    if body.length_penalty not in (None, 1.0):
        # vLLM applies it in beam search only.
        raise _refuse("length_penalty", "length_penalty must be 1: it applies to beam search")
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    return {
        "max_tokens": max_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": stop,
        "seed": body.seed,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        **{name: getattr(body, name) for name in VLLM_FIELDS},
    }


def _chat_messages(body: ChatCompletionRequest, max_messages: int) -> list[ChatMessage]:
    if not body.messages:
        raise BadRequest("messages must not be empty", field="messages")
    if len(body.messages) > max_messages:
        # The same bound as a session's history (TOKENSPOUT_MAX_HISTORY_MESSAGES).
        raise BadRequest(
            f"messages may hold at most {max_messages} entries",
            code="too_many_messages",
            field="messages",
        )
    messages = []
    for index, message in enumerate(body.messages):
        role = ROLES.get(message.role)
        if role is None:
            raise _refuse(f"messages[{index}].role", f"role {message.role!r} is not supported")
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise _refuse(f"messages[{index}].content", "only text content is supported")
            content = "".join(part.text or "" for part in content)
        messages.append(ChatMessage(role, content or ""))
    return messages


def _chat_params(store: SessionStore, body: ChatCompletionRequest) -> SamplingParams:
    if body.top_logprobs:
        raise _refuse("top_logprobs", "top_logprobs must be 0: only sampled tokens' logprobs")
    if body.tools:
        raise _refuse("tools", "tools are not supported")
    if body.tool_choice not in (None, "none"):
        raise _refuse("tool_choice", "tool_choice is not supported")
    if body.response_format and body.response_format.get("type") != "text":
        raise _refuse("response_format", "only response_format {'type': 'text'} is supported")
    max_tokens = body.max_completion_tokens or body.max_tokens
    shared = _sampling(body, max_tokens)
    return store.queue.sampling(**shared, logprobs=bool(body.logprobs))


def _completion_params(store: SessionStore, body: CompletionRequest) -> SamplingParams:
    if body.echo:
        raise _refuse("echo", "echo is not supported")
    if body.best_of not in (None, 1):
        raise _refuse("best_of", "best_of must be 1")
    if body.suffix:
        raise _refuse("suffix", "suffix is not supported")
    if body.logprobs:
        raise _refuse("logprobs", "logprobs must be 0 or null: only sampled tokens' logprobs")
    shared = _sampling(body, body.max_tokens)
    return store.queue.sampling(**shared, logprobs=body.logprobs == 0)


def _completion_prompt(body: CompletionRequest) -> str:
    if isinstance(body.prompt, str):
        return body.prompt
    if len(body.prompt) != 1:
        raise _refuse("prompt", "prompt must be one string (batches are not supported)")
    return body.prompt[0]


def _usage(usage: Usage) -> UsageOut:
    return UsageOut(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)


def _logprob(piece: TokenPiece) -> float:
    if piece.logprob is None:
        raise BadEngineOutput("logprobs were requested from the engine but it sent none")
    return piece.logprob


def _chat_logprobs(pieces: list[TokenPiece]) -> ChatLogprobs:
    return ChatLogprobs(
        [TokenLogprob(p.text, _logprob(p), list(p.text.encode()), []) for p in pieces]
    )


def _completion_logprobs(pieces: list[TokenPiece], offset: int) -> CompletionLogprobs:
    offsets = []
    for piece in pieces:
        offsets.append(offset)
        offset += len(piece.text)
    return CompletionLogprobs(
        [p.text for p in pieces],
        [_logprob(p) for p in pieces],
        None,
        offsets,
    )


def _error_frame(final: Cancelled | Error) -> bytes:
    return sse.frame(msgspec.json.encode(_error_body(final_error(final))))


def _failure_frames(error: GatewayError) -> bytes:
    """A stream that failed after its headers: the error object, then the end marker."""
    return sse.frame(msgspec.json.encode(_error_body(error))) + DONE_FRAME


def _error_body(exc: Exception) -> ErrorOut:
    error = as_gateway_error(exc)
    status = 400 if error.status == 422 else error.status
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return ErrorOut(ErrorDetail(error.message, kind, error.field, error.code))


def openai_error(_: AnyRequest, exc: Exception) -> Response[ErrorOut]:
    error = as_gateway_error(exc)
    status = 400 if error.status == 422 else error.status
    return Response(_error_body(error), status_code=status, headers=error.headers())


async def _stream(
    batches: AsyncIterable[list[GenerationItem]],
    chunk: Callable[[str, str | None, Token | None], msgspec.Struct],
    usage_chunk: Callable[[str, Usage], msgspec.Struct] | None,
    model: str,
) -> AsyncIterator[bytes]:
    """Chunks of one generation, ``chunk(model, finish_reason, token)``: one token per
    chunk, and what arrived together (a reader behind) in one write."""
    for_batch: list[bytes] = []
    async for items in batches:
        for item in items:
            if isinstance(item, Heartbeat):
                for_batch.append(sse.HEARTBEAT)
            elif isinstance(item, Started):
                model = item.model
            elif isinstance(item, Token):
                for_batch.append(sse.frame(msgspec.json.encode(chunk(model, None, item))))
            elif isinstance(item, Done):
                done = chunk(model, item.finish_reason, None)
                for_batch.append(sse.frame(msgspec.json.encode(done)))
                if usage_chunk is not None:
                    for_batch.append(sse.frame(msgspec.json.encode(usage_chunk(model, item.usage))))
                for_batch.append(DONE_FRAME)
            else:
                for_batch += (_error_frame(item), DONE_FRAME)
        if for_batch:
            yield for_batch[0] if len(for_batch) == 1 else b"".join(for_batch)
            for_batch.clear()


class ChatChunks:
    """The chunks of one streamed chat completion: the first delta carries the role."""

    def __init__(self, completion_id: str, created: int, want_logprobs: bool) -> None:
        self.completion_id = completion_id
        self.created = created
        self.want_logprobs = want_logprobs
        self.sent_role = False

    def chunk(self, model: str, finish: str | None, token: Token | None) -> ChatCompletionChunk:
        delta = ChatDelta(content=token.text if token is not None else None)
        if not self.sent_role:
            self.sent_role, delta.role = True, "assistant"
            delta.content = delta.content or ""
        pieces = per_token(token) if self.want_logprobs and token is not None else None
        logprobs = _chat_logprobs(pieces) if pieces else None
        return ChatCompletionChunk(
            self.completion_id,
            "chat.completion.chunk",
            self.created,
            model,
            [ChatChunkChoice(0, delta, logprobs, finish)],
            None,
        )

    def usage(self, model: str, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            self.completion_id, "chat.completion.chunk", self.created, model, [], _usage(usage)
        )


class CompletionChunks:
    """The chunks of one streamed (legacy) completion: logprob offsets run on across them."""

    def __init__(self, completion_id: str, created: int, want_logprobs: bool) -> None:
        self.completion_id = completion_id
        self.created = created
        self.want_logprobs = want_logprobs
        self.offset = 0

    def chunk(self, model: str, finish: str | None, token: Token | None) -> Completion:
        text = token.text if token is not None else ""
        pieces = per_token(token) if self.want_logprobs and token is not None else None
        logprobs = _completion_logprobs(pieces, self.offset) if pieces else None
        self.offset += len(text)
        choice = CompletionChoice(0, text, logprobs, finish)
        return Completion(
            self.completion_id, "text_completion", self.created, model, [choice], None
        )

    def usage(self, model: str, usage: Usage) -> Completion:
        return Completion(
            self.completion_id, "text_completion", self.created, model, [], _usage(usage)
        )


def chat_completion_body(
    completion_id: str, created: int, model: str, whole: Collected, want_logprobs: bool
) -> ChatCompletion:
    """The answer of a chat completion that does not stream."""
    logprobs = _chat_logprobs(whole.pieces) if want_logprobs else None
    choice = ChatChoice(
        0, AssistantMessage("assistant", whole.text), logprobs, whole.final.finish_reason
    )
    return ChatCompletion(
        completion_id,
        "chat.completion",
        created,
        whole.model or model,
        [choice],
        _usage(whole.final.usage),
    )


def completion_body(
    completion_id: str, created: int, model: str, whole: Collected, want_logprobs: bool
) -> Completion:
    """The answer of a (legacy) completion that does not stream."""
    logprobs = _completion_logprobs(whole.pieces, 0) if want_logprobs else None
    choice = CompletionChoice(0, whole.text, logprobs, whole.final.finish_reason)
    return Completion(
        completion_id,
        "text_completion",
        created,
        whole.model or model,
        [choice],
        _usage(whole.final.usage),
    )


@post("/chat/completions", summary="OpenAI chat completions", status_code=200)
async def chat_completions(
    request: AnyRequest,
    store: SessionStore,
    hub: RelayHub,
    settings: Settings,
    api_keys: ApiKeys,
    data: ChatCompletionRequest,
) -> Response[ChatCompletion] | Stream:
    require_api_key(request, api_keys)
    params = _chat_params(store, data)
    messages = _chat_messages(data, settings.max_history_messages)
    generation = await GenerationStream.submit(
        store, hub, settings, params, model=data.model, messages=messages
    )
    completion_id, created = f"chatcmpl-{generation.generation_id}", int(time.time())
    want_logprobs = bool(data.logprobs)

    if not data.stream:
        whole = await generation.collect()
        return Response(
            chat_completion_body(completion_id, created, data.model, whole, want_logprobs)
        )

    chunks = ChatChunks(completion_id, created, want_logprobs)
    include_usage = data.stream_options is not None and data.stream_options.include_usage
    stream = _stream(
        generation.batches(), chunks.chunk, chunks.usage if include_usage else None, data.model
    )
    return sse.response(
        ending_with_error(stream, _failure_frames), background=generation.on_response_end()
    )


@post("/completions", summary="OpenAI (legacy) completions", status_code=200)
async def completions(
    request: AnyRequest,
    store: SessionStore,
    hub: RelayHub,
    settings: Settings,
    api_keys: ApiKeys,
    data: CompletionRequest,
) -> Response[Completion] | Stream:
    require_api_key(request, api_keys)
    params = _completion_params(store, data)
    prompt = _completion_prompt(data)
    generation = await GenerationStream.submit(
        store, hub, settings, params, model=data.model, prompt=prompt
    )
    completion_id, created = f"cmpl-{generation.generation_id}", int(time.time())
    want_logprobs = data.logprobs == 0

    if not data.stream:
        whole = await generation.collect()
        return Response(completion_body(completion_id, created, data.model, whole, want_logprobs))

    chunks = CompletionChunks(completion_id, created, want_logprobs)
    include_usage = data.stream_options is not None and data.stream_options.include_usage
    stream = _stream(
        generation.batches(), chunks.chunk, chunks.usage if include_usage else None, data.model
    )
    return sse.response(
        ending_with_error(stream, _failure_frames), background=generation.on_response_end()
    )


@get("/models", summary="The models (and aliases) that have a live engine worker")
async def models(request: AnyRequest, store: SessionStore, api_keys: ApiKeys) -> ModelList:
    require_api_key(request, api_keys)
    cards: dict[str, ModelCard] = {}
    for worker in await store.models.live_workers():
        created = int(worker.started_at)
        for name in worker.names:  # as vLLM does: one card per served name
            if name not in cards or cards[name].created > created:
                cards[name] = ModelCard(name, "model", created, "tokenspout", worker.model)
    return ModelList("list", sorted(cards.values(), key=lambda card: card.id))


openai_router = Router(
    path="/v1",
    route_handlers=[chat_completions, completions, models],
    tags=["openai"],
    exception_handlers={kind: openai_error for kind in HANDLED},
)
