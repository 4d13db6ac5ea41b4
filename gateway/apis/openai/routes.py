"""OpenAI-compatible API: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

A thin adapter: each request becomes one stateless generation (``GenerationStream``); this
module only translates parameters in and events out, and spells errors the way the
``openai`` SDK expects (``{"error": {"message", "type", "param", "code"}}``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any, Protocol

import msgspec
from litestar import Response, Router, get, post
from litestar.response import Stream

from gateway.apis.openai.choices import Choices, IndexedItem
from gateway.apis.openai.schema import (
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
    FunctionCallOut,
    ModelCard,
    ModelList,
    NamedToolChoice,
    TokenLogprob,
    ToolCallChunk,
    ToolCallOut,
    TopLogprobOut,
    UsageOut,
    _Sampling,
)
from gateway.core import structured, tools
from gateway.core.auth import api_key_check
from gateway.core.errors import (
    HANDLED,
    AnyRequest,
    BadEngineOutput,
    BadRequest,
    GatewayError,
    as_gateway_error,
    ending_with_error,
    request_error,
)
from gateway.core.generation_stream import (
    Collected,
    Heartbeat,
    TokenPiece,
    final_error,
    per_token,
)
from gateway.core.relay import RelayHub
from gateway.core.sessions import SessionStore
from gateway.core.settings import Settings
from gateway.server import sse
from wire import (
    Cancelled,
    ChatMessage,
    Done,
    Error,
    Role,
    SamplingParams,
    Started,
    Token,
    ToolCall,
    ToolCallDelta,
    Tools,
    ToolSpec,
    Usage,
)

DONE_FRAME = sse.frame(b"[DONE]")
ROLES: dict[str, Role] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
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


def _choices(body: _Sampling, settings: Settings) -> int:
    n = body.n or 1
    if n > settings.max_choices:
        raise BadRequest(
            f"n must be at most {settings.max_choices} (TOKENSPOUT_MAX_CHOICES)",
            code="too_many_choices",
            field="n",
        )
    return n


def _logit_bias(given: dict[str, float] | None) -> dict[int, float] | None:
    if not given:
        return None
    bias = {}
    for key, value in given.items():
        if not key.lstrip("-").isdigit() or int(key) < 0:
            raise BadRequest(f"logit_bias keys must be token ids, not {key!r}", field="logit_bias")
        bias[int(key)] = value
    return bias


def _sampling(body: _Sampling, max_tokens: int | None) -> dict[str, Any]:
    """The parameters every OpenAI endpoint shares, checked; refuses what is not supported."""
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
        "logit_bias": _logit_bias(body.logit_bias),
        "structured": structured.constraint(
            body.response_format, body.structured_outputs, body.guided
        ),
        **{name: getattr(body, name) for name in VLLM_FIELDS},
    }


def _chat_messages(body: ChatCompletionRequest, max_messages: int) -> list[ChatMessage]:
    if not body.messages:
        raise BadRequest("messages must not be empty", field="messages")
    if len(body.messages) > max_messages:
        raise BadRequest(
            f"messages may hold at most {max_messages} entries "
            "(TOKENSPOUT_MAX_HISTORY_MESSAGES, as a session's history)",
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
        if role == "tool" and not message.tool_call_id:
            raise BadRequest(
                "a tool message needs the tool_call_id it answers",
                field=f"messages[{index}].tool_call_id",
            )
        calls = [
            ToolCall(call.id, call.function.name, call.function.arguments)
            for call in message.tool_calls or ()
        ]
        if calls and role != "assistant":
            raise BadRequest(
                "only assistant messages carry tool_calls", field=f"messages[{index}].tool_calls"
            )
        messages.append(ChatMessage(role, content or "", calls, message.tool_call_id))
    return messages


def _chat_tools(body: ChatCompletionRequest) -> Tools | None:
    specs = [
        ToolSpec(
            tool.function.name, tool.function.description or "", tool.function.parameters or {}
        )
        for tool in body.tools or ()
    ]
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        return tools.tools_of(specs, "named", choice.function.name, body.parallel_tool_calls)
    return tools.tools_of(specs, choice, None, body.parallel_tool_calls)


def _chat_params(
    store: SessionStore, body: ChatCompletionRequest, functions: Tools | None
) -> SamplingParams:
    if body.top_logprobs and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", field="top_logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens
    shared = _sampling(body, max_tokens)
    forced = tools.constraint(functions)
    if forced is not None:
        if shared["structured"] is not None:
            raise BadRequest(
                "a forced tool call (tool_choice required or named) and a structured output "
                "cannot both constrain the reply",
                code="invalid_tools",
                field="tool_choice",
            )
        shared["structured"] = forced
    return store.queue.sampling(
        named={"max_tokens": "max_completion_tokens"} if body.max_completion_tokens else None,
        **shared,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs or 0,
    )


def _completion_params(store: SessionStore, body: CompletionRequest) -> SamplingParams:
    if body.echo:
        raise _refuse("echo", "echo is not supported")
    if body.best_of not in (None, 1):
        raise _refuse("best_of", "best_of must be 1")
    if body.suffix:
        raise _refuse("suffix", "suffix is not supported")
    shared = _sampling(body, body.max_tokens)
    return store.queue.sampling(
        named={"top_logprobs": "logprobs"},
        **shared,
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
    )


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
        [
            TokenLogprob(
                p.token,
                _logprob(p),
                list(p.token.encode()),
                [TopLogprobOut(t.token, t.logprob, list(t.token.encode())) for t in p.top or ()],
            )
            for p in pieces
        ]
    )


def _completion_logprobs(pieces: list[TokenPiece], offset: int) -> CompletionLogprobs:
    offsets = []
    for piece in pieces:
        offsets.append(offset)
        offset += len(piece.token)
    tops = None
    if any(piece.top is not None for piece in pieces):
        tops = [{t.token: t.logprob for t in piece.top or ()} for piece in pieces]
    return CompletionLogprobs(
        [p.token for p in pieces],
        [_logprob(p) for p in pieces],
        tops,
        offsets,
    )


def _error_frame(final: Cancelled | Error) -> bytes:
    return sse.frame(msgspec.json.encode(error_body(final_error(final))))


def _failure_frames(error: GatewayError) -> bytes:
    """A stream that failed after its headers: the error object, then the end marker."""
    return sse.frame(msgspec.json.encode(error_body(error))) + DONE_FRAME


def error_body(exc: Exception) -> ErrorOut:
    """The error object OpenAI's API answers with (its ``type`` from the HTTP status)."""
    error = as_gateway_error(exc)
    status = 400 if error.status == 422 else error.status
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return ErrorOut(ErrorDetail(error.message, kind, error.field, error.code))


