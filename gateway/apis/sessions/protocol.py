"""The WebSocket protocol's frames: typed JSON both ways, decoded in one place.

Every frame is a JSON object with a ``type``. Client frames: ``generate``, ``cancel``,
``resume``, ``ping``. Server frames: ``ack``, ``queued``, ``started``, ``token``,
``resumed``, ``done``, ``cancelled``, ``error``, ``events_lost``, ``pong``. Each frame
about a generation carries the client's own ``id`` for it, so several generations can share
one socket. docs/api.md shows examples.

New fields go at the end with defaults, as in wire/messages.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec

import wire
from gateway.apis.sessions.sampling import SamplingIn
from gateway.core.errors import BadRequest, PayloadTooLarge, not_json, over_body_limit
from wire import CancelReason, Usage

ClientId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


# --- client -> gateway -------------------------------------------------------------------


class GenerateFrame(SamplingIn, frozen=True, tag="generate", forbid_unknown_fields=True):
    """Send ``content`` as the next user message of a session and stream the reply; the
    sampling fields as for a session message (gateway/apis/sessions/sampling.py)."""

    id: ClientId
    content: str
    session_id: str | None = None
    """None: a new session (its id and token come back in the ``ack``)."""
    token: str | None = None
    """The session's token; defaults to the socket's ``?token=``."""
    api_key: str | None = None
    """With API keys configured, what a ``generate`` without ``session_id`` needs unless the
    socket's connect request carried ``Authorization: Bearer <key>`` or an earlier frame
    gave a valid key (browsers cannot set headers on a WebSocket)."""
    model: str | None = None
    """The model of a new session (a name or alias; None: the default). A named session
    keeps its own."""


class CancelFrame(msgspec.Struct, frozen=True, tag="cancel", forbid_unknown_fields=True):
    """Stop the generation this socket started as ``id``; or, with ``session_id`` and
    ``generation_id``, any generation of a session (one started over HTTP, say)."""

    id: ClientId
    session_id: str | None = None
    generation_id: str | None = None
    token: str | None = None


class ResumeFrame(msgspec.Struct, frozen=True, tag="resume", forbid_unknown_fields=True):
    """Follow a generation again (after a lost socket, on any replica): its frames after
    ``last_event_id`` (left out: from its first), tagged ``id``, up to its final one. (The
    server's ``resumed`` frame, ``ResumedFrame``, says another worker took a reply over.)"""

    id: ClientId
    session_id: str
    generation_id: str
    last_event_id: str | None = None
    """The ``event_id`` of the last frame the client got."""
    token: str | None = None


class PingFrame(msgspec.Struct, frozen=True, tag="ping", forbid_unknown_fields=True):
    id: str | None = None


ClientFrame = GenerateFrame | CancelFrame | ResumeFrame | PingFrame


# --- gateway -> client -------------------------------------------------------------------


class Ack(msgspec.Struct, frozen=True, tag="ack", omit_defaults=True):
    """A ``generate`` was queued (``state`` "queued"), or a ``cancel`` was taken
    (``state``: "cancelling" while the worker aborts, else the final state)."""

    id: str
    op: Literal["generate", "cancel", "resume"]
    generation_id: str
    session_id: str
    state: str
    token: str | None = None
    """The new session's token (only when ``generate`` created the session)."""
    generation_ids: list[str] | None = None
    """A ``generate`` with ``n`` > 1: every choice's generation, in choice order."""


class QueuedFrame(msgspec.Struct, frozen=True, tag="queued", omit_defaults=True):
    id: str
    generation_id: str
    event_id: str
    choice: int = 0
    """Which of a ``generate``'s ``n`` choices the frame is of (every generation frame
    says it when ``n`` > 1)."""


class StartedFrame(msgspec.Struct, frozen=True, tag="started", omit_defaults=True):
    id: str
    generation_id: str
    model: str
    prompt_tokens: int
    event_id: str
    choice: int = 0


class TokenFrame(msgspec.Struct, frozen=True, tag="token", omit_defaults=True):
    """One or more token events of the generation, coalesced (a slow reader gets fewer,
    larger frames). ``count``: completion tokens so far; ``event_id``: the last event's
    id on the session stream (resume point for SSE). With ``logprobs`` asked for: each
    token's logprob and own text, and its top alternatives when asked (``[text, logprob,
    id]`` each), as the session stream's token events carry them."""

    id: str
    text: str
    count: int
    event_id: str
    logprobs: list[float] | None = None
    tokens: list[str] | None = None
    top_logprobs: list[list[wire.TopLogprob]] | None = None
    choice: int = 0

    def then(self, token: wire.Token, event_id: str) -> TokenFrame:
        """This frame with ``token`` coalesced into it."""
        return TokenFrame(
            self.id,
            self.text + token.text,
            token.count,
            event_id,
            wire.concat_optional(self.logprobs, token.logprobs),
            wire.concat_optional(self.tokens, token.tokens),
            wire.concat_optional(self.top_logprobs, token.top_logprobs),
            self.choice,
        )


class DoneFrame(msgspec.Struct, frozen=True, tag="done", omit_defaults=True):
    id: str
    finish_reason: str
    usage: Usage
    event_id: str
    choice: int = 0


class CancelledFrame(msgspec.Struct, frozen=True, tag="cancelled", omit_defaults=True):
    id: str
    reason: CancelReason
    usage: Usage
    event_id: str
    choice: int = 0


class ErrorFrame(msgspec.Struct, frozen=True, tag="error", omit_defaults=True):
    """A bad frame (``id`` when it could be read), a refused request, or a generation that
    ended with an engine error (final)."""

    code: str
    message: str
    id: str | None = None
    field: str | None = None
    event_id: str | None = None
    retry_after_s: int | None = None
    """A refusal that may succeed later (``overloaded``, ``generation_running``): the HTTP
    ``Retry-After`` hint, in seconds."""
    choice: int = 0


class EventsLostFrame(msgspec.Struct, frozen=True, tag="events_lost"):
    """A ``resume``'s ``last_event_id`` is ahead of the session's stream (Redis lost the
    events after it, or it is none of this stream's): the generation's frames follow from
    its first, so the client starts its reply over."""

    id: str
    last_event_id: str
    message: str


class Pong(msgspec.Struct, frozen=True, tag="pong", omit_defaults=True):
    id: str | None = None


class ResumedFrame(msgspec.Struct, frozen=True, tag="resumed", omit_defaults=True):
    """The generation's engine worker was lost or stopped and another one goes on with it;
    the next token frame follows the last one, nothing is repeated."""

    id: str
    takeover: int
    event_id: str
    choice: int = 0


ServerFrame = (
    Ack
    | QueuedFrame
    | StartedFrame
    | TokenFrame
    | DoneFrame
    | CancelledFrame
    | ErrorFrame
    | Pong
    | ResumedFrame
    | EventsLostFrame
)

_decoder = msgspec.json.Decoder(ClientFrame)
_encoder = msgspec.json.Encoder()
_loose = msgspec.json.Decoder()
_AT_FIELD = re.compile(r"at `\$\.([^`]+)`")
_NAMED_FIELD = re.compile(r"field `([^`]+)`")


def decode_client_frame(data: str | bytes, max_bytes: int) -> ClientFrame:
    """The frame, or ``BadRequest`` / ``PayloadTooLarge`` naming what is wrong."""
    if len(data) > max_bytes:
        raise PayloadTooLarge(over_body_limit("the frame", max_bytes), code="frame_too_large")
    try:
        frame: ClientFrame = _decoder.decode(data)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if message.endswith("at `$.type`") or "missing required field `type`" in message:
            raise BadRequest(message, code="unknown_type", field="type") from None
        raise BadRequest(message, code="invalid_frame", field=_field_of(message)) from None
    except (msgspec.DecodeError, UnicodeDecodeError):
        raise not_json(data.encode() if isinstance(data, str) else data, "the frame") from None
    except RecursionError:
        # msgspec recurses even to skip a value: a frame nested past Python's limit.
        raise BadRequest("the frame is nested too deeply", code="too_deep") from None
    return frame


def client_id_of(data: str | bytes) -> str | None:
    """The ``id`` of a frame that failed to decode, if it has a readable one."""
    try:
        raw = _loose.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None
    value = raw.get("id") if isinstance(raw, dict) else None
    return value if isinstance(value, str) and 0 < len(value) <= 64 else None


def _field_of(message: str) -> str | None:
    at = _AT_FIELD.search(message) or _NAMED_FIELD.search(message)
    return at.group(1) if at else None


def encode_frame(frame: ServerFrame) -> str:
    return _encoder.encode(frame).decode()


def event_frames(
    client_id: str,
    events: list[tuple[str, wire.SessionEvent]],
    choice_of: Mapping[str, int] | None = None,
) -> list[ServerFrame]:
    """Session events of one ``generate`` as frames, runs of one choice's tokens coalesced
    into one; ``choice_of``: generation id -> choice, for a ``generate`` with ``n`` > 1."""
    frames: list[ServerFrame] = []
    for event_id, event in events:
        choice = choice_of.get(event.generation_id, 0) if choice_of else 0
        match event:
            case wire.Token():
                last = frames[-1] if frames else None
                if isinstance(last, TokenFrame) and last.choice == choice:
                    frames[-1] = last.then(event, event_id)
                else:
                    frames.append(
                        TokenFrame(
                            client_id,
                            event.text,
                            event.count,
                            event_id,
                            event.logprobs,
                            event.tokens,
                            event.top_logprobs,
                            choice,
                        )
                    )
            case wire.Queued(generation_id=gid):
                frames.append(QueuedFrame(client_id, gid, event_id, choice))
            case wire.Started(generation_id=gid, model=model, prompt_tokens=prompt):
                frames.append(StartedFrame(client_id, gid, model, prompt, event_id, choice))
            case wire.Done(finish_reason=reason, usage=usage):
                frames.append(DoneFrame(client_id, reason, usage, event_id, choice))
            case wire.Cancelled(reason=reason, usage=usage):
                frames.append(CancelledFrame(client_id, reason, usage, event_id, choice))
            case wire.Error(code=code, message=message):
                error = ErrorFrame(code, message, id=client_id, event_id=event_id, choice=choice)
                frames.append(error)
            case wire.Resumed(takeover=takeover):
                frames.append(ResumedFrame(client_id, takeover, event_id, choice))
    return frames
