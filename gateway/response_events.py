"""A ``/v1/responses`` response, rendered from its session's events.

A response is one generation in a session of its own (gateway/responses.py). Its OpenAI
events are a pure function of that session's event stream: ``ResponseRenderer`` turns each
session event into zero or more Responses events and numbers them from 0. The same stream
gives the same events with the same ``sequence_number`` on every replica, at any time, so
``starting_after=N`` is a resume from a known position: render from the stream's start and
skip what is numbered N or less.

    renderer = ResponseRenderer(record, response_id)
    for event in renderer.render(session_event):   # dicts in OpenAI's shapes
        ...
    renderer.response()                             # the response object so far
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.errors import EventsExpired
from wire import (
    Cancelled,
    ChatMessage,
    Done,
    Error,
    Queued,
    SessionEvent,
    Started,
    Token,
)

Event = dict[str, Any]


class ResponseRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What a response's request was, stored in its session's meta hash (``response``)."""

    model: str
    created_at: int
    conversation: list[ChatMessage]
    """The messages the reply continues, without ``instructions`` (a response that names
    this one as ``previous_response_id`` continues these plus this one's output)."""
    input_items: list[dict[str, Any]]
    """This request's own input, as ``GET .../input_items`` lists it."""
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] = {}
    background: bool = False
    store: bool = True
    previous_response_id: str | None = None
    text_format: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "text"})
    logprobs: bool = False


class ResponseRenderer:
    """The Responses events of one response, numbered from 0, one session event at a time."""

    def __init__(self, record: ResponseRecord, response_id: str, generation_id: str) -> None:
        self.record = record
        self.response_id = response_id
        self.item_id = f"msg_{generation_id}"
        self.model = record.model
        self.status = "queued" if record.background else "in_progress"
        self.sequence = 0
        self.created = False
        self.started = False
        self.item_open = False
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.item: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, str] | None = None
        self.incomplete: dict[str, str] | None = None
        self.ended = False

    def render(self, event: SessionEvent) -> list[Event]:
        """The events one session event makes (none for ``resumed``, repeats or after the
        end)."""
        out: list[Event] = []
        if self.ended:
            return out
        if not self.created:
            if not isinstance(event, Queued):
                # Its first event is always ``queued``: without it, numbering would shift.
                raise EventsExpired(
                    f"the first events of {self.response_id} were trimmed from its stream"
                )
            self.created = True
            out.append(self._event("response.created", response=self.response()))
        if isinstance(event, Started) and not self.started:
            self.started = True
            self.model = event.model or self.model
            self.status = "in_progress"
            self.item_open = True
            self.item = self._item("in_progress")
            out.append(self._event("response.in_progress", response=self.response()))
            out.append(self._event("response.output_item.added", output_index=0, item=self.item))
            out.append(self._part_event("response.content_part.added", self._part("")))
        elif isinstance(event, Token) and self.item_open:
            logprobs = self._logprobs(event)
            self.logprobs += logprobs
            if event.visible:
                self.text.append(event.visible)
                out.append(self._part_event("response.output_text.delta", None, event.visible))
                out[-1]["logprobs"] = logprobs
        elif isinstance(event, Done | Cancelled | Error):
            out += self._end(event)
        return out

    def _end(self, event: Done | Cancelled | Error) -> list[Event]:
        out: list[Event] = []
        self.ended = True
        if isinstance(event, Error):
            self.status = "failed"
            self.error = {"code": "server_error", "message": f"{event.code}: {event.message}"}
            if self.item_open:
                self.item = self._item("incomplete")
            return [self._event("response.failed", response=self.response())]
        usage = event.usage
        self.usage = {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        }
        if isinstance(event, Cancelled):
            self.status, kind = "cancelled", "response.incomplete"
        elif event.finish_reason == "length":
            self.status, kind = "incomplete", "response.incomplete"
            self.incomplete = {"reason": "max_output_tokens"}
        else:
            self.status, kind = "completed", "response.completed"
        if self.item_open:
            item_status = "completed" if self.status == "completed" else "incomplete"
            text = "".join(self.text)
            done = self._part_event("response.output_text.done", None)
            done["text"], done["logprobs"] = text, self.logprobs
            out.append(done)
            out.append(self._part_event("response.content_part.done", self._part(text)))
            self.item = self._item(item_status)
            out.append(self._event("response.output_item.done", output_index=0, item=self.item))
        out.append(self._event(kind, response=self.response()))
        return out

    @property
    def output_text(self) -> str:
        return "".join(self.text)

    def response(self) -> dict[str, Any]:
        """The response object as it stands."""
        record = self.record
        if self.item is not None:
            self.item = self._item(self.item["status"])
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": record.created_at,
            "status": self.status,
            "background": record.background,
            "error": self.error,
            "incomplete_details": self.incomplete,
            "instructions": record.instructions,
            "max_output_tokens": record.max_output_tokens,
            "metadata": record.metadata,
            "model": self.model,
            "output": [self.item] if self.item is not None else [],
            "parallel_tool_calls": True,
            "previous_response_id": record.previous_response_id,
            "store": record.store,
            "temperature": record.temperature,
            "text": {"format": record.text_format},
            "tool_choice": "auto",
            "tools": [],
            "top_p": record.top_p,
            "truncation": "disabled",
            "usage": self.usage,
        }

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _part_event(
        self, kind: str, part: dict[str, Any] | None, delta: str | None = None
    ) -> Event:
        fields: dict[str, Any] = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        if part is not None:
            fields["part"] = part
        if delta is not None:
            fields["delta"] = delta
        return self._event(kind, **fields)

    def _part(self, text: str) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        part["logprobs"] = self.logprobs if text else []
        return part

    def _item(self, status: str) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [self._part(self.output_text)] if self.started else [],
        }

    def _logprobs(self, token: Token) -> list[dict[str, Any]]:
        if not self.record.logprobs or token.logprobs is None:
            return []
        own = token.tokens or [""] * len(token.logprobs)
        tops = token.top_logprobs or [[] for _ in token.logprobs]
        return [
            {
                "token": text,
                "bytes": list(text.encode()),
                "logprob": logprob,
                "top_logprobs": [
                    {"token": t.token, "bytes": list(t.token.encode()), "logprob": t.logprob}
                    for t in top
                ],
            }
            for text, logprob, top in zip(own, token.logprobs, tops, strict=False)
        ]