def error_answer(exc: Exception) -> tuple[int, ErrorOut, dict[str, str]]:
    """An error's answer in OpenAI's format: its status, body and headers."""
    error = as_gateway_error(exc)
    status = 400 if error.status == 422 else error.status
    return status, error_body(error), error.headers()


def openai_error(request: AnyRequest, exc: Exception) -> Response[ErrorOut]:
    status, body, headers = error_answer(request_error(request, exc))
    return Response(body, status_code=status, headers=headers)


class UsageTally:
    """Usage across the choices of one stream: the prompt once, completions summed."""

    def __init__(self, choices: int) -> None:
        self.prompt_tokens = 0
        self.completion = [0] * choices

    def started(self, event: Started) -> None:
        self.prompt_tokens = event.prompt_tokens

    def token(self, index: int, token: Token) -> None:
        self.completion[index] = token.count

    def so_far(self) -> UsageOut:
        completion = sum(self.completion)
        return UsageOut(self.prompt_tokens, completion, self.prompt_tokens + completion)

    @staticmethod
    def of(finals: list[Done]) -> UsageOut:
        prompt = finals[0].usage.prompt_tokens
        completion = sum(final.usage.completion_tokens for final in finals)
        return UsageOut(prompt, completion, prompt + completion)


class Chunks(Protocol):
    """How one endpoint spells a stream's chunks (``ChatChunks``, ``CompletionChunks``)."""

    def chunk(self, model: str, index: int, token: Token | None, finish: str | None) -> Any: ...

    def usage(self, model: str, usage: UsageOut) -> Any: ...


