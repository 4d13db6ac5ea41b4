"""The OpenAI adapter's wire output, built from contract events in this process: chat and
(legacy) completion stream chunks and whole answers (gateway/apis/openai/chunks.py), byte for
byte."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from gateway.apis.openai import chunks as openai
from gateway.core.errors import BadEngineOutput, Overloaded, ending_with_error
from gateway.core.walk import GenerationItem, Heartbeat, walk
from tests.support.adapter_events import (
    CREATED,
    DONE,
    DONE_STOP,
    HELLO,
    KEEP_ALIVE,
    STARTED,
    Indexed,
    collected,
    compact,
    data,
    tok,
    written,
)
from wire import Cancelled, Done, Error, Usage

# OpenAI chat completions


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
    stream = openai.ChunkStream(chunks, "asked-for", include_usage=include_usage)
    return walk(Indexed(*events), stream)


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
    sent = await written(ending_with_error(chunks, openai.failure_frames))
    error = {
        "message": "logprobs were requested from the engine but it sent none",
        "type": "server_error",
        "param": None,
        "code": "bad_engine_output",
    }
    assert sent == [data({"error": error}), DONE]


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
        openai.failure_frames(Overloaded("too many", retry_after_s=2))
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


def test_chat_completion_body_whole() -> None:
    body = openai.chat_completion_body("chatcmpl-g", CREATED, "asked-for", [collected()], False)
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
    body = openai.chat_completion_body("chatcmpl-g", CREATED, "asked-for", [whole], True)
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
        openai.chat_completion_body("chatcmpl-g", CREATED, "m", [collected()], True)


# OpenAI (legacy) completions


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
    events = Indexed(
        STARTED, tok("Hel", 1, [10], [-0.5]), tok("lo!", 3, [11, 12], [-0.25, -2.0]), DONE_STOP
    )
    sent = await written(walk(events, openai.ChunkStream(chunks, "x", include_usage=True)))
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
    sent = await written(walk(Indexed(STARTED, *HELLO, DONE_STOP), openai.ChunkStream(chunks, "x")))
    assert sent == [
        completion_chunk("Hel", None),
        completion_chunk("lo", None),
        completion_chunk("", "stop"),
        DONE,
    ]


def test_completion_body_whole_with_logprobs() -> None:
    body = openai.completion_body("cmpl-g", CREATED, "x", [collected(logprobs=[-0.5, -0.25])], True)
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
