"""The TGI adapter's wire output, built from contract events in this process: stream events
and the whole ``generate`` answer (gateway/apis/tgi.py), byte for byte."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gateway.apis import tgi
from gateway.core.errors import BadEngineOutput
from gateway.core.walk import Heartbeat, walk
from tests.support.adapter_events import (
    DONE_STOP,
    HELLO,
    KEEP_ALIVE,
    STARTED,
    Indexed,
    collected,
    compact,
    data,
    written,
)
from wire import Done, Error, Usage


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
        walk(
            Indexed(STARTED, HELLO[0], Heartbeat(), HELLO[1], DONE_STOP),
            tgi.TgiStream(tgi_request(seed=7, return_full_text=True)),
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
    stream = tgi.TgiStream(tgi_request(stop=stop))
    sent = await written(walk(Indexed(STARTED, HELLO[0], done), stream))
    details = {"finish_reason": tgi_reason, "generated_tokens": 1, "input_length": 3, "seed": None}
    assert sent == [tgi_event(1, tgi_token(10, "Hel", -0.5), "Hel", details)]


async def test_tgi_stream_of_a_generation_without_tokens_is_an_error() -> None:
    sent = await written(walk(Indexed(STARTED, DONE_STOP), tgi.TgiStream(tgi_request())))
    assert sent == [
        data({"error": "the engine produced no tokens", "error_type": "incomplete_generation"})
    ]


async def test_tgi_stream_that_fails_flushes_the_held_token_then_the_error() -> None:
    failed = Error("g", "engine_failed", "out of memory")
    sent = await written(walk(Indexed(STARTED, *HELLO, failed), tgi.TgiStream(tgi_request())))
    assert sent == [
        tgi_event(1, tgi_token(10, "Hel", -0.5)),
        tgi_event(2, tgi_token(11, "lo", -0.25)),
        data({"error": "out of memory", "error_type": "generation"}),
    ]


def test_tgi_generated_whole_with_and_without_details() -> None:
    whole = collected(logprobs=[-0.5, -0.25])
    plain = tgi.generated(whole, tgi.GenerateRequest("Say"))
    assert msgspec.json.encode(plain) == compact({"generated_text": "Hello"})
    request = tgi.GenerateRequest(
        "Say", tgi.Parameters(details=True, return_full_text=True, stop=["."], seed=1)
    )
    assert msgspec.json.encode(tgi.generated(whole, request)) == compact(
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
        tgi.generated(collected(), request)
