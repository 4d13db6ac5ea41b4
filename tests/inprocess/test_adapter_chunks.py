"""The adapters' wire output, built from contract events in this process: the OpenAI, TGI
and OIP stream chunks and whole answers (gateway/routes/openai.py, tgi.py, oip.py), the
pieces they share (errors.py, generation_stream.py), byte for byte."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from litestar.exceptions import HTTPException, ValidationException
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.errors import (
    BadEngineOutput,
    BadRequest,
    GatewayError,
    Overloaded,
    Unavailable,
    as_gateway_error,
    ending_with_error,
)
from gateway.generation_stream import (
    Collected,
    GenerationItem,
    Heartbeat,
    TokenPiece,
    final_error,
    per_token,
)
from gateway.routes import oip, openai, tgi
from wire import Cancelled, Done, Error, Started, Token, Usage

CREATED = 1_700_000_000
DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"


def compact(body: object) -> bytes:
    """JSON as msgspec writes it: no spaces, UTF-8, keys in the order given."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def data(body: object) -> bytes:
    """One SSE ``data:`` frame."""
    return b"data: " + compact(body) + b"\n\n"


class Items(AsyncIterator[GenerationItem]):
    """The events a ``GenerationStream`` yields; no async generator, so nothing is left to
    finalise when a writer stops early."""

    def __init__(self, *events: GenerationItem) -> None:
        self.events = iter(events)

    async def __anext__(self) -> GenerationItem:
        try:
            return next(self.events)
        except StopIteration:
            raise StopAsyncIteration from None


async def written(chunks: AsyncIterator[bytes]) -> list[bytes]:
    return [chunk async for chunk in chunks]


def tok(text: str, count: int, ids: list[int], logprobs: list[float] | None = None) -> Token:
    return Token("g", text, count, ids, logprobs)


STARTED = Started("g", "smol", 3)
HELLO = [tok("Hel", 1, [10], [-0.5]), tok("lo", 2, [11], [-0.25])]
DONE_STOP = Done("g", "stop", Usage(3, 2))


# --- the shared pieces ----------------------------------------------------------------


def test_per_token_gives_a_steps_whole_text_to_its_first_token() -> None:
    assert per_token(tok("ab", 2, [1, 2], [-0.1, -0.2])) == [
        TokenPiece(1, "ab", -0.1),
        TokenPiece(2, "", -0.2),
    ]
    assert per_token(tok("x", 1, [7])) == [TokenPiece(7, "x", None)]
    assert per_token(tok("", 0, [])) == []


def test_final_error_of_a_generation_that_did_not_finish() -> None:
    cancelled = final_error(Cancelled("g", "user", Usage(1, 1)))
    assert isinstance(cancelled, Unavailable)
    assert (cancelled.code, cancelled.message) == (
        "cancelled",
        "the generation was cancelled (user)",
    )
    too_long = final_error(Error("g", "prompt_too_long", "the prompt is too long"))
    assert isinstance(too_long, BadRequest) and too_long.code == "prompt_too_long"
    failed = final_error(Error("g", "engine_failed", "out of memory"))
    assert isinstance(failed, Unavailable) and failed.message == "out of memory"


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


# --- OpenAI chat completions ----------------------------------------------------------


def chat_chunk(
    model: str, delta: dict[str, str], finish: str | None, logprobs: Any = None
) -> bytes:
    return data(
        {
            "id": "chatcmpl-g",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": model,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            ],
            "usage": None,
        }
    )


def chat_stream(
    *events: GenerationItem, include_usage: bool = False, logprobs: bool = False
) -> AsyncIterator[bytes]:
    chunks = openai.ChatChunks("chatcmpl-g", CREATED, logprobs)
    usage = chunks.usage if include_usage else None
    return openai._stream(Items(*events), chunks.chunk, usage, "asked-for")


async def test_chat_stream_role_first_then_deltas_then_finish_then_done() -> None:
    sent = await written(chat_stream(STARTED, HELLO[0], Heartbeat(), HELLO[1], DONE_STOP))
    assert sent == [
        chat_chunk("smol", {"role": "assistant", "content": "Hel"}, None),
        KEEP_ALIVE,
        chat_chunk("smol", {"content": "lo"}, None),
        chat_chunk("smol", {}, "stop"),
        DONE,
    ]


