"""What every adapter shares, in this process: a step's text on its first token, the final
error of an unfinished generation, the mapping of failures to gateway errors and the error
an adapter writes after what it sent (gateway/core/errors.py, generation_stream.py)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
from litestar import Litestar, get, post
from litestar.exceptions import HTTPException, ValidationException
from litestar.testing import TestClient
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.apis.oip.routes import oip_error
from gateway.apis.openai.errors import openai_error
from gateway.apis.tgi import tgi_error
from gateway.core.errors import (
    HANDLED,
    BadRequest,
    GatewayError,
    Overloaded,
    Unavailable,
    as_gateway_error,
    ending_with_error,
)
from gateway.core.generation_stream import TokenPiece, final_error, per_token
from tests.support.adapter_events import tok, written
from wire import Cancelled, Error, Usage


def test_per_token_gives_a_steps_whole_text_to_its_first_token() -> None:
    assert per_token(tok("ab", 2, [1, 2], [-0.1, -0.2])) == [
        TokenPiece(1, "ab", -0.1, "ab"),
        TokenPiece(2, "", -0.2, ""),
    ]
    assert per_token(tok("x", 1, [7])) == [TokenPiece(7, "x", None, "x")]
    assert per_token(tok("", 0, [])) == []


def test_final_error_of_a_generation_that_did_not_finish() -> None:
    """A 503 says when to send it again, like every other 503 of the gateway (a chaos
    client counted a request Redis lost, answered 503 ``events_lost``, as a refusal it
    could not time); the client's own fault, a 422, does not."""
    cancelled = final_error(Cancelled("g", "user", Usage(1, 1)))
    assert isinstance(cancelled, Unavailable)
    assert (cancelled.code, cancelled.message) == (
        "cancelled",
        "the generation was cancelled (user)",
    )
    too_long = final_error(Error("g", "prompt_too_long", "the prompt is too long"))
    assert isinstance(too_long, BadRequest) and too_long.code == "prompt_too_long"
    assert "Retry-After" not in too_long.headers()
    failed = final_error(Error("g", "engine_failed", "out of memory"))
    assert isinstance(failed, Unavailable) and failed.message == "out of memory"
    lost = final_error(Error("g", "events_lost", "Redis lost this generation's request"))
    for unfinished in (cancelled, failed, lost):
        assert unfinished.headers() == {"Retry-After": "1"}


@pytest.mark.parametrize(
    ("exc", "kind", "code", "status"),
    [
        (HTTPException(status_code=413, detail="big"), "PayloadTooLarge", "too_large", 413),
        (HTTPException(status_code=404, detail="gone"), "NotFound", "not_found", 404),
        (HTTPException(status_code=400, detail="bad"), "BadRequest", "invalid_request", 422),
        # Any other error Litestar raises keeps its status (and headers: a 405's Allow).
        (HTTPException(status_code=405, detail="no"), "FrameworkError", "method_not_allowed", 405),
        (HTTPException(status_code=500, detail="x"), "FrameworkError", "http_error", 500),
        (RecursionError(), "BadRequest", "too_deep", 422),
        (RedisConnectionError("down"), "Unavailable", "unavailable", 503),
        (KeyError("k"), "GatewayError", "internal_error", 500),
    ],
)
def test_as_gateway_error_maps_what_a_request_can_end_with(
    exc: Exception, kind: str, code: str, status: int
) -> None:
    error = as_gateway_error(exc)
    assert (type(error).__name__, error.code, error.status) == (kind, code, status)


def test_as_gateway_error_names_the_unknown_field_of_a_validation_error() -> None:
    exc = ValidationException(
        detail="Validation failed",
        extra=[{"message": "Object contains unknown field `colour`", "key": "body"}],
    )
    error = as_gateway_error(exc)
    assert isinstance(error, BadRequest)
    assert (error.message, error.field) == ("Object contains unknown field `colour`", "colour")
    assert as_gateway_error(error) is error


async def test_ending_with_error_writes_the_adapters_error_after_what_was_sent() -> None:
    async def failing() -> AsyncIterator[bytes]:
        yield b"one"
        raise Overloaded("too busy", retry_after_s=1)

    def frames(error: GatewayError) -> bytes:
        return f"[{error.code}: {error.message}]".encode()

    assert await written(ending_with_error(failing(), frames)) == [
        b"one",
        b"[overloaded: too busy]",
    ]


def test_an_unexpected_exception_is_logged_and_answered_in_the_adapters_format(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Anything a handler did not expect is a 500 in the API's own error format, with its
    traceback in the log: Litestar's own answer would go unlogged (the app leaves logging
    to the gateway), as a 500 of the chaos soak did."""

    @get("/boom", sync_to_thread=False)
    def boom() -> None:
        raise RuntimeError("something nobody expected")

    handlers = {kind: openai_error for kind in HANDLED}
    app = Litestar([boom], exception_handlers=handlers, logging_config=None)  # as the gateway
    with TestClient(app) as client, caplog.at_level(logging.ERROR, "tokenspout.errors"):
        answer = client.get("/boom")
    assert answer.status_code == 500
    assert answer.json()["error"]["code"] == "internal_error"
    assert answer.json()["error"]["type"] == "server_error"
    assert "RuntimeError: something nobody expected" in caplog.text


class Body(msgspec.Struct):
    a: str | None = None


@post("/echo", sync_to_thread=False)
def echo(data: Body) -> Body:
    return data


ADAPTERS: dict[str, tuple[Callable[..., Any], Callable[[Any], str]]] = {
    "openai": (openai_error, lambda body: body["error"]["message"]),
    "tgi": (tgi_error, lambda body: body["error"]),
    "oip": (oip_error, lambda body: body["error"]),
}


# The handler takes its body as the gateway's do (``data: Struct``, no body marker), which
# Litestar 2.25 warns about (as tests/inprocess/test_api_key_guard.py says).
@pytest.mark.filterwarnings(
    "ignore::litestar.exceptions.base_exceptions.LitestarDeprecationWarning"
)
@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize(
    ("body", "status", "said"),
    [
        (b'{"a": "' + b"x" * 300 + b'"}', 413, "over the limit of 256 bytes, set by "
         "TOKENSPOUT_MAX_BODY_BYTES"),
        (b'{"inputs": "hi",', 0, "not valid JSON: it ends before the JSON value does, at line 1, "
         "column 17 (byte 16)"),
        (b'{\n "a": 1,\n "b": }', 0, "not valid JSON: invalid character, at line 3, column 7 "
         "(byte 17)"),
        (b'{"a": "\xff"}', 0, "not valid JSON: it is not UTF-8, at line 1, column 8 (byte 7)"),
    ],
    ids=["too-large", "truncated", "malformed", "not-utf-8"],
)  # fmt: skip
def test_a_body_too_large_or_not_json_is_told_the_limit_or_where_it_breaks(
    adapter: str, body: bytes, status: int, said: str
) -> None:
    """Litestar's own words were "Request Entity Too Large" and msgspec's "Input data was
    truncated" (and invalid UTF-8 a 500); every adapter now names the limit and its
    setting, or says the body is not JSON and where, in its own error format."""
    handler, message_of = ADAPTERS[adapter]
    app = Litestar(
        [echo],
        exception_handlers={kind: handler for kind in HANDLED},
        request_max_body_size=256,
        logging_config=None,
    )
    with TestClient(app) as client:
        answer = client.post("/echo", content=body, headers={"content-type": "application/json"})
    expected = status or (400 if adapter == "openai" else 422)
    assert answer.status_code == expected, answer.text
    assert said in message_of(answer.json())
