"""gateway/apis/sessions/protocol.py: client frames decoded into types or refused with a typed error
naming what is wrong; server frames encoded to the exact JSON the docs show."""

from __future__ import annotations

import pytest

import wire
from gateway.apis.sessions import protocol as ws
from gateway.core.errors import BadRequest, GatewayError, PayloadTooLarge
from wire import Usage

LIMIT = 4096


def decode(data: str | bytes) -> ws.ClientFrame:
    return ws.decode_client_frame(data, LIMIT)


def refusal(data: str | bytes, max_bytes: int = LIMIT) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        ws.decode_client_frame(data, max_bytes)
    return caught.value


# --- decoding -------------------------------------------------------------------------


def test_generate_with_only_the_required_fields() -> None:
    assert decode('{"type":"generate","id":"a","content":"hi"}') == ws.GenerateFrame("a", "hi")


def test_generate_with_every_field() -> None:
    frame = decode(
        b'{"type":"generate","id":"a","content":"hi","session_id":"s","token":"t",'
        b'"max_tokens":5,"temperature":0.5,"top_p":0.9,"top_k":-1,"stop":["\\n"],'
        b'"seed":7,"min_tokens":3,"ignore_eos":true,"api_key":"k"}'
    )
    assert frame == ws.GenerateFrame(
        "a",
        "hi",
        "s",
        "t",
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        top_k=-1,
        stop=["\n"],
        seed=7,
        min_tokens=3,
        ignore_eos=True,
        api_key="k",
    )


def test_cancel_by_client_id_or_by_session_and_generation() -> None:
    assert decode('{"type":"cancel","id":"a"}') == ws.CancelFrame("a")
    assert decode(
        '{"type":"cancel","id":"c","session_id":"s","generation_id":"g","token":"t"}'
    ) == ws.CancelFrame("c", "s", "g", "t")


def test_ping_with_and_without_id() -> None:
    assert decode('{"type":"ping"}') == ws.PingFrame()
    assert decode('{"type":"ping","id":"p"}') == ws.PingFrame("p")


def test_an_oversized_frame_is_refused_before_it_is_parsed() -> None:
    error = refusal(b"x" * 11, max_bytes=10)  # not JSON either: size is checked first
    assert isinstance(error, PayloadTooLarge)
    assert (error.code, error.status, error.ws_close_code) == ("frame_too_large", 413, 4413)
    assert (
        error.message == "the frame is over the limit of 10 bytes, set by TOKENSPOUT_MAX_BODY_BYTES"
    )
    assert isinstance(ws.decode_client_frame(b'{"type":"ping"}', 15), ws.PingFrame)  # at the limit


@pytest.mark.parametrize(
    "data",
    ['{"type":"subscribe","id":"a"}', '{"id":"a","content":"hi"}', '{"type":7}'],
    ids=["unknown", "missing", "not-a-string"],
)
def test_an_unknown_or_missing_type_is_unknown_type(data: str) -> None:
    error = refusal(data)
    assert isinstance(error, BadRequest)
    assert (error.code, error.field, error.ws_close_code) == ("unknown_type", "type", 4422)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ('{"type":"generate","id":"a"}', "content"),
        ('{"type":"generate","id":"","content":"x"}', "id"),
        ('{"type":"generate","id":"' + "i" * 65 + '","content":"x"}', "id"),
        ('{"type":"generate","id":"a","content":"x","temperature":3}', "temperature"),
        ('{"type":"generate","id":"a","content":"x","top_p":0}', "top_p"),
        (
            '{"type":"generate","id":"a","content":"x","stop":' + '["s"' + ',"s"' * 8 + "]}",
            "stop",
        ),
        ('{"type":"generate","id":"a","content":"x","max_tokens":"many"}', "max_tokens"),
        ('{"type":"generate","id":"a","content":"x","colour":"red"}', "colour"),
        ('{"type":"cancel"}', "id"),
    ],
)
def test_an_invalid_field_is_invalid_frame_naming_the_field(data: str, field: str) -> None:
    error = refusal(data)
    assert isinstance(error, BadRequest)
    assert (error.code, error.field) == ("invalid_frame", field)


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ("{", "it ends before the JSON value does, at line 1, column 2 (byte 1)"),
        ('{"type":"ping"} trailing', "trailing characters, at line 1, column 18 (byte 17)"),
        (b"\xff", "it is not UTF-8, at line 1, column 1 (byte 0)"),
        ('{\n  "type": "ping",\n  "id": x\n}', "invalid character, at line 3, column 9 (byte 28)"),
    ],
)
def test_malformed_json_is_invalid_json_saying_where(data: str | bytes, where: str) -> None:
    error = refusal(data)
    assert isinstance(error, BadRequest)
    assert error.code == "invalid_json" and error.field is None
    assert error.message == f"the frame is not valid JSON: {where}"


def test_a_frame_that_is_not_an_object_is_refused() -> None:
    error = refusal("[1,2]")
    assert isinstance(error, BadRequest) and error.code == "invalid_frame"


def test_a_frame_nested_past_the_recursion_limit_is_too_deep() -> None:
    # Before the tag is found, msgspec skips the value by recursing into it.
    data = '{"x":' + "[" * 100_000 + "]" * 100_000 + ',"type":"ping"}'
    error = refusal(data, len(data))
    assert isinstance(error, BadRequest)
    assert (error.code, error.message) == ("too_deep", "the frame is nested too deeply")


