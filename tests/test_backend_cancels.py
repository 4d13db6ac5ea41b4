"""One suite, both backends (engine/backends/base.py): every cancel path (REST, WebSocket,
through another gateway, twice, after done, while queued) stops the engine, over real
gateway processes and real Redis, with the synthetic engine and with vLLM on the CPU (the
engine under test: tests/support/engines.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx
import pytest

from tests.support.engines import (
    CANCELS,
    LONG,
    PROMPT,
    STOP_WITHIN_S,
    WASTE,
    EngineUnderTest,
    check_partial_usage,
    nothing_after_the_final,
    rest_cancel,
    still_running,
    story_of,
)
from tests.support.http import Session, all_of, create_session, read_events, send
from tests.support.redis_probes import async_client, stream_events
from tests.support.ws import is_final, open_ws
from wire import CONSUMER_GROUP, Keys

pytestmark = pytest.mark.timeout(900)


async def test_a_rest_cancel_after_the_third_token_stops_the_engine(
    engine: EngineUnderTest,
) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, engine.url)
        gid = await send(client, session, PROMPT, max_tokens=LONG, **engine.sampling)
        reading = await read_events(client, session, limit=5, timeout_s=300)
        assert [e.event for e in reading.events] == ["queued", "started", "token", "token", "token"]
        await still_running(engine, session.session_id, reading)
        waste, cancels = engine.metric(WASTE), engine.metric(CANCELS, unset=0, reason="user")

        sent = time.monotonic()
        answer = await rest_cancel(client, session, gid)
        print(f"\n{engine.backend} REST cancel answered in {time.monotonic() - sent:.3f} s")
        assert answer["state"] == "cancelled", answer
        await read_events(
            client,
            session,
            until_final_of=gid,
            reading=reading,
            last_event_id=reading.events[-1].id,
        )
        await engine.stops(sent, "REST cancel")

        final = reading.final(gid)
        assert reading.events[-1] is final and final.json() == answer["final"]
        check_partial_usage(final.json(), [e.json() for e in reading.of(gid) if e.event == "token"])
        # At most one decode step's worth of tokens made after the worker got the cancel.
        assert engine.metric(WASTE) - waste <= 1
        assert engine.metric(CANCELS, reason="user") == cancels + 1
        await nothing_after_the_final(engine, session.session_id, gid)


async def test_a_websocket_cancel_after_the_third_token_stops_the_engine(
    engine: EngineUnderTest,
) -> None:
    ws = await open_ws(engine.url)
    try:
        ack = await ws.generate("story", PROMPT, max_tokens=LONG, **engine.sampling)
        assert ack["type"] == "ack", ack
        await ws.until(
            lambda f: f.get("id") == "story" and f["type"] == "token" and f["count"] >= 3,
            timeout_s=300,
        )
        await still_running(engine, ack["session_id"])
        waste = engine.metric(WASTE)

        sent = time.monotonic()
        await ws.send(type="cancel", id="story")
        # The ack and the cancelled frame may come in either order.
        cancel_ack = await ws.until(lambda f: f["type"] == "ack" and f.get("op") == "cancel")
        assert cancel_ack["state"] in ("cancelling", "cancelled"), cancel_ack
        final = await ws.final_of("story", timeout_s=60)
        print(f"\n{engine.backend} WebSocket cancelled frame {time.monotonic() - sent:.3f} s on")
        await engine.stops(sent, "WebSocket cancel")
        check_partial_usage(final, ws.tokens("story"))

        await ws.send(type="cancel", id="story")  # twice: the final state again, no error
        again = await ws.until(lambda f: f["type"] == "ack" and f.get("op") == "cancel")
        assert again["state"] == "cancelled", again
        with contextlib.suppress(TimeoutError):  # frames that would follow come by now
            while True:
                await ws.recv(timeout_s=1.0)
        frames = ws.frames["story"]
        assert not [f for f in frames[frames.index(final) + 1 :] if f["type"] != "ack"], frames
        assert sum(is_final(f) for f in frames) == 1
        assert engine.metric(WASTE) - waste <= 1
    finally:
        await ws.conn.close()

    # The session's SSE stream carries the same generation and the same single final event.
    session = Session(engine.url, ack["session_id"], ack["token"])
    gid = ack["generation_id"]
    async with httpx.AsyncClient(timeout=60) as client:
        reading = await read_events(client, session, until_final_of=gid)
    assert reading.text(gid) == ws.text("story") != ""
    assert reading.final(gid).id == final["event_id"]
    await nothing_after_the_final(engine, session.session_id, gid)


async def test_a_cancel_through_gateway_b_ends_the_stream_read_through_gateway_a(
    engine: EngineUnderTest,
) -> None:
    gateway_b = engine.extra_gateway("b")
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, engine.url)
        via_b = Session(gateway_b.url, session.session_id, session.token)
        gid = await send(client, session, PROMPT, max_tokens=LONG, **engine.sampling)
        reading = await read_events(client, session, limit=5, timeout_s=300)
        assert reading.events[-1].event == "token"
        await still_running(engine, session.session_id, reading)

        sent = time.monotonic()
        reader = asyncio.create_task(
            read_events(
                client,
                session,
                until_final_of=gid,
                reading=reading,
                last_event_id=reading.events[-1].id,
            )
        )
        answer = await rest_cancel(client, via_b, gid)
        await reader
        print(f"\n{engine.backend} cancelled on gateway A {time.monotonic() - sent:.3f} s on")
        await engine.stops(sent, "cancel through gateway B")
        assert answer["state"] == "cancelled", answer
        final = reading.final(gid)
        assert reading.events[-1] is final and final.json() == answer["final"]
        check_partial_usage(final.json(), [e.json() for e in reading.of(gid) if e.event == "token"])
        await nothing_after_the_final(engine, session.session_id, gid)


async def test_cancelling_twice_answers_the_final_state_again(engine: EngineUnderTest) -> None:
    gateway_b = engine.extra_gateway("b")
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, engine.url)
        gid = await send(client, session, PROMPT, max_tokens=LONG, **engine.sampling)
        reading = await read_events(client, session, limit=5, timeout_s=300)
        assert reading.events[-1].event == "token"
        await still_running(engine, session.session_id, reading)
        cancels = engine.metric(CANCELS, unset=0, reason="user")

        first = await rest_cancel(client, session, gid)
        second = await rest_cancel(
            client, Session(gateway_b.url, session.session_id, session.token), gid
        )
        assert first["state"] == "cancelled" and second == first
        await engine.wait_running(0, timeout_s=STOP_WITHIN_S)
        aborts = engine.metric(CANCELS, reason="user") - cancels
        if aborts != 1:  # one abort, not two
            story = await story_of(engine, session.session_id, gid, reading)
            raise AssertionError(f"the worker aborted {aborts:.0f} times\n{story}")
        await nothing_after_the_final(engine, session.session_id, gid)


async def test_a_cancel_after_done_answers_done(engine: EngineUnderTest) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, engine.url)
        n = engine.short_max_tokens
        gid = await send(client, session, "Say hello.", max_tokens=n, **engine.sampling)
        reading = await read_events(client, session, until_final_of=gid, timeout_s=300)
        done = reading.final(gid).json()
        assert done["type"] == "done"

        late = await rest_cancel(client, session, gid)
        assert late == {"generation_id": gid, "state": "done", "final": done}
        assert await rest_cancel(client, session, gid) == late
        await nothing_after_the_final(engine, session.session_id, gid)


WORKER_RUNNING = "tokenspout_engine_generations_running"
"""The jobs the worker holds (its job table's, live)."""


async def test_a_generation_cancelled_while_queued_never_reaches_the_engine(
    engine: EngineUnderTest,
) -> None:
    capacity = engine.capacity
    peak = {"engine": 0, "worker": 0}

    async def sample() -> None:
        while True:
            peak["engine"] = max(peak["engine"], await engine.running())
            worker = await asyncio.to_thread(engine.metric, WORKER_RUNNING)
            peak["worker"] = max(peak["worker"], int(worker))
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())
    limits = httpx.Limits(max_connections=50)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        try:
            # Fill the worker with long generations, each seen running.
            async def long_one(index: int) -> tuple[Session, str]:
                session = await create_session(client, engine.url)
                content = f"{PROMPT} Number {index}."
                gid = await send(client, session, content, max_tokens=LONG, **engine.sampling)
                reading = await read_events(client, session, limit=3, timeout_s=300)
                assert [e.event for e in reading.events] == ["queued", "started", "token"]
                return session, gid

            running = await all_of(*(long_one(i) for i in range(capacity)))
            await engine.wait_running(capacity)
            # One sample of the worker's while they surely run: the sampler's, two scrapes
            # a turn, can all miss them on a loaded machine (the engine's count is refreshed
            # once a second, so it is seen late, never missed).
            worker = await asyncio.to_thread(engine.metric, WORKER_RUNNING)
            peak["worker"] = max(peak["worker"], int(worker))

            queued = await create_session(client, engine.url)
            gid = await send(client, queued, "Wait your turn.", max_tokens=LONG, **engine.sampling)
            reading = await read_events(client, queued, limit=1)
            assert reading.events[0].event == "queued"
            answer = await rest_cancel(client, queued, gid)
            assert answer["state"] == "cancelled", answer
            assert answer["final"]["reason"] == "user"
            assert answer["final"]["usage"] == {"prompt_tokens": 0, "completion_tokens": 0}
            await read_events(
                client,
                queued,
                until_final_of=gid,
                reading=reading,
                last_event_id=reading.events[-1].id,
            )
            assert [e.event for e in reading.events] == ["queued", "cancelled"]
            assert reading.events[1].json() == answer["final"]

            sent = time.monotonic()
            answers = await all_of(*(rest_cancel(client, s, g) for s, g in running))
            assert {a["state"] for a in answers} <= {"cancelled", "cancelling"}, answers
            await engine.stops(sent, f"{capacity} cancels at once", within_s=30)
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler

    # The worker took the cancelled request off the queue when a slot freed, and skipped it.
    redis = async_client(engine.stack.redis_url)
    group: dict[str, Any] = {}
    try:
        async with asyncio.timeout(30):
            while True:
                groups = await redis.xinfo_groups(Keys(engine.stack.prefix).requests(engine.model))
                group = next(g for g in groups if g["name"].decode() == CONSUMER_GROUP)
                if group["lag"] == 0 and group["pending"] == 0:
                    break
                await asyncio.sleep(0.1)
    except TimeoutError:
        pytest.fail(
            f"the queue still holds requests 30 s on: {group}; the worker's last log "
            f"lines:\n{engine.worker_log_tail()}"
        )
    finally:
        await redis.aclose()
    events = await stream_events(engine.stack.redis_url, engine.stack.prefix, queued.session_id)
    assert [e[b"t"] for e in events if e[b"g"].decode() == gid] == [b"queued", b"cancelled"]
    assert peak == {"engine": capacity, "worker": capacity}, peak