async def stream_chunks(
    batches: AsyncIterable[list[IndexedItem]],
    chunks: Chunks,
    model: str,
    *,
    choices: int = 1,
    include_usage: bool = False,
    continuous_usage: bool = False,
) -> AsyncIterator[bytes]:
    """The chunks of a request's ``choices`` generations: one token per chunk, each with
    its choice's index, what arrived together (a reader behind) in one write; ``[DONE]``
    once every choice has finished, or an error frame as soon as one fails."""
    tally = UsageTally(choices)
    finals: list[Done] = []
    for_batch: list[bytes] = []

    def add(chunk: Any) -> None:
        if continuous_usage:
            chunk.usage = tally.so_far()
        for_batch.append(sse.frame(msgspec.json.encode(chunk)))

    async for items in batches:
        for index, item in items:
            if isinstance(item, Heartbeat):
                for_batch.append(sse.HEARTBEAT)
            elif isinstance(item, Started):
                model = item.model
                tally.started(item)
            elif isinstance(item, Token):
                tally.token(index, item)
                add(chunks.chunk(model, index, item, None))
            elif isinstance(item, Done):
                add(chunks.chunk(model, index, None, item.finish_reason))
                finals.append(item)
                if len(finals) == choices:
                    if include_usage:
                        for_batch.append(
                            sse.frame(msgspec.json.encode(chunks.usage(model, tally.of(finals))))
                        )
                    for_batch.append(DONE_FRAME)
            else:
                for_batch += (_error_frame(item), DONE_FRAME)
                yield sse.Last(b"".join(for_batch))
                return
        if for_batch:
            chunk = for_batch[0] if len(for_batch) == 1 else b"".join(for_batch)
            yield sse.Last(chunk) if len(finals) == choices else chunk
            for_batch.clear()


class ChatChunks:
    """The chunks of one streamed chat completion: each choice's first delta carries the
    role."""

    def __init__(self, completion_id: str, created: int, want_logprobs: bool) -> None:
        self.completion_id = completion_id
        self.created = created
        self.want_logprobs = want_logprobs
        self.sent_role: set[int] = set()

    def chunk(
        self, model: str, index: int, token: Token | None, finish: str | None
    ) -> ChatCompletionChunk:
        delta = ChatDelta(content=token.visible if token is not None else None)
        if token is not None and token.tool_calls:
            delta.tool_calls = [_call_chunk(call) for call in token.tool_calls]
            delta.content = delta.content or None
        if index not in self.sent_role:
            self.sent_role.add(index)
            delta.role, delta.content = "assistant", delta.content or ""
        pieces = per_token(token) if self.want_logprobs and token is not None else None
        logprobs = _chat_logprobs(pieces) if pieces else None
        return ChatCompletionChunk(
            self.completion_id,
            "chat.completion.chunk",
            self.created,
            model,
            [ChatChunkChoice(index, delta, logprobs, finish)],
            None,
        )

    def usage(self, model: str, usage: UsageOut) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            self.completion_id, "chat.completion.chunk", self.created, model, [], usage
        )


