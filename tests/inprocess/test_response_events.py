"""gateway/apis/openai/responses/events.py: a response's Responses events as a pure function of its
session's events. Takeover events and repeated starts add nothing, a cancel before the start
and an engine error end it with one final event, and a stream whose first events were
trimmed is refused instead of renumbered."""

from __future__ import annotations

import pytest

from gateway.apis.openai.responses.events import ResponseRecord, ResponseRenderer
from gateway.core.errors import EventsExpired
from wire import (
    Cancelled,
    Done,
    Error,
    Queued,
    Resumed,
    SessionEvent,
    Started,
    Token,
    ToolCallDelta,
    Usage,
)

GID = "g_1"


def _renderer(**fields: object) -> ResponseRenderer:
    record = ResponseRecord(model="m", created_at=1, conversation=[], input_items=[], **fields)  # type: ignore[arg-type]
    return ResponseRenderer(record, "resp_s_1.g_1", GID)


def _all(renderer: ResponseRenderer, events: list[SessionEvent]) -> list[dict[str, object]]:
    return [out for event in events for out in renderer.render(event)]


def test_a_takeover_and_a_second_start_add_no_event_and_numbering_is_contiguous() -> None:
    plain = [
        Queued(GID),
        Started(GID, "m", 3),
        Token(GID, "a", 1, [1]),
        Token(GID, "b", 2, [2]),
        Done(GID, "stop", Usage(3, 2)),
    ]
    taken_over = [
        *plain[:3],
        Resumed(GID, "w1", "w2", 1, 1),
        Started(GID, "m", 3),
        *plain[3:],
    ]
    one, other = _all(_renderer(), plain), _all(_renderer(), taken_over)
    assert one == other
    assert [e["sequence_number"] for e in one] == list(range(len(one)))
    assert one[-1]["type"] == "response.completed"


def test_a_cancel_before_the_start_ends_with_one_incomplete_event() -> None:
    renderer = _renderer(background=True)
    events = _all(renderer, [Queued(GID), Cancelled(GID, "user", Usage(0, 0))])
    assert [e["type"] for e in events] == ["response.created", "response.incomplete"]
    assert renderer.response()["status"] == "cancelled"
    assert renderer.render(Token(GID, "late", 1, [1])) == []


def test_an_engine_error_fails_the_response() -> None:
    renderer = _renderer()
    events = _all(renderer, [Queued(GID), Started(GID, "m", 1), Error(GID, "boom", "it broke")])
    assert events[-1]["type"] == "response.failed"
    assert renderer.response()["error"] == {"code": "server_error", "message": "boom: it broke"}


def test_a_stream_missing_its_first_event_is_refused() -> None:
    with pytest.raises(EventsExpired):
        _renderer().render(Token(GID, "a", 5, [1]))


def test_text_then_a_call_open_two_items_that_close_in_output_order() -> None:
    renderer = _renderer()
    call = ToolCallDelta(0, '{"a"', "call_1", "f")
    events = _all(
        renderer,
        [
            Queued(GID),
            Started(GID, "m", 1),
            Token(GID, "hi", 1, [1]),
            Token(GID, "", 2, [2], content="", tool_calls=[call]),
            Token(GID, "", 3, [3], content="", tool_calls=[ToolCallDelta(0, ": 1}")]),
            Done(GID, "tool_calls", Usage(1, 3)),
        ],
    )
    assert [(e["type"], e.get("output_index")) for e in events[2:]] == [
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.output_text.delta", 0),
        ("response.output_item.added", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.output_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1),
        ("response.completed", None),
    ]
    output = renderer.response()["output"]
    assert [item["type"] for item in output] == ["message", "function_call"]
    assert output[1]["arguments"] == '{"a": 1}' and output[1]["call_id"] == "call_1"
