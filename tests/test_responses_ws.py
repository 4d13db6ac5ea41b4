"""The Responses API's WebSocket mode (``WS /v1/responses``) with the official ``openai``
SDK's ``responses.connect()``, over real gateway processes, real Redis and the synthetic
engine: several responses on one socket (one lane first in first out, lanes at once), the
events in the SSE stream's order, a response made here resumed over HTTP on another
replica, errors that leave the socket open, and a socket that closes mid-response."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from websockets.exceptions import InvalidStatus

from tests.support.oracle import synthetic_text
from tests.support.responses import check_order, client_of, dumped, ended
from tests.support.stack import Stack

pytestmark = pytest.mark.timeout(180)

FINALS = {"response.completed", "response.incomplete", "response.failed"}


async def _until_finals(connection: Any, count: int) -> list[dict[str, Any]]:
    """Every event (errors included) until ``count`` responses or errors have ended."""
    events: list[dict[str, Any]] = []
    async with asyncio.timeout(60):
        async for event in connection:
            events.append(event.model_dump(exclude_unset=True))
            count -= event.type in FINALS or event.type == "error"
            if count == 0:
                return events
    raise AssertionError(f"the socket closed with {count} responses still running")


def _split_by_response(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Events of a lane, by response: each ``response.created`` opens the next one."""
    split: dict[str, list[dict[str, Any]]] = {}
    current: list[dict[str, Any]] = []
    for event in events:
        if event["type"] == "response.created":
            current = split.setdefault(event["response"]["id"], [])
        current.append(event)
    return split


async def test_responses_on_one_socket_come_in_order_and_resume_over_http_elsewhere(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=200)
    first, second = stack.gateway(), stack.gateway()
    one, other = client_of(first.url), client_of(second.url)
    prompts = [("the first question", 6), ("the second one", 9)]
    try:
        async with one.responses.connect(max_retries=0) as connection:
            for prompt, n in prompts:  # sent at once: the one lane answers them in turn
                await connection.send(
                    {
                        "type": "response.create",
                        "model": "synthetic",
                        "input": prompt,
                        "max_output_tokens": n,
                    }
                )
            events = await _until_finals(connection, 2)
        responses = _split_by_response(events)
        assert len(responses) == 2
        for (rid, own), (prompt, n) in zip(responses.items(), prompts, strict=True):
            check_order(own, "response.incomplete", synthetic_text(prompt, n))
            assert all("stream_id" not in event for event in own)
            # Stored like any response: its stream resumes over HTTP on another replica.
            resumed = await other.responses.retrieve(rid, stream=True, starting_after=3)
            assert dumped([event async for event in resumed]) == own[4:]
        # In turn: the second response was created after the first one ended.
        kinds = [event["type"] for event in events]
        assert kinds.index("response.incomplete") < kinds.index("response.created", 1)
    finally:
        await one.close()
        await other.close()


async def test_lanes_run_at_once_and_each_event_names_its_lane(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=50)
    gateway = stack.gateway()
    client = client_of(gateway.url)
    lanes = {"left": ("a left turn", 10), "right": ("a right turn", 10)}
    try:
        async with client.responses.connect(max_retries=0) as connection:
            for lane, (prompt, n) in lanes.items():
                await connection.send(
                    {
                        "type": "response.create",
                        "model": "synthetic",
                        "input": prompt,
                        "max_output_tokens": n,
                        "stream_id": lane,
                    }
                )
            events = await _until_finals(connection, 2)
    finally:
        await client.close()
    for lane, (prompt, n) in lanes.items():
        own = [event for event in events if event["stream_id"] == lane]
        check_order(own, "response.incomplete", synthetic_text(prompt, n))
    # At once: both were created before either ended.
    kinds = [event["type"] for event in events]
    created = [i for i, kind in enumerate(kinds) if kind == "response.created"]
    assert len(created) == 2 and created[1] < kinds.index("response.incomplete")


async def test_a_bad_frame_gets_an_error_event_and_the_socket_goes_on(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    client = client_of(gateway.url)
    bad: list[tuple[dict[str, Any], str | None, str]] = [
        ({"background": True}, "background", "background is not supported"),
        ({"temperature": "hot"}, None, "Expected `float | null`"),
        ({"max_output_tokens": 0}, None, ">= 1"),
        ({"input": []}, "input", "must not be empty"),
        ({"type": "response.steer"}, "type", "unsupported event type"),
        ({"previous_response_id": "resp_nope"}, None, "resp_nope"),
    ]
    try:
        async with client.responses.connect(max_retries=0) as connection:
            for fields, _, _ in bad:
                frame = {"type": "response.create", "model": "synthetic", "input": "hi", **fields}
                await connection.send(frame)  # type: ignore[arg-type]
            await connection.send(
                {
                    "type": "response.create",
                    "model": "synthetic",
                    "input": "still here",
                    "max_output_tokens": 4,
                    "stream_id": "after",
                }
            )
            events = await _until_finals(connection, len(bad) + 1)
    finally:
        await client.close()
    errors = [event for event in events if event["type"] == "error"]
    assert len(errors) == len(bad), [e["error"]["message"] for e in errors]
    # A frame that cannot be read is answered at once; one that can, when its lane takes
    # it up: so each case is found by its words, not by its place.
    for _, param, words in bad:
        (error,) = [e for e in errors if words in e["error"]["message"]]
        assert error["status"] in (400, 404), error
        assert error["error"]["type"] == "invalid_request_error"
        if param is not None:
            assert error["error"]["param"] == param, error
    fine = [event for event in events if event.get("stream_id") == "after"]
    check_order(fine, "response.incomplete", synthetic_text("still here", 4))


async def test_a_socket_that_closes_mid_response_abandons_it(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=20)
    gateway = stack.gateway(TOKENSPOUT_ABANDON_GRACE_S="1")
    client = client_of(gateway.url)
    prompt, n = "a long walk", 60
    try:
        async with client.responses.connect(max_retries=0) as connection:
            await connection.send(
                {
                    "type": "response.create",
                    "model": "synthetic",
                    "input": prompt,
                    "max_output_tokens": n,
                }
            )
            rid = ""
            async for event in connection:
                if event.type == "response.created":
                    rid = event.response.id
                if event.type == "response.output_text.delta":
                    break
        left = await ended(client, rid)
        assert left.status == "cancelled"
        assert 0 < len(left.output_text) < len(synthetic_text(prompt, n))
    finally:
        await client.close()


def test_the_openai_sdk_reaches_the_socket_with_its_api_key(stack: Stack) -> None:
    """With API keys configured, the SDK's key (its connect request's Authorization
    header) opens the socket; a wrong key is refused before it opens."""
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway(TOKENSPOUT_API_KEYS="sk-right")

    async def ask(key: str) -> list[dict[str, Any]]:
        client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)
        try:
            async with client.responses.connect(max_retries=0) as connection:
                await connection.send(
                    {
                        "type": "response.create",
                        "model": "synthetic",
                        "input": "key",
                        "max_output_tokens": 3,
                    }
                )
                return await _until_finals(connection, 1)
        finally:
            await client.close()

    events = asyncio.run(ask("sk-right"))
    check_order(events, "response.incomplete", synthetic_text("key", 3))
    # Refused before the upgrade: a WebSocket handshake answered 403 (the ASGI server's
    # answer to a socket closed before it was accepted).
    with pytest.raises(InvalidStatus) as refused:
        asyncio.run(ask("sk-wrong"))
    assert refused.value.response.status_code == 403
