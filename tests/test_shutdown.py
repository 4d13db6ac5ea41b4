"""Graceful shutdown of real gateway and engine processes on SIGTERM.

A generation in flight when the signal arrives either finishes or ends with a final event,
and the process exits within its configured drain time. The synthetic engine's speed makes
each case's timing unambiguous: the bounds below are several times the work they wait for.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time

import httpx
import pytest
import redis.asyncio as aioredis

from tests.support.http import TERMINAL, Reading, Session, create_session, send
from tests.support.oracle import synthetic_text
from tests.support.redis_probes import wait_running, worker_registered
from tests.support.sse import parse
from tests.support.stack import Gateway, Stack
from tests.support.tokens import assert_gap_free_tokens

pytestmark = pytest.mark.timeout(120)


async def stream_until_closed(
    client: httpx.AsyncClient, session: Session, reading: Reading
) -> bool:
    """Read the session's stream until the server ends it: True when it ended cleanly,
    False when the connection was cut mid-response."""
    try:
        async with client.stream("GET", session.events_url, headers=session.headers) as response:
            assert response.status_code == 200
            async for event in parse(response.aiter_lines(), reading.parser):
                reading.events.append(event)
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return False
    return True


async def tokens_seen(reading: Reading, count: int) -> None:
    async with asyncio.timeout(30):
        while sum(e.event == "token" for e in reading.events) < count:
            await asyncio.sleep(0.02)


def wait_exit(process: subprocess.Popen[bytes], within_s: float) -> float:
    """Seconds the process took to exit after now; fails past ``within_s``."""
    began = time.monotonic()
    try:
        process.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{process.args!r} still running {within_s} s after SIGTERM")
    return time.monotonic() - began


async def test_engine_sigterm_lets_a_running_generation_finish_within_the_drain_time(
    stack: Stack,
) -> None:
    engine = stack.synthetic(20, "--drain-s", "20")
    gateway = stack.gateway()
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        generation = await send(client, session, "finish me", max_tokens=30)
        reading = Reading()
        reader = asyncio.create_task(stream_until_final(client, session, reading))
        await tokens_seen(reading, 3)
        engine.send_signal(signal.SIGTERM)
        took = await asyncio.to_thread(wait_exit, engine, 20 + 10)
        await reader
    assert engine.returncode == 0
    final = reading.final(generation)
    assert final.event == "done" and final.json()["usage"]["completion_tokens"] == 30
    assert reading.text(generation) == synthetic_text("finish me", 30)
    assert took < 20  # it left as soon as its work was done, not at the drain deadline
    assert not worker_registered(stack.redis_url, stack.prefix)


async def test_engine_sigterm_past_the_drain_time_ends_the_generation_cancelled_shutdown(
    stack: Stack,
) -> None:
    engine = stack.synthetic(20, "--drain-s", "1")
    gateway = stack.gateway()
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        # 400 tokens at 20 per second: 20 s of work, far past the 1 s drain
        generation = await send(client, session, "too long to wait for", max_tokens=400)
        reading = Reading()
        reader = asyncio.create_task(stream_until_final(client, session, reading))
        await tokens_seen(reading, 3)
        engine.send_signal(signal.SIGTERM)
        took = await asyncio.to_thread(wait_exit, engine, 1 + 10)
        await reader
    assert engine.returncode == 0
    final = reading.final(generation).json()
    assert reading.final(generation).event == "cancelled"
    assert final["reason"] == "shutdown"
    tokens = [e.json() for e in reading.of(generation) if e.event == "token"]
    assert final["usage"]["completion_tokens"] == assert_gap_free_tokens(tokens) < 400
    assert reading.events[-1].event == "cancelled"  # nothing after the final event
    assert took < 11


async def test_gateway_sigterm_ends_a_stream_right_after_its_generation_finishes(
    stack: Stack,
) -> None:
    stack.synthetic(20)
    gateway = stack.gateway(TOKENSPOUT_SHUTDOWN_GRACE_S="30")
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, gateway.url)
        generation = await send(client, session, "drain the gateway", max_tokens=40)
        reading = Reading()
        reader = asyncio.create_task(stream_until_closed(client, session, reading))
        await tokens_seen(reading, 3)
        gateway.process.send_signal(signal.SIGTERM)
        took = await asyncio.to_thread(wait_exit, gateway.process, 30 + 10)
        assert await reader, "the stream was cut instead of ended"
    assert shut_down_cleanly(stack, gateway)
    # the whole generation arrived, its final event last, and then the server closed
    assert reading.events[-1].event == "done"
    assert reading.text(generation) == synthetic_text("drain the gateway", 40)
    assert took < 30  # closed by the drain, not cut at the grace deadline


async def test_gateway_sigterm_closes_idle_streams_at_once(stack: Stack) -> None:
    gateway = stack.gateway(TOKENSPOUT_SHUTDOWN_GRACE_S="30", TOKENSPOUT_SSE_HEARTBEAT_S="60")
    async with httpx.AsyncClient(timeout=60) as client:
        sessions = [await create_session(client, gateway.url) for _ in range(3)]
        readings = [Reading() for _ in sessions]
        readers = [
            asyncio.create_task(stream_until_closed(client, session, reading))
            for session, reading in zip(sessions, readings, strict=True)
        ]
        async with asyncio.timeout(10):
            while not all(reading.parser.retry is not None for reading in readings):
                await asyncio.sleep(0.02)
        for session in sessions:  # each handler has opened its feed
            await stack.wait_live_readers(session.session_id)
        gateway.process.send_signal(signal.SIGTERM)
        took = await asyncio.to_thread(wait_exit, gateway.process, 30 + 10)
        assert all(await asyncio.gather(*readers)), "a stream was cut instead of ended"
    assert shut_down_cleanly(stack, gateway)
    assert all(reading.events == [] for reading in readings)  # ended cleanly, nothing cut
    assert took < 30


async def test_gateway_sigterm_cuts_what_outlasts_the_grace_and_the_client_resumes_elsewhere(
    stack: Stack,
) -> None:
    stack.synthetic(20)
    leaving = stack.gateway(TOKENSPOUT_SHUTDOWN_GRACE_S="1")
    staying = stack.gateway()
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, leaving.url)
        generation = await send(client, session, "outlast the grace", max_tokens=200)
        first = Reading()
        reader = asyncio.create_task(stream_until_closed(client, session, first))
        await tokens_seen(first, 3)
        leaving.process.send_signal(signal.SIGTERM)
        took = await asyncio.to_thread(wait_exit, leaving.process, 1 + 10)
        assert not await reader, "the stream should be cut at the grace deadline"
        received = first.events
        assert not any(e.event in TERMINAL for e in received)
        moved = Session(staying.url, session.session_id, session.token)
        rest = Reading()
        await asyncio.wait_for(stream_until_final(client, moved, rest, after=received[-1].id), 30)
    assert took < 11
    whole = Reading(events=received + rest.events)
    assert whole.final(generation).event == "done"
    assert whole.text(generation) == synthetic_text("outlast the grace", 200)


async def test_gateway_sigterm_answers_requests_that_outlast_the_grace_503_in_their_format(
    stack: Stack,
) -> None:
    """A one-shot request still waiting for its generation when the grace is nearly over
    gets a retryable error in its API's format (not uvicorn's plain-text 500 when the grace
    ends), and its generation is stopped: the client sends it again elsewhere."""
    stack.synthetic(20)
    gateway = stack.gateway(TOKENSPOUT_SHUTDOWN_GRACE_S="2")
    chat = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "outlast it"}],
        "max_tokens": 400,
    }
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
        whole = asyncio.create_task(client.post("/v1/chat/completions", json=chat))
        response = asyncio.create_task(
            client.post(
                "/v1/responses",
                json={"model": "synthetic", "input": "outlast it", "max_output_tokens": 400},
            )
        )

        async def streamed() -> list[str]:
            body = {**chat, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as answer:
                assert answer.status_code == 200
                return [line async for line in answer.aiter_lines() if line.startswith("data:")]

        stream = asyncio.create_task(streamed())
        await asyncio.to_thread(wait_running, stack.redis_url, stack.prefix, 3)
        gateway.process.send_signal(signal.SIGTERM)
        answers = await asyncio.gather(whole, response)
        frames = await stream
        await asyncio.to_thread(wait_exit, gateway.process, 2 + 10)
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "shutting_down"
    assert frames[-1] == "data: [DONE]"
    assert json.loads(frames[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    assert all("choices" in json.loads(frame.removeprefix("data: ")) for frame in frames[:-2])
    await asyncio.to_thread(wait_running, stack.redis_url, stack.prefix, 0)  # all stopped
    assert shut_down_cleanly(stack, gateway)
    log = (stack.logs / f"gateway-{gateway.port}.log").read_text()
    assert "Exception in ASGI application" not in log


async def test_a_request_waiting_on_redis_past_the_grace_gets_503_in_its_format(
    stack: Stack,
) -> None:
    """A request that waits on Redis rather than on a generation (a session's create and a
    message, a one-shot chat completion's submit, whole and streamed, with Redis's writes
    paused) when the grace is nearly over gets the same retryable 503 ``shutting_down`` in
    its API's format: uvicorn cancelled it at the grace's end and answered a plain-text 500
    (ten-minute cluster soaks: six on the session routes, then one on the hot OpenAI route,
    which is served ahead of Litestar's middleware)."""
    stack.synthetic(20)
    gateway = stack.gateway(TOKENSPOUT_SHUTDOWN_GRACE_S="2")
    admin = aioredis.Redis.from_url(stack.redis_url)
    try:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            session = await create_session(client, gateway.url)
            await admin.execute_command("CLIENT", "PAUSE", "8000", "WRITE")
            try:
                waiting = [
                    asyncio.create_task(client.post("/v1/sessions")),
                    asyncio.create_task(
                        client.post(
                            f"/v1/sessions/{session.session_id}/messages",
                            json={"content": "held"},
                            headers=session.headers,
                        )
                    ),
                    *(
                        asyncio.create_task(
                            client.post(
                                "/v1/chat/completions",
                                json={
                                    "model": "synthetic",
                                    "messages": [{"role": "user", "content": "held"}],
                                    "stream": stream,
                                },
                            )
                        )
                        for stream in (False, True)
                    ),
                ]
                await asyncio.sleep(0.5)  # all wait on Redis
                gateway.process.send_signal(signal.SIGTERM)
                answers = await asyncio.gather(*waiting)
            finally:
                await admin.execute_command("CLIENT", "UNPAUSE")
        await asyncio.to_thread(wait_exit, gateway.process, 2 + 10)
    finally:
        await admin.aclose()
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "shutting_down"
    log = (stack.logs / f"gateway-{gateway.port}.log").read_text()
    assert "Exception in ASGI application" not in log


async def stream_until_final(
    client: httpx.AsyncClient, session: Session, reading: Reading, after: str | None = None
) -> None:
    headers = dict(session.headers)
    if after is not None:
        headers["Last-Event-ID"] = after
    async with client.stream("GET", session.events_url, headers=headers) as response:
        assert response.status_code == 200
        async for event in parse(response.aiter_lines(), reading.parser):
            reading.events.append(event)
            if event.event in TERMINAL:
                return


def shut_down_cleanly(stack: Stack, gateway: Gateway) -> bool:
    """uvicorn finished its shutdown (it then re-raises SIGTERM, so the exit status is
    either 0 or -SIGTERM whichever way it went; the log tells them apart)."""
    log = (stack.logs / f"gateway-{gateway.port}.log").read_text()
    # A background duty that ignored its cancel (seen once in a full run, not reproduced
    # since) is logged with where it waited: fail with that, not with a hang.
    assert "did not end within" not in log, log[-3000:]
    return (
        gateway.process.returncode in (0, -signal.SIGTERM)
        and "msg='draining'" in log
        and "msg='Application shutdown complete.'" in log
    )