async def test_chat_stream_usage_chunk_only_with_include_usage() -> None:
    sent = await written(chat_stream(STARTED, *HELLO, DONE_STOP, include_usage=True))
    usage = {
        "id": "chatcmpl-g",
        "object": "chat.completion.chunk",
        "created": CREATED,
        "model": "smol",
        "choices": [],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    assert sent[-3:] == [chat_chunk("smol", {}, "stop"), data(usage), DONE]


async def test_chat_stream_without_tokens_still_sends_the_role_and_the_requested_model() -> None:
    # No Started seen (it cannot be, but the model falls back to what the client asked for).
    sent = await written(chat_stream(Done("g", "length", Usage(3, 0))))
    assert sent == [chat_chunk("asked-for", {"role": "assistant", "content": ""}, "length"), DONE]


async def test_chat_stream_logprobs_per_token_with_utf8_bytes() -> None:
    sent = await written(
        chat_stream(STARTED, tok("é!", 2, [5, 6], [-0.5, -1.0]), DONE_STOP, logprobs=True)
    )
    logprobs = {
        "content": [
            {"token": "é!", "logprob": -0.5, "bytes": [195, 169, 33], "top_logprobs": []},
            {"token": "", "logprob": -1.0, "bytes": [], "top_logprobs": []},
        ]
    }
    assert sent == [
        chat_chunk("smol", {"role": "assistant", "content": "é!"}, None, logprobs),
        chat_chunk("smol", {}, "stop"),
        DONE,
    ]


async def test_chat_stream_missing_logprobs_end_in_a_bad_engine_output_error_frame() -> None:
    chunks = chat_stream(STARTED, tok("a", 1, [1]), DONE_STOP, logprobs=True)
    with pytest.raises(BadEngineOutput):
        await written(chunks)
    chunks = chat_stream(STARTED, tok("a", 1, [1]), DONE_STOP, logprobs=True)
    sent = await written(ending_with_error(chunks, openai._failure_frames))
    error = {
        "message": "logprobs were requested from the engine but it sent none",
        "type": "server_error",
        "param": None,
        "code": "bad_engine_output",
    }
    assert sent == [data({"error": error}) + DONE]


@pytest.mark.parametrize(
    ("final", "error"),
    [
        (
            Cancelled("g", "shutdown", Usage(3, 1)),
            {
                "message": "the generation was cancelled (shutdown)",
                "type": "server_error",
                "param": None,
                "code": "cancelled",
            },
        ),
        (
            Error("g", "prompt_too_long", "4000 tokens > 2048"),
            {
                "message": "4000 tokens > 2048",
                "type": "invalid_request_error",
                "param": None,
                "code": "prompt_too_long",
            },
        ),
    ],
)
async def test_chat_stream_ending_without_finishing_sends_an_error_then_done(
    final: Cancelled | Error, error: dict[str, object]
) -> None:
    sent = await written(chat_stream(STARTED, HELLO[0], final, include_usage=True))
    assert sent == [
        chat_chunk("smol", {"role": "assistant", "content": "Hel"}, None),
        data({"error": error}),
        DONE,
    ]


def test_failure_frames_spell_an_overload_as_a_rate_limit_error() -> None:
    assert (
        openai._failure_frames(Overloaded("too many", retry_after_s=2))
        == data(
            {
                "error": {
                    "message": "too many",
                    "type": "rate_limit_error",
                    "param": None,
                    "code": "overloaded",
                }
            }
        )
        + DONE
    )


def collected(model: str = "smol", logprobs: list[float | None] | None = None) -> Collected:
    lps = logprobs or [None, None]
    pieces = [TokenPiece(10, "Hel", lps[0]), TokenPiece(11, "lo", lps[1])]
    return Collected(model, 3, "Hello", pieces, DONE_STOP)


def test_chat_completion_body_whole() -> None:
    body = openai.chat_completion_body("chatcmpl-g", CREATED, "asked-for", collected(), False)
    assert msgspec.json.encode(body) == compact(
        {
            "id": "chatcmpl-g",
            "object": "chat.completion",
            "created": CREATED,
            "model": "smol",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello"},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }
    )


def test_chat_completion_body_with_logprobs_and_the_asked_for_model_as_fallback() -> None:
    whole = collected(model="", logprobs=[-0.5, -0.25])
    body = openai.chat_completion_body("chatcmpl-g", CREATED, "asked-for", whole, True)
    assert body.model == "asked-for"
    assert msgspec.json.encode(body.choices[0].logprobs) == compact(
        {
            "content": [
                {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108], "top_logprobs": []},
                {"token": "lo", "logprob": -0.25, "bytes": [108, 111], "top_logprobs": []},
            ]
        }
    )
    with pytest.raises(BadEngineOutput):
        openai.chat_completion_body("chatcmpl-g", CREATED, "m", collected(), True)


# --- OpenAI (legacy) completions ------------------------------------------------------


def completion_chunk(text: str, finish: str | None, logprobs: Any = None) -> bytes:
    return data(
        {
            "id": "cmpl-g",
            "object": "text_completion",
            "created": CREATED,
            "model": "smol",
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
            "usage": None,
        }
    )


async def test_completion_stream_with_running_logprob_offsets_and_usage() -> None:
    chunks = openai.CompletionChunks("cmpl-g", CREATED, True)
    events = Items(
        STARTED, tok("Hel", 1, [10], [-0.5]), tok("lo!", 3, [11, 12], [-0.25, -2.0]), DONE_STOP
    )
    sent = await written(openai._stream(events, chunks.chunk, chunks.usage, "x"))
    usage = {
        "id": "cmpl-g",
        "object": "text_completion",
        "created": CREATED,
        "model": "smol",
        "choices": [],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    assert sent == [
        completion_chunk(
            "Hel",
            None,
            {"tokens": ["Hel"], "token_logprobs": [-0.5], "top_logprobs": None, "text_offset": [0]},
        ),
        completion_chunk(
            "lo!",
            None,
            {
                "tokens": ["lo!", ""],
                "token_logprobs": [-0.25, -2.0],
                "top_logprobs": None,
                "text_offset": [3, 6],
            },
        ),
        completion_chunk("", "stop"),
        data(usage),
        DONE,
    ]


async def test_completion_stream_without_logprobs_or_usage() -> None:
    chunks = openai.CompletionChunks("cmpl-g", CREATED, False)
    sent = await written(openai._stream(Items(STARTED, *HELLO, DONE_STOP), chunks.chunk, None, "x"))
    assert sent == [
        completion_chunk("Hel", None),
        completion_chunk("lo", None),
        completion_chunk("", "stop"),
        DONE,
    ]


def test_completion_body_whole_with_logprobs() -> None:
    body = openai.completion_body("cmpl-g", CREATED, "x", collected(logprobs=[-0.5, -0.25]), True)
    assert msgspec.json.encode(body) == compact(
        {
            "id": "cmpl-g",
            "object": "text_completion",
            "created": CREATED,
            "model": "smol",
            "choices": [
                {
                    "index": 0,
                    "text": "Hello",
                    "logprobs": {
                        "tokens": ["Hel", "lo"],
                        "token_logprobs": [-0.5, -0.25],
                        "top_logprobs": None,
                        "text_offset": [0, 3],
                    },
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }
    )


# --- TGI ------------------------------------------------------------------------------


def tgi_request(**parameters: Any) -> tgi.GenerateRequest:
    return tgi.GenerateRequest("Say", tgi.Parameters(**parameters), stream=True)


def tgi_token(token_id: int, text: str, logprob: float) -> dict[str, object]:
    return {"id": token_id, "text": text, "logprob": logprob, "special": False}


def tgi_event(
    index: int, token: dict[str, object], text: str | None = None, details: Any = None
) -> bytes:
    return data(
        {
            "index": index,
            "token": token,
            "generated_text": text,
            "details": details,
            "top_tokens": None,
        }
    )


async def test_tgi_stream_holds_each_token_until_it_knows_whether_it_is_the_last() -> None:
    sent = await written(
        tgi._events(
            Items(STARTED, HELLO[0], Heartbeat(), HELLO[1], DONE_STOP),
            tgi_request(seed=7, return_full_text=True),
        )
    )
    details = {"finish_reason": "eos_token", "generated_tokens": 2, "input_length": 3, "seed": 7}
    assert sent == [
        KEEP_ALIVE,
        tgi_event(1, tgi_token(10, "Hel", -0.5)),
        tgi_event(2, tgi_token(11, "lo", -0.25), "SayHello", details),
    ]


@pytest.mark.parametrize(
    ("engine_reason", "stop", "tgi_reason"),
    [("stop", None, "eos_token"), ("stop", ["\n"], "stop_sequence"), ("length", ["x"], "length")],
)
async def test_tgi_finish_reasons(
    engine_reason: str, stop: list[str] | None, tgi_reason: str
) -> None:
    done = Done("g", engine_reason, Usage(3, 1))
    sent = await written(tgi._events(Items(STARTED, HELLO[0], done), tgi_request(stop=stop)))
    details = {"finish_reason": tgi_reason, "generated_tokens": 1, "input_length": 3, "seed": None}
    assert sent == [tgi_event(1, tgi_token(10, "Hel", -0.5), "Hel", details)]


async def test_tgi_stream_of_a_generation_without_tokens_is_an_error() -> None:
    sent = await written(tgi._events(Items(STARTED, DONE_STOP), tgi_request()))
    assert sent == [
        data({"error": "the engine produced no tokens", "error_type": "incomplete_generation"})
    ]


async def test_tgi_stream_that_fails_flushes_the_held_token_then_the_error() -> None:
    failed = Error("g", "engine_failed", "out of memory")
    sent = await written(tgi._events(Items(STARTED, *HELLO, failed), tgi_request()))
    assert sent == [
        tgi_event(1, tgi_token(10, "Hel", -0.5)),
        tgi_event(2, tgi_token(11, "lo", -0.25)),
        data({"error": "out of memory", "error_type": "generation"}),
    ]


def test_tgi_generated_whole_with_and_without_details() -> None:
    whole = collected(logprobs=[-0.5, -0.25])
    plain = tgi._generated(whole, tgi.GenerateRequest("Say"))
    assert msgspec.json.encode(plain) == compact({"generated_text": "Hello"})
    request = tgi.GenerateRequest(
        "Say", tgi.Parameters(details=True, return_full_text=True, stop=["."], seed=1)
    )
    assert msgspec.json.encode(tgi._generated(whole, request)) == compact(
        {
            "generated_text": "SayHello",
            "details": {
                "finish_reason": "stop_sequence",
                "generated_tokens": 2,
                "seed": 1,
                "prefill": [],
                "tokens": [tgi_token(10, "Hel", -0.5), tgi_token(11, "lo", -0.25)],
            },
        }
    )
    with pytest.raises(BadEngineOutput):
        tgi._generated(collected(), request)


# --- Open Inference Protocol ----------------------------------------------------------


async def test_oip_stream_one_event_per_step_then_the_finish_reason() -> None:
    sent = await written(oip._events(Items(STARTED, HELLO[0], Heartbeat(), DONE_STOP), "m", "r1"))
    assert sent == [
        data({"model_name": "smol", "text_output": "Hel", "id": "r1"}),
        KEEP_ALIVE,
        data({"model_name": "smol", "text_output": "", "finish_reason": "stop", "id": "r1"}),
    ]


async def test_oip_stream_without_request_id_or_started_uses_the_path_model() -> None:
    sent = await written(oip._events(Items(HELLO[0], DONE_STOP), "from-path", None))
    assert sent == [
        data({"model_name": "from-path", "text_output": "Hel"}),
        data({"model_name": "from-path", "text_output": "", "finish_reason": "stop"}),
    ]


async def test_oip_stream_ending_without_finishing_sends_the_protocols_error() -> None:
    sent = await written(
        oip._events(Items(STARTED, Cancelled("g", "user", Usage(3, 0))), "m", None)
    )
    assert sent == [data({"error": "the generation was cancelled (user)"})]