class CompletionChunks:
    """The chunks of one streamed (legacy) completion: each choice's logprob offsets run on
    across its chunks."""

    def __init__(self, completion_id: str, created: int, want_logprobs: bool) -> None:
        self.completion_id = completion_id
        self.created = created
        self.want_logprobs = want_logprobs
        self.offsets: dict[int, int] = {}

    def chunk(self, model: str, index: int, token: Token | None, finish: str | None) -> Completion:
        text = token.text if token is not None else ""
        offset = self.offsets.get(index, 0)
        pieces = per_token(token) if self.want_logprobs and token is not None else None
        logprobs = _completion_logprobs(pieces, offset) if pieces else None
        self.offsets[index] = offset + (sum(len(p.token) for p in pieces) if pieces else len(text))
        choice = CompletionChoice(index, text, logprobs, finish)
        return Completion(
            self.completion_id, "text_completion", self.created, model, [choice], None
        )

    def usage(self, model: str, usage: UsageOut) -> Completion:
        return Completion(self.completion_id, "text_completion", self.created, model, [], usage)


def _call_chunk(call: ToolCallDelta) -> ToolCallChunk:
    function = FunctionCallOut(call.arguments, call.name)
    if call.id is None:
        return ToolCallChunk(call.index, function)
    return ToolCallChunk(call.index, function, call.id, "function")


def _assistant_message(whole: Collected) -> AssistantMessage:
    """A reply's message: its content (null when it only called), and its calls."""
    if not whole.tool_calls:
        return AssistantMessage("assistant", whole.text)
    calls = [
        ToolCallOut(call.id, "function", FunctionCallOut(call.arguments, call.name))
        for call in whole.tool_calls
    ]
    return AssistantMessage("assistant", whole.text or None, calls)


def chat_completion_body(
    completion_id: str, created: int, model: str, wholes: list[Collected], want_logprobs: bool
) -> ChatCompletion:
    """The answer of a chat completion that does not stream: one choice per generation."""
    choices = [
        ChatChoice(
            index,
            _assistant_message(whole),
            _chat_logprobs(whole.pieces) if want_logprobs else None,
            whole.final.finish_reason,
        )
        for index, whole in enumerate(wholes)
    ]
    usage = UsageTally.of([whole.final for whole in wholes])
    return ChatCompletion(
        completion_id, "chat.completion", created, wholes[0].model or model, choices, usage
    )


def completion_body(
    completion_id: str, created: int, model: str, wholes: list[Collected], want_logprobs: bool
) -> Completion:
    """The answer of a (legacy) completion that does not stream: one choice per generation."""
    choices = [
        CompletionChoice(
            index,
            whole.text,
            _completion_logprobs(whole.pieces, 0) if want_logprobs else None,
            whole.final.finish_reason,
        )
        for index, whole in enumerate(wholes)
    ]
    usage = UsageTally.of([whole.final for whole in wholes])
    return Completion(
        completion_id, "text_completion", created, wholes[0].model or model, choices, usage
    )


def _stream_body(choices: Choices, chunks: Chunks, body: _Sampling, n: int) -> AsyncIterator[bytes]:
    options = body.stream_options
    stream = stream_chunks(
        choices.batches(),
        chunks,
        body.model,
        choices=n,
        include_usage=options is not None and options.include_usage,
        continuous_usage=options is not None
        and options.include_usage
        and options.continuous_usage_stats,
    )
    return ending_with_error(stream, _failure_frames)


def _streamed(choices: Choices, chunks: Chunks, body: _Sampling, n: int) -> Stream:
    return sse.response(
        _stream_body(choices, chunks, body, n), background=choices.on_response_end()
    )


PREFIX, CHAT_COMPLETIONS, COMPLETIONS = "/v1", "/chat/completions", "/completions"
"""The routes' paths: the router's prefix and each route's own (gateway/apis/openai/hot.py serves
the same two ahead of Litestar)."""


async def _submit_chat(
    store: SessionStore, hub: RelayHub, settings: Settings, data: ChatCompletionRequest
) -> tuple[Choices, int]:
    """A chat completion's generations, checked and queued; and how many choices."""
    functions = _chat_tools(data)
    params = _chat_params(store, data, functions)
    messages = _chat_messages(data, settings.max_history_messages)
    n = _choices(data, settings)
    choices = await Choices.submit(
        store, hub, settings, params, n, model=data.model, messages=messages, tools=functions
    )
    return choices, n


