"""A ``/v1/responses`` response, rendered from its session's events.

A response is one generation in a session of its own
(gateway/apis/openai/responses/store.py). Its OpenAI events are a pure function of that
session's event stream: ``ResponseRenderer`` turns each session event into zero or more
Responses events and numbers them from 0. The same stream gives the same events with the
same ``sequence_number`` on every replica, at any time, so ``starting_after=N`` is a resume
from a known position: render from the stream's start and skip what is numbered N or less.

    renderer = ResponseRenderer(record, response_id)
    for event in renderer.render(session_event):   # dicts in OpenAI's shapes
        ...
    renderer.response()                             # the response object so far
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.core.errors import EventsExpired
from gateway.core.tools import add_to_call
from wire import (
    Cancelled,
    ChatMessage,
    Done,
    Error,
    Queued,
    SessionEvent,
    Started,
    Token,
    ToolCall,
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
    tools: list[dict[str, Any]] = []
    """The request's function tools, as given."""
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True


class ResponseRenderer:
    """The Responses events of one response, numbered from 0, one session event at a time.

    Output items open as the reply needs them: the message on its first text, a
    ``function_call`` item on each call's first piece; all close, in output order, at the
    end."""

    def __init__(self, record: ResponseRecord, response_id: str, generation_id: str) -> None:
        self.record = record
        self.response_id = response_id
        self.generation_id = generation_id
        self.model = record.model
        self.status = "queued" if record.background else "in_progress"
        self.sequence = 0
        self.created = False
        self.started = False
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.output: list[dict[str, Any]] = []
        """The output items, as they stand (their text and arguments filled in by
        ``response``)."""
        self.message_index: int | None = None
        self.calls: dict[int, ToolCall] = {}
        self.call_items: dict[int, int] = {}
        """A call's index -> its item's output index."""
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
                    f"the first events of {self.response_id} were trimmed from its stream "
                    "(a session keeps its last TOKENSPOUT_EVENTS_MAXLEN)"
                )
            self.created = True
            out.append(self._event("response.created", response=self.response()))
        if isinstance(event, Started) and not self.started:
            self.started = True
            self.model = event.model or self.model
            self.status = "in_progress"
            out.append(self._event("response.in_progress", response=self.response()))
        elif isinstance(event, Token) and self.started:
            out += self._token(event)
        elif isinstance(event, Done | Cancelled | Error):
            out += self._end(event)
        return out

    def _token(self, token: Token) -> list[Event]:
        out: list[Event] = []
        logprobs = self._logprobs(token)
        self.logprobs += logprobs
        if token.visible:
            if self.message_index is None:
                self.message_index = len(self.output)
                self.output.append(self._message("in_progress"))
                out.append(self._added(self.message_index))
                out.append(self._part_event("response.content_part.added", self._part("")))
            self.text.append(token.visible)
            out.append(self._part_event("response.output_text.delta", None, token.visible))
            out[-1]["logprobs"] = logprobs
        for delta in token.tool_calls or ():
            self.calls[delta.index] = add_to_call(self.calls.get(delta.index), delta)
            if delta.index not in self.call_items:
                index = self.call_items[delta.index] = len(self.output)
                self.output.append(self._call(delta.index, "in_progress"))
                out.append(self._added(index))
            if delta.arguments:
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=self._call_item_id(delta.index),
                        output_index=self.call_items[delta.index],
                        delta=delta.arguments,
                    )
                )
        return out

    def _added(self, index: int) -> Event:
        return self._event("response.output_item.added", output_index=index, item=self._item(index))

    def _end(self, event: Done | Cancelled | Error) -> list[Event]:
        out: list[Event] = []
        self.ended = True
        if isinstance(event, Error):
            self.status = "failed"
            self.error = {"code": "server_error", "message": f"{event.code}: {event.message}"}
            self._close_items("incomplete")
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
        self._close_items("completed" if self.status == "completed" else "incomplete")
        for index, item in enumerate(self.output):
            if item["type"] == "message":
                text = self.output_text
                done = self._part_event("response.output_text.done", None)
                done["text"], done["logprobs"] = text, self.logprobs
                out.append(done)
                out.append(self._part_event("response.content_part.done", self._part(text)))
            else:
                call = self.calls[item["call_index"]]
                out.append(
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=call.name,
                        arguments=call.arguments,
                    )
                )
            out.append(
                self._event("response.output_item.done", output_index=index, item=self._item(index))
            )
        out.append(self._event(kind, response=self.response()))
        return out

    def _close_items(self, status: str) -> None:
        for item in self.output:
            item["status"] = status

    @property
    def output_text(self) -> str:
        return "".join(self.text)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls the reply made, in order."""
        return [self.calls[index] for index in sorted(self.calls)]

    def response(self) -> dict[str, Any]:
        """The response object as it stands."""
        record = self.record
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
            "output": [self._item(index) for index in range(len(self.output))],
            "parallel_tool_calls": record.parallel_tool_calls,
            "previous_response_id": record.previous_response_id,
            "store": record.store,
            "temperature": record.temperature,
            "text": {"format": record.text_format},
            "tool_choice": record.tool_choice,
            "tools": record.tools,
            "top_p": record.top_p,
            "truncation": "disabled",
            "usage": self.usage,
        }

    def _item(self, index: int) -> dict[str, Any]:
        """Output item ``index`` as it stands."""
        item = self.output[index]
        if item["type"] == "message":
            return {**item, "content": [self._part(self.output_text)]}
        call = self.calls[item["call_index"]]
        shown = {key: value for key, value in item.items() if key != "call_index"}
        return {**shown, "arguments": call.arguments}

    def _message(self, status: str) -> dict[str, Any]:
        return {
            "id": f"msg_{self.generation_id}",
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [],
        }

    def _call_item_id(self, call_index: int) -> str:
        return f"fc_{self.generation_id}_{call_index}"

    def _call(self, call_index: int, status: str) -> dict[str, Any]:
        call = self.calls[call_index]
        return {
            "id": self._call_item_id(call_index),
            "type": "function_call",
            "status": status,
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
            "call_index": call_index,
        }

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _part_event(
        self, kind: str, part: dict[str, Any] | None, delta: str | None = None
    ) -> Event:
        fields: dict[str, Any] = {
            "item_id": f"msg_{self.generation_id}",
            "output_index": self.message_index,
            "content_index": 0,
        }
        if part is not None:
            fields["part"] = part
        if delta is not None:
            fields["delta"] = delta
        return self._event(kind, **fields)

    def _part(self, text: str) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        part["logprobs"] = self.logprobs if text else []
        return part

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