@pytest.mark.parametrize(
    ("data", "client_id"),
    [
        ('{"type":"generate","id":"a7"}', "a7"),
        ('{"id":"x","type":"nope"}', "x"),
        ('{"id":5}', None),
        ('{"id":""}', None),
        ('{"id":"' + "i" * 65 + '"}', None),
        ("[1]", None),
        ("{", None),
    ],
)
def test_client_id_of_a_refused_frame(data: str, client_id: str | None) -> None:
    assert ws.client_id_of(data) == client_id


# --- encoding -------------------------------------------------------------------------

USAGE = Usage(prompt_tokens=3, completion_tokens=2)


@pytest.mark.parametrize(
    ("frame", "json"),
    [
        (
            ws.Ack("a", "generate", "g", "s", "queued", token="t"),
            '{"type":"ack","id":"a","op":"generate","generation_id":"g","session_id":"s",'
            '"state":"queued","token":"t"}',
        ),
        (
            ws.Ack("a", "cancel", "g", "s", "cancelling"),
            '{"type":"ack","id":"a","op":"cancel","generation_id":"g","session_id":"s",'
            '"state":"cancelling"}',
        ),
        (
            ws.QueuedFrame("a", "g", "1-0"),
            '{"type":"queued","id":"a","generation_id":"g","event_id":"1-0"}',
        ),
        (
            ws.StartedFrame("a", "g", "m", 3, "1-1"),
            '{"type":"started","id":"a","generation_id":"g","model":"m","prompt_tokens":3,'
            '"event_id":"1-1"}',
        ),
        (
            ws.TokenFrame("a", "hé", 2, "1-2"),
            '{"type":"token","id":"a","text":"hé","count":2,"event_id":"1-2"}',
        ),
        (
            ws.DoneFrame("a", "stop", USAGE, "1-3"),
            '{"type":"done","id":"a","finish_reason":"stop",'
            '"usage":{"prompt_tokens":3,"completion_tokens":2},"event_id":"1-3"}',
        ),
        (
            ws.CancelledFrame("a", "user", USAGE, "1-3"),
            '{"type":"cancelled","id":"a","reason":"user",'
            '"usage":{"prompt_tokens":3,"completion_tokens":2},"event_id":"1-3"}',
        ),
        (
            ws.ErrorFrame("overloaded", "busy", id="a", retry_after_s=2),
            '{"type":"error","code":"overloaded","message":"busy","id":"a","retry_after_s":2}',
        ),
        (
            ws.ErrorFrame("invalid_frame", "bad", field="top_p"),
            '{"type":"error","code":"invalid_frame","message":"bad","field":"top_p"}',
        ),
        (ws.Pong(), '{"type":"pong"}'),
        (ws.Pong("p"), '{"type":"pong","id":"p"}'),
    ],
    ids=lambda value: type(value).__name__ if not isinstance(value, str) else "",
)
def test_server_frames_encode_to_exact_json(frame: ws.ServerFrame, json: str) -> None:
    assert ws.encode_frame(frame) == json


def test_event_frames_coalesce_runs_of_tokens_and_keep_everything_else() -> None:
    events: list[tuple[str, wire.SessionEvent]] = [
        ("1-0", wire.Queued("g")),
        ("1-1", wire.Started("g", "m", 4)),
        ("1-2", wire.Token("g", "Hel", 1)),
        ("1-3", wire.Token("g", "lo", 2)),
        ("1-4", wire.Token("g", "!", 3)),
        ("1-5", wire.Done("g", "stop", Usage(4, 3))),
    ]
    assert ws.event_frames("c", events) == [
        ws.QueuedFrame("c", "g", "1-0"),
        ws.StartedFrame("c", "g", "m", 4, "1-1"),
        ws.TokenFrame("c", "Hello!", 3, "1-4"),
        ws.DoneFrame("c", "stop", Usage(4, 3), "1-5"),
    ]


def test_event_frames_do_not_merge_tokens_across_other_frames() -> None:
    events: list[tuple[str, wire.SessionEvent]] = [
        ("2-0", wire.Token("g", "a", 1)),
        ("2-1", wire.Started("g", "m", 1)),  # never between tokens, but frames stay apart
        ("2-2", wire.Token("g", "b", 2)),
        ("2-3", wire.Cancelled("g", "disconnected", Usage(1, 2))),
    ]
    assert ws.event_frames("c", events) == [
        ws.TokenFrame("c", "a", 1, "2-0"),
        ws.StartedFrame("c", "g", "m", 1, "2-1"),
        ws.TokenFrame("c", "b", 2, "2-2"),
        ws.CancelledFrame("c", "disconnected", Usage(1, 2), "2-3"),
    ]


def test_an_engine_error_event_is_a_final_error_frame_with_its_event_id() -> None:
    frames = ws.event_frames("c", [("3-0", wire.Error("g", "engine_failed", "oom"))])
    assert frames == [ws.ErrorFrame("engine_failed", "oom", id="c", event_id="3-0")]
    assert ws.encode_frame(frames[0]) == (
        '{"type":"error","code":"engine_failed","message":"oom","id":"c","event_id":"3-0"}'
    )
    assert ws.event_frames("c", []) == []