def _chat_chunks(choices: Choices, data: ChatCompletionRequest) -> ChatChunks:
    return ChatChunks(f"chatcmpl-{choices.generation_id}", int(time.time()), bool(data.logprobs))


async def streamed_chat(
    store: SessionStore, hub: RelayHub, settings: Settings, data: ChatCompletionRequest
) -> tuple[AsyncIterator[bytes], Choices]:
    """A streamed chat completion's body, for the hot routes (gateway/apis/openai/hot.py):
    the same chunks as ``chat_completions`` streams; its choices to close at the end."""
    choices, n = await _submit_chat(store, hub, settings, data)
    return _stream_body(choices, _chat_chunks(choices, data), data, n), choices


async def whole_chat(
    store: SessionStore, hub: RelayHub, settings: Settings, data: ChatCompletionRequest
) -> ChatCompletion:
    """A chat completion that does not stream, once every choice has ended: the answer of
    ``chat_completions`` and of the hot route."""
    choices, _ = await _submit_chat(store, hub, settings, data)
    chunks = _chat_chunks(choices, data)
    wholes = await choices.collect()
    return chat_completion_body(
        chunks.completion_id, chunks.created, data.model, wholes, chunks.want_logprobs
    )


@post(CHAT_COMPLETIONS, summary="OpenAI chat completions", status_code=200)
async def chat_completions(
    store: SessionStore,
    hub: RelayHub,
    settings: Settings,
    data: ChatCompletionRequest,
) -> Response[ChatCompletion] | Stream:
    if not data.stream:
        return Response(await whole_chat(store, hub, settings, data))
    choices, n = await _submit_chat(store, hub, settings, data)
    return _streamed(choices, _chat_chunks(choices, data), data, n)


async def _submit_completion(
    store: SessionStore, hub: RelayHub, settings: Settings, data: CompletionRequest
) -> tuple[Choices, int]:
    """A (legacy) completion's generations, checked and queued; and how many choices."""
    params = _completion_params(store, data)
    prompt = _completion_prompt(data)
    n = _choices(data, settings)
    choices = await Choices.submit(store, hub, settings, params, n, model=data.model, prompt=prompt)
    return choices, n


def _completion_chunks(choices: Choices, data: CompletionRequest) -> CompletionChunks:
    return CompletionChunks(
        f"cmpl-{choices.generation_id}", int(time.time()), data.logprobs is not None
    )


async def streamed_completion(
    store: SessionStore, hub: RelayHub, settings: Settings, data: CompletionRequest
) -> tuple[AsyncIterator[bytes], Choices]:
    """``streamed_chat`` for a (legacy) completion."""
    choices, n = await _submit_completion(store, hub, settings, data)
    return _stream_body(choices, _completion_chunks(choices, data), data, n), choices


async def whole_completion(
    store: SessionStore, hub: RelayHub, settings: Settings, data: CompletionRequest
) -> Completion:
    """``whole_chat`` for a (legacy) completion."""
    choices, _ = await _submit_completion(store, hub, settings, data)
    chunks = _completion_chunks(choices, data)
    wholes = await choices.collect()
    return completion_body(
        chunks.completion_id, chunks.created, data.model, wholes, chunks.want_logprobs
    )


@post(COMPLETIONS, summary="OpenAI (legacy) completions", status_code=200)
async def completions(
    store: SessionStore,
    hub: RelayHub,
    settings: Settings,
    data: CompletionRequest,
) -> Response[Completion] | Stream:
    if not data.stream:
        return Response(await whole_completion(store, hub, settings, data))
    choices, n = await _submit_completion(store, hub, settings, data)
    return _streamed(choices, _completion_chunks(choices, data), data, n)


@get("/models", summary="The models (and aliases) that have a live engine worker")
async def models(store: SessionStore) -> ModelList:
    cards: dict[str, ModelCard] = {}
    for worker in await store.models.live_workers():
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
