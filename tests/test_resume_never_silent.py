"""A resume point never leaves a client waiting in silence.

A ``Last-Event-ID`` past the last id a session's stream ever made (Redis lost the events
after it, or an id from nowhere) used to get 200 and then nothing for ever: every later
event sorts before it. Now each transport says so at once: the SSE stream an
``events_lost`` event (then the session from its beginning), the WebSocket an
``events_lost`` frame (then the generation from its first frame), the Responses API a 410
``events_lost``. Real Redis restarted for real, real gateway processes, clients that
reconnect as a browser's ``EventSource`` does (tests/support/eventsource.py, each on its own
connection), the OpenAI SDK and a WebSocket client.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import openai
import pytest

from stack.redis_server import EmbeddedRedis
from tests.support.eventsource import EventSource, Received
from tests.support.http import Session, create_session, read_events, send
from tests.support.oracle import synthetic_text
from tests.support.stack import Stack
from tests.support.ws import open_ws

pytestmark = pytest.mark.timeout(240)

CLIENTS = 50
CLEAR_WITHIN_S = 2.0
"""How soon a client must get a clear answer: from its (re)connection, or from Redis being
back for a stream that stayed open."""


def is_clear(event: Received) -> bool:
    """An answer a client can act on: ``events_lost``, or an ``error`` that carries a code
    (a generation's, or the stream's own ``{"error": {...}}``)."""
    if event.event == "events_lost":
        return True
    if event.event != "error":
        return False
    data = event.json()
    return bool(data.get("code") or (data.get("error") or {}).get("code"))


@contextlib.asynccontextmanager
async def following(sources: list[EventSource]) -> AsyncIterator[None]:
    """The sources run (connect, read, reconnect) inside the block, and are stopped at its end."""
    tasks = [asyncio.create_task(source.run()) for source in sources]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)
    assert condition(), what


def source_of(session: Session) -> EventSource:
    """What a page does: ``new EventSource(events_url + "?token=...")``."""
    return EventSource(f"{session.events_url}?token={session.token}")


@contextlib.asynccontextmanager
async def readers(
    stack: Stack, tokens_per_s: float, max_tokens: Callable[[int], int]
) -> AsyncIterator[tuple[list[Session], list[EventSource]]]:
    """``CLIENTS`` sessions, each with a reply (``max_tokens(index)`` long) and an
    EventSource client that follows it; yielded once each client has had three events."""
    stack.synthetic(tokens_per_s=tokens_per_s)
    gateway = stack.gateway()
    async with httpx.AsyncClient(timeout=30) as client:
        sessions = [await create_session(client, gateway.url) for _ in range(CLIENTS)]
        for index, session in enumerate(sessions):
            await send(client, session, f"reply {index}", max_tokens=max_tokens(index))
        sources = [source_of(session) for session in sessions]
        async with following(sources):
            await until(lambda: all(len(source.events) >= 3 for source in sources), 60, "read")
            yield sessions, sources


async def test_redis_restarted_without_its_data_gives_every_eventsource_a_clear_answer(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """50 connected EventSource clients, Redis killed and started again empty: each open
    stream ends with ``session_lost`` within 2 s of Redis being back, and each client's
    reconnection (with its Last-Event-ID) is answered 404 ``unknown_session`` within 2 s,
    so none waits on a stream that will never speak."""
    stack = Stack(restartable_redis.url, "wiped", tmp_path)
    try:
        # Every other reply still runs (200 tokens at 5/s), the others (3 tokens) ended.
        async with readers(stack, 5, lambda index: 3 if index % 2 else 200) as (sessions, sources):
            for session in sessions:
                await stack.wait_live_readers(session.session_id)
            killed = time.monotonic()
            restartable_redis.kill(wipe=True)
            restartable_redis.start()
            back = time.monotonic()
            await until(lambda: all(s.failure for s in sources), 60, "every source ended")
        told, answered = [], []
        for source in sources:
            assert source.failure is not None
            assert (source.failure.status, source.failure.code) == (404, "unknown_session")
            lost = [event for event in source.after(killed) if is_clear(event)]
            assert lost and lost[0].json()["error"]["code"] == "session_lost", source.events
            told.append(max(0.0, lost[0].at - back))
            reconnected = [at for at in source.connects if at >= killed]
            assert reconnected and source.last_event_id, "it reconnects with Last-Event-ID"
            answered.append(source.failure.at - reconnected[-1])
        print(
            f"\n{CLIENTS} EventSource clients, Redis back empty: session_lost after "
            f"{statistics.median(told):.2f} s median (max {max(told):.2f}), their reconnection "
            f"answered 404 after {statistics.median(answered) * 1000:.0f} ms median "
            f"(max {max(answered) * 1000:.0f})"
        )
        assert max(told) <= CLEAR_WITHIN_S and max(answered) <= CLEAR_WITHIN_S
    finally:
        stack.stop()


async def test_redis_restarted_with_its_data_every_eventsource_reads_on_whole(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """The same 50 clients, Redis stopped and started again with its data (nothing lost):
    no ``events_lost`` and no error; every reply arrives whole, in order, without a repeat."""
    stack = Stack(restartable_redis.url, "kept", tmp_path)

    def ended(source: EventSource) -> bool:
        return any(event.event == "done" for event in source.events)

    try:
        async with readers(stack, 20, lambda _: 60) as (_, sources):
            restartable_redis.stop()  # SIGTERM: the AOF is written whole
            restartable_redis.start()
            await until(lambda: all(map(ended, sources)), 120, "every reply ended")
        for index, source in enumerate(sources):
            assert source.failure is None
            assert not [event for event in source.events if is_clear(event)], source.events
            ids = [event.last_event_id for event in source.events]
            keys = [tuple(map(int, event_id.split("-"))) for event_id in ids]
            assert keys == sorted(set(keys)), "in order, no repeat"
            text = "".join(e.json()["text"] for e in source.events if e.event == "token")
            assert text == synthetic_text(f"reply {index}", 60)
    finally:
        stack.stop()


async def test_an_id_from_the_future_gets_events_lost_then_the_session_from_its_start(
    stack: Stack,
) -> None:
    """An id ahead of the stream (here an hour ahead; Redis losing its last events makes
    the same): ``events_lost`` at once, its empty ``id:`` clears the client's Last-Event-ID,
    the session's events follow from its first, and a new message's reply reaches it."""
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        first = await send(client, session, "before", max_tokens=4)
        earlier = await read_events(client, session, until_final_of=first)
        future = f"{int(time.time() * 1000) + 3_600_000}-0"
        header = EventSource(f"{session.events_url}?token={session.token}", future)
        query = EventSource(f"{session.events_url}?token={session.token}&last_event_id={future}")
        async with following([header, query]):
            for source in (header, query):
                await until(lambda s=source: len(s.events) >= 1 + len(earlier.events), 10, "told")
                lost, *replayed = source.events
                assert lost.event == "events_lost" and lost.last_event_id == ""
                assert lost.at - source.connects[0] <= CLEAR_WITHIN_S
                assert lost.json()["last_event_id"] == future
                assert "ahead of this stream" in lost.json()["message"]
                assert [e.last_event_id for e in replayed] == [e.id for e in earlier.events]
            second = await send(client, session, "after", max_tokens=4)
            for source in (header, query):
                await until(
                    lambda s=source: any(
                        e.event == "done" and e.json()["generation_id"] == second for e in s.events
                    ),
                    10,
                    "the next reply arrives",
                )
                assert len(source.connects) == 1 and source.failure is None


async def test_a_websocket_resume_goes_on_from_its_event_id_on_another_replica_or_says_events_lost(
    stack: Stack,
) -> None:
    """``resume`` on another gateway: the frames after the client's last one, with no gap
    or repeat; after the final frame, only the ack; an id ahead of the stream gets an
    ``events_lost`` frame and the generation from its first frame; bad ids and unknown
    generations are refused naming the field."""
    stack.synthetic(tokens_per_s=40)
    first, second = stack.gateway(), stack.gateway()
    ws = await open_ws(first.url)
    try:
        ack = await ws.generate("q", "across replicas", max_tokens=30)
        await ws.until(lambda f: f.get("id") == "q" and f["type"] == "token" and f["count"] >= 3)
    finally:
        await ws.conn.close()
    seen = ws.tokens("q")
    session_id, gid, token = ack["session_id"], ack["generation_id"], ack["token"]
    resume = {"session_id": session_id, "generation_id": gid, "token": token}
    other = await open_ws(second.url)
    try:
        await other.send(type="resume", id="r", last_event_id=seen[-1]["event_id"], **resume)
        final = await other.final_of("r")
        assert final["type"] == "done"
        text = ws.text("q") + other.text("r")
        assert text == synthetic_text("across replicas", 30)
        acks = [f for f in other.frames["r"] if f["type"] == "ack"]
        assert [(f["op"], f["generation_id"], f["session_id"]) for f in acks] == [
            ("resume", gid, session_id)
        ]

        await other.send(type="resume", id="after", last_event_id=final["event_id"], **resume)
        assert (await other.recv())["state"] == "done"
        await other.send(type="ping", id="p")
        assert await other.recv() == {"type": "pong", "id": "p"}  # nothing came between

        ahead = f"{int(time.time() * 1000) + 3_600_000}-0"
        await other.send(type="resume", id="ahead", last_event_id=ahead, **resume)
        await other.final_of("ahead")
        # The ack and the generation's frames travel apart: either may come first.
        frames = [f for f in other.frames["ahead"] if f["type"] != "ack"]
        kinds = [f["type"] for f in frames]
        assert kinds[:3] == ["events_lost", "queued", "started"], kinds
        assert frames[0]["last_event_id"] == ahead
        assert other.text("ahead") == synthetic_text("across replicas", 30)

        await other.send(type="resume", id="bad", last_event_id="yesterday", **resume)
        bad = await other.recv()
        assert (bad["code"], bad["field"]) == ("bad_event_id", "last_event_id")
        assert "<milliseconds>-<sequence>" in bad["message"]
        await other.send(type="resume", id="nope", **{**resume, "generation_id": "g_nope"})
        nope = await other.recv()
        assert (nope["code"], nope["field"]) == ("unknown_generation", "generation_id")
    finally:
        await other.conn.close()


async def test_starting_after_past_a_responses_end_is_a_clear_error(stack: Stack) -> None:
    """``starting_after`` past an ended response's last event is a 410 ``events_lost``
    naming the parameter and the last number; at its last event the stream simply ends;
    past the events a running response has made so far, the stream waits for them."""
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0)
    async with client:
        response = await client.responses.create(
            model="synthetic", input="count me", max_output_tokens=4
        )
        events = [e async for e in await client.responses.retrieve(response.id, stream=True)]
        last = events[-1].sequence_number
        assert events[-1].type == "response.incomplete"
        tail = await client.responses.retrieve(response.id, stream=True, starting_after=last)
        assert [e async for e in tail] == []
        with pytest.raises(openai.APIStatusError) as refused:
            await client.responses.retrieve(response.id, stream=True, starting_after=last + 1)
        assert refused.value.status_code == 410
        error = refused.value.body
        assert isinstance(error, dict)
        assert (error["code"], error["param"]) == ("events_lost", "starting_after")
        assert f"its last event is {last}" in error["message"]

        running = await client.responses.create(
            model="synthetic", input="count me again", max_output_tokens=60, background=True
        )
        early = await client.responses.retrieve(running.id, stream=True, starting_after=5)
        numbers = [event.sequence_number async for event in early]
        assert numbers[0] == 6 and numbers == list(range(6, 6 + len(numbers)))
