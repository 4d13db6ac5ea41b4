"""How the OpenAI API spells a generation: the chunks of a streamed chat completion or
(legacy) completion, and the answer of one that does not stream.

``ChunkStream`` is the stream's ``Spelling`` (gateway/core/walk.py): the walk hands it the
events of a request's ``n`` choices; it writes one chunk per token with its choice's index,
``[DONE]`` once every choice has finished, or an error frame as soon as one fails. What a
chunk holds is the endpoint's (``ChatChunks``, ``CompletionChunks``).
"""

from __future__ import annotations

from typing import Any, Protocol

from gateway.apis.openai.errors import error_body
from gateway.apis.openai.schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FunctionCallOut,
    TokenLogprob,
    ToolCallChunk,
    ToolCallOut,
    TopLogprobOut,
    UsageOut,
)
from gateway.core.errors import BadEngineOutput, GatewayError
from gateway.core.generation_stream import Collected, TokenPiece, final_error, per_token
from gateway.transport import sse
from wire import Cancelled, Done, Error, Started, Token, ToolCallDelta

DONE_FRAME = sse.frame(b"[DONE]")


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


class ChunkStream(sse.SseSpelling):
    """The SSE frames of a request's ``choices`` generations (see the module's docstring);
    ``model``: what the client asked for, until a ``started`` event names the model."""

    def __init__(
        self,
        chunks: Chunks,
        model: str,
        choices: int = 1,
        *,
        include_usage: bool = False,
        continuous_usage: bool = False,
    ) -> None:
        self.chunks, self.model, self.choices = chunks, model, choices
        self.include_usage, self.continuous_usage = include_usage, continuous_usage
        self.tally = UsageTally(choices)
        self.finals: list[Done] = []

    def started(self, choice: int, event: Started, out: list[bytes]) -> None:
        self.model = event.model
        self.tally.started(event)

    def token(self, choice: int, event: Token, out: list[bytes]) -> None:
        self.tally.token(choice, event)
        self._add(self.chunks.chunk(self.model, choice, event, None), out)

    def done(self, choice: int, event: Done, out: list[bytes]) -> None:
        self._add(self.chunks.chunk(self.model, choice, None, event.finish_reason), out)
        self.finals.append(event)
        if len(self.finals) == self.choices:
            if self.include_usage:
                usage = UsageTally.of(self.finals)
                out.append(sse.json_frame(self.chunks.usage(self.model, usage)))
            out.append(DONE_FRAME)

    def ended_early(self, choice: int, event: Cancelled | Error, out: list[bytes]) -> None:
        out += (sse.json_frame(error_body(final_error(event))), DONE_FRAME)

    def _add(self, chunk: Any, out: list[bytes]) -> None:
        if self.continuous_usage:
            chunk.usage = self.tally.so_far()
        out.append(sse.json_frame(chunk))


def failure_frames(error: GatewayError) -> bytes:
    """A stream that failed after its headers: the error object, then the end marker."""
    return sse.json_frame(error_body(error)) + DONE_FRAME


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


def chat_completion_body(
    completion_id: str, created: int, model: str, wholes: list[Collected], want_logprobs: bool
) -> ChatCompletion:
    """The answer of a chat completion that does not stream: one choice per generation."""
    choices = []
    for index, whole in enumerate(wholes):
        logprobs = _chat_logprobs(whole.pieces) if want_logprobs else None
        message = _assistant_message(whole)
        choices.append(ChatChoice(index, message, logprobs, whole.final.finish_reason))
    model, usage = _answered_by(wholes, model)
    return ChatCompletion(completion_id, "chat.completion", created, model, choices, usage)


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
    model, usage = _answered_by(wholes, model)
    return Completion(completion_id, "text_completion", created, model, choices, usage)


def _answered_by(wholes: list[Collected], asked_for: str) -> tuple[str, UsageOut]:
    """The model that answered (the one asked for, when the engine did not say), and the
    usage summed over the choices."""
    return wholes[0].model or asked_for, UsageTally.of([whole.final for whole in wholes])


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
