"""The session API over a real gateway process, real Redis and the synthetic engine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from tests.support.http import all_of, create_session, read_events, send
from tests.support.oracle import synthetic_text
from tests.support.sse import SSEParser, parse
from tests.support.stack import Stack
from tests.support.tokens import assert_gap_free_tokens
from tests.support.ws import open_ws

pytestmark = pytest.mark.timeout(120)


async def test_a_reply_streams_token_by_token_and_the_second_turn_sees_the_first(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=100)
    gateway = stack.gateway()
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        first = await send(client, session, "hello there", max_tokens=8)
        reading = await read_events(client, session, until_final_of=first)
        kinds = [e.event for e in reading.of(first)]
        assert kinds[:2] == ["queued", "started"] and kinds[-1] == "done"
        assert set(kinds[2:-1]) == {"token"}, kinds
        assert reading.text(first) == synthetic_text("hello there", 8)
        tokens = [e.json() for e in reading.of(first) if e.event == "token"]
        assert assert_gap_free_tokens(tokens) == 8
        done = reading.final(first).json()
        assert done["finish_reason"] == "length"
        assert done["usage"]["completion_tokens"] == 8
        ids = [e.id for e in reading.events]
        assert all(ids) and ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
        assert reading.parser.retry == 1000

        second = await send(client, session, "and again", max_tokens=3)
        reading = await read_events(client, session, until_final_of=second, last_event_id=ids[-1])
        assert [e.json()["generation_id"] for e in reading.events] == [second] * 6
        started = next(e.json() for e in reading.events if e.event == "started")
        # The prompt of turn two holds turn one: both user messages and the reply.
        assert started["prompt_tokens"] == len(["hello", "there"]) + 8 + 2

        history = await client.get(
            f"{gateway.url}/v1/sessions/{session.session_id}", params={"token": session.token}
        )
        assert history.status_code == 200
        assert [(m["role"], m["content"]) for m in history.json()["messages"]] == [
            ("user", "hello there"),
            ("assistant", synthetic_text("hello there", 8)),
            ("user", "and again"),
            ("assistant", synthetic_text("and again", 3)),
        ]


async def test_resume_from_any_event_id_replays_exactly_what_follows(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        generation = await send(client, session, "resume me please", max_tokens=20)
        full = await read_events(client, session, until_final_of=generation)
        ids = [e.id for e in full.events]
        for cut in (0, 1, 5, 13, len(ids) - 2):
            for as_query in (False, True):  # Last-Event-ID header, ?last_event_id=
                resumed = await read_events(
                    client,
                    session,
                    until_final_of=generation,
                    last_event_id=ids[cut],
                    as_query=as_query,
                )
                assert [e.id for e in resumed.events] == ids[cut + 1 :]
        # resuming after the final event: nothing old comes back, new events do
        later = await send(client, session, "later", max_tokens=2)
        resumed = await read_events(client, session, until_final_of=later, last_event_id=ids[-1])
        assert {e.json()["generation_id"] for e in resumed.events} == {later}


async def test_until_ends_the_stream_after_one_reply(stack: Stack) -> None:
    """``?until=<generation_id>``: the stream ends after that generation's final event
    (the README's ``curl -N`` returns); at once when the resume point is past it; 404 for
    a generation the session does not have."""
    stack.synthetic(tokens_per_s=100)
    gateway = stack.gateway()
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        first = await send(client, session, "one reply", max_tokens=5)

        async def whole(**params: str) -> list[str]:
            url, headers = session.events_url, session.headers
            async with client.stream("GET", url, params=params, headers=headers) as response:
                assert response.status_code == 200, await response.aread()
                return [f"{e.event} {e.id}" async for e in parse(response.aiter_lines())]

        ended = await asyncio.wait_for(whole(until=first), 20)  # ends by itself
        assert [line.split()[0] for line in ended] == ["queued", "started", *["token"] * 5, "done"]
        last = ended[-1].split()[1]
        second = await send(client, session, "another", max_tokens=2)
        # After the first's end, until=first ends at once; until=second gets its events.
        assert await asyncio.wait_for(whole(until=first, last_event_id=last), 5) == []
        following = await asyncio.wait_for(whole(until=second, last_event_id=last), 20)
        assert [line.split()[0] for line in following][-1] == "done"
        unknown = await client.get(
            session.events_url, params={"until": "g_nobody"}, headers=session.headers
        )
        assert (
            unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_generation"
        )


async def test_a_stream_started_on_one_gateway_resumes_on_another(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=50)
    first, second = stack.gateway(), stack.gateway()
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, first.url)
        generation = await send(client, session, "two gateways", max_tokens=30)
        part = await read_events(client, session, limit=8)
        assert part.events[-1].event == "token"
        moved = type(session)(second.url, session.session_id, session.token)
        rest = await read_events(
            client, moved, until_final_of=generation, last_event_id=part.events[-1].id
        )
        text = part.text(generation) + rest.text(generation)
        assert text == synthetic_text("two gateways", 30)
        assert not {e.id for e in part.events} & {e.id for e in rest.events}


async def test_a_hundred_concurrent_sessions_each_get_exactly_their_own_tokens(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=100)
    gateway = stack.gateway()
    limits = httpx.Limits(max_connections=250)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def one(index: int) -> None:
            session = await create_session(client, gateway.url)
            content = f"session number {index}"
            generation = await send(client, session, content, max_tokens=12)
            reading = await read_events(client, session, until_final_of=generation)
            assert {e.json()["generation_id"] for e in reading.events} == {generation}
            assert reading.text(generation) == synthetic_text(content, 12)

        await all_of(*(one(i) for i in range(100)))


async def test_with_no_worker_a_message_waits_queued_and_is_served_when_one_comes(
    stack: Stack,
) -> None:
    """At start-up (no worker registered yet) a message for the configured default model
    waits in its queue; with no default configured, the gateway cannot know which queue."""
    gateway = stack.gateway(TOKENSPOUT_DEFAULT_MODEL="synthetic")
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        ready = await client.get(f"{gateway.url}/ready")
        assert ready.status_code == 503 and ready.json()["ready"] is False
        generation = await send(client, session, "anyone there", max_tokens=4)
        unconfigured = stack.gateway()
        refused = await client.post(
            f"{unconfigured.url}/v1/completions", json={"model": "x", "prompt": "hi"}
        )
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_worker"
        assert int(refused.headers["retry-after"]) > 0
        queued = await read_events(client, session, limit=1)
        assert queued.events[0].event == "queued"
        stack.synthetic()
        reading = await read_events(client, session, until_final_of=generation)
        assert reading.final(generation).event == "done"
        assert (await client.get(f"{gateway.url}/ready")).status_code == 200


async def test_a_retried_post_with_the_same_idempotency_key_returns_the_same_generation(
    stack: Stack,
) -> None:
    """Also when the gateway is full: a retry takes no new capacity, so it is no 429."""
    stack.synthetic(tokens_per_s=10)  # 10 s: it runs through every POST below
    gateway = stack.gateway(TOKENSPOUT_MAX_INFLIGHT="2")
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        url = f"{gateway.url}/v1/sessions/{session.session_id}/messages"

        async def post(key: str, content: str = "only once", **headers: str) -> httpx.Response:
            return await client.post(
                url,
                json={"content": content, "max_tokens": 100},
                headers={**session.headers, "Idempotency-Key": key, **headers},
            )

        first = await post("key-1")
        assert first.status_code == 202, first.text
        assert first.json()["duplicate"] is False
        generation = first.json()["generation_id"]
        # Running, as every POST below means to find it: a retry while it still waits for a
        # worker queues a second copy (it may be lost on its way), which takes room until a
        # worker drops it, and "a different message" would then find the gateway full.
        await read_events(client, session, until_event="started")
        again = await post("key-1", content="the retry's body does not matter")
        assert again.status_code == 202, again.text
        assert again.json()["generation_id"] == generation
        assert again.json()["duplicate"] is True
        other = await post("key-2", content="a different message")
        assert other.status_code == 409, other.text
        assert other.json()["error"]["code"] == "generation_running"
        stranger = await post("key-1", **{"X-Session-Token": "wrong"})
        assert stranger.status_code == 403

        # Fill the gateway (2 in flight): a new generation gets 429, the retry still 202.
        bystander = await create_session(client, gateway.url)
        await send(client, bystander, "filling the last slot", max_tokens=100)
        third = await create_session(client, gateway.url)
        full = await client.post(
            f"{gateway.url}/v1/sessions/{third.session_id}/messages",
            json={"content": "no room"},
            headers=third.headers,
        )
        assert full.status_code == 429, full.text
        retried = await post("key-1")
        assert retried.status_code == 202, retried.text
        assert retried.json() == again.json()

        reading = await read_events(client, session, until_final_of=generation)
        assert {e.json()["generation_id"] for e in reading.events} == {generation}
        assert [e.event for e in reading.events].count("queued") == 1
        assert reading.text(generation) == synthetic_text("only once", 100)
        history = await client.get(url.removesuffix("/messages"), headers=session.headers)
        assert [m["role"] for m in history.json()["messages"]] == ["user", "assistant"]


async def test_an_idle_session_stream_carries_heartbeats_and_a_queued_event_uncompressed(
    stack: Stack,
) -> None:
    """No worker runs: the stream says the message is queued and keeps itself alive."""
    gateway = stack.gateway(TOKENSPOUT_SSE_HEARTBEAT_S="0.2", TOKENSPOUT_DEFAULT_MODEL="synthetic")
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        parser, events = SSEParser(), []

        async def consume(response: httpx.Response) -> None:
            async for event in parse(response.aiter_lines(), parser):
                events.append(event)

        headers = {**session.headers, "Accept-Encoding": "gzip, deflate, br"}
        async with client.stream("GET", session.events_url, headers=headers) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["x-accel-buffering"] == "no"
            assert response.headers["cache-control"] == "no-cache"
            assert "content-encoding" not in response.headers
            reader = asyncio.create_task(consume(response))

            async def until(condition: Callable[[], bool]) -> None:
                async with asyncio.timeout(10):
                    while not condition():
                        await asyncio.sleep(0.02)

            try:
                await until(lambda: parser.comments >= 3)  # heartbeats, 0.2 s apart, and
                assert events == []  # nothing else while nothing happens
                generation = await send(client, session, "is anyone there", max_tokens=4)
                await until(lambda: bool(events))
                before = parser.comments
                await until(lambda: parser.comments >= before + 2)  # and on after an event
            finally:
                reader.cancel()
                await asyncio.wait({reader})
        assert [(e.event, e.json()["generation_id"]) for e in events] == [("queued", generation)]
        assert events[0].id is not None


async def test_vllms_min_tokens_and_ignore_eos_hold_over_http_and_websocket(stack: Stack) -> None:
    """A session message and a WebSocket ``generate`` take vLLM's ``min_tokens`` (no stop
    before it) and ``ignore_eos``; a ``min_tokens`` past ``max_tokens`` is a 422 naming it."""
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    full = synthetic_text("hi", 20)  # "lazy" is its 8th token
    stopped = full[: full.index("lazy")]
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        first = await send(client, session, "hi", max_tokens=20, stop=["lazy"])
        reading = await read_events(client, session, until_final_of=first)
        assert reading.text(first) == stopped
        later = await send(
            client, session, "hi", max_tokens=20, stop=["lazy"], min_tokens=9, ignore_eos=True
        )
        reading = await read_events(
            client, session, until_final_of=later, last_event_id=reading.events[-1].id
        )
        assert reading.text(later) == full
        assert reading.final(later).json()["usage"]["completion_tokens"] == 20
        for wrong in (21, -1):
            response = await client.post(
                f"{gateway.url}/v1/sessions/{session.session_id}/messages",
                json={"content": "hi", "max_tokens": 20, "min_tokens": wrong},
                headers=session.headers,
            )
            assert response.status_code == 422, response.text
            assert response.json()["error"]["field"] == "min_tokens", response.text

    ws = await open_ws(gateway.url)
    try:
        ack = await ws.generate("a", "hi", max_tokens=20, stop=["lazy"], min_tokens=9)
        assert ack["type"] == "ack", ack
        assert (await ws.final_of("a"))["type"] == "done"
        assert ws.text("a") == full
        refused = await ws.generate("b", "hi", max_tokens=20, min_tokens=21)
        assert (refused["type"], refused["field"]) == ("error", "min_tokens"), refused
    finally:
        await ws.conn.close()
