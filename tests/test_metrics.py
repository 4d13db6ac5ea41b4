"""``/metrics`` on a real gateway and a real engine worker after real generations.

The synthetic engine runs with ``--metrics-port``; every number asserted is one the test
can work out from what its own client saw (tokens received, requests made).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from stack.redis_server import free_port
from tests.support.http import TERMINAL, Reading, Session, create_session, send
from tests.support.metrics import scrape, value
from tests.support.sse import parse
from tests.support.stack import Stack

pytestmark = pytest.mark.timeout(120)


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 20) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.1)


async def follow(client: httpx.AsyncClient, session: Session, reading: Reading) -> None:
    """Read the session's stream until one generation has ended."""
    async with client.stream("GET", session.events_url, headers=session.headers) as response:
        assert response.status_code == 200
        async for event in parse(response.aiter_lines(), reading.parser):
            reading.events.append(event)
            if event.event in TERMINAL:
                return


async def open_stream(
    client: httpx.AsyncClient, session: Session, stack: Stack
) -> tuple[asyncio.Task[None], Reading]:
    """A reader whose feed is open before anything is sent (so every event is live)."""
    reading = Reading()
    task = asyncio.create_task(follow(client, session, reading))
    await stack.wait_live_readers(session.session_id)
    return task, reading


async def test_metrics_count_a_finished_and_a_cancelled_generation_on_gateway_and_engine(
    stack: Stack,
) -> None:
    engine_port = free_port()
    stack.synthetic(20, "--metrics-port", str(engine_port))
    gateway = stack.gateway()
    engine_url = f"http://127.0.0.1:{engine_port}/metrics"
    async with httpx.AsyncClient(timeout=30) as client:
        first = await create_session(client, gateway.url)
        task, done_reading = await open_stream(client, first, stack)
        finished = await send(client, first, "count me", max_tokens=10)
        await task
        assert done_reading.final(finished).event == "done"

        second = await create_session(client, gateway.url)
        task, cancel_reading = await open_stream(client, second, stack)
        cancelled = await send(client, second, "stop me", max_tokens=400)

        async def three_tokens() -> bool:
            return sum(e.event == "token" for e in cancel_reading.events) >= 3

        await eventually(three_tokens)
        response = await client.post(
            f"{gateway.url}/v1/sessions/{second.session_id}/generations/{cancelled}/cancel",
            headers=second.headers,
        )
        assert response.status_code == 200 and response.json()["state"] == "cancelled"
        await task
        assert cancel_reading.final(cancelled).json()["reason"] == "user"
        assert (await client.get(f"{gateway.url}/no-such-page")).status_code == 404
        assert (await client.delete(f"{gateway.url}/v1/no/such/route")).status_code in (404, 405)

        tokens = {
            gid: sum(e.event == "token" for e in reading.of(gid))
            for gid, reading in ((finished, done_reading), (cancelled, cancel_reading))
        }
        assert tokens[finished] == 10 and tokens[cancelled] >= 3

        async def streams_closed_and_work_acknowledged() -> bool:
            # The engine drops a job from its running gauge just after it has
            # published the final event, so both sides settle independently.
            samples = await scrape(client, f"{gateway.url}/metrics")
            engine_samples = await scrape(client, engine_url)
            return (
                value(samples, "tokenspout_gateway_active_streams") == 0
                and value(samples, "tokenspout_gateway_generations_running") == 0
                and value(engine_samples, "tokenspout_engine_generations_running") == 0
            )

        await eventually(streams_closed_and_work_acknowledged)
        g = await scrape(client, f"{gateway.url}/metrics")
        e = await scrape(client, engine_url)

    # gateway: requests by route template and status
    messages = "/v1/sessions/{session_id}/messages"
    assert (
        value(g, "tokenspout_gateway_requests_total", method="POST", route=messages, status="202")
        == 2
    )
    cancel_route = "/v1/sessions/{session_id}/generations/{generation_id}/cancel"
    assert (
        value(
            g, "tokenspout_gateway_requests_total", method="POST", route=cancel_route, status="200"
        )
        == 1
    )
    events_route = "/v1/sessions/{session_id}/events"
    assert (
        value(
            g, "tokenspout_gateway_requests_total", method="GET", route=events_route, status="200"
        )
        == 2
    )
    # a miss under the web chat's static route is labelled with that route, not the URL
    assert (
        value(
            g, "tokenspout_gateway_requests_total", method="GET", route="/{file_path}", status="404"
        )
        == 1
    )
    unmatched = [
        labels
        for (name, labels) in g
        if name == "tokenspout_gateway_requests_total" and ("method", "DELETE") in labels
    ]
    assert unmatched == [
        frozenset(
            {("method", "DELETE"), ("route", "unmatched"), ("status", dict(unmatched[0])["status"])}
        )
    ]
    # gateway: generations, latencies as seen by the gateway
    assert value(g, "tokenspout_gateway_generations_submitted_total") == 2
    assert value(g, "tokenspout_gateway_generations_ended_total", type="done") == 1
    assert value(g, "tokenspout_gateway_generations_ended_total", type="cancelled") == 1
    # per model and key (sessions made without a key serve "anonymous")
    served = {"model": "synthetic", "tenant": "anonymous"}
    assert value(g, "tokenspout_gateway_time_to_first_token_seconds_count", **served) == 2
    assert value(g, "tokenspout_gateway_queue_wait_seconds_count", **served) == 2
    gaps = (tokens[finished] - 1) + (tokens[cancelled] - 1)
    assert value(g, "tokenspout_gateway_inter_token_seconds_count", **served) == gaps
    assert value(g, "tokenspout_gateway_inter_token_seconds_sum", **served) > 0
    assert value(g, "tokenspout_gateway_cancel_to_stop_seconds_count") == 1
    assert value(g, "tokenspout_gateway_abandoned_generations_total") == 0
    assert value(g, "tokenspout_gateway_generations_queued") == 0
    assert value(g, "tokenspout_gateway_generations_running") == 0
    assert value(g, "tokenspout_gateway_model_workers", model="synthetic") == 1
    assert value(g, "tokenspout_gateway_redis_up") == 1

    # engine: what it published, cancelled and wasted
    assert value(e, "tokenspout_engine_tokens_total") == tokens[finished] + tokens[cancelled]
    assert value(e, "tokenspout_engine_generations_total", state="done") == 1
    assert value(e, "tokenspout_engine_generations_total", state="cancelled") == 1
    assert value(e, "tokenspout_engine_cancels_total", reason="user") == 1
    # The cancel's final event is written before the engine is told to abort: at most the
    # one token already in flight is made after it (a broken abort would waste ~390).
    assert value(e, "tokenspout_engine_tokens_after_cancel_total") <= 1
    assert value(e, "tokenspout_engine_time_to_first_token_seconds_count", **served) == 2
    # The engine's own part of it (preparing, the first step) is part of that wait.
    assert value(e, "tokenspout_engine_own_time_to_first_token_seconds_count") == 2
    own = value(e, "tokenspout_engine_own_time_to_first_token_seconds_sum")
    assert 0 < own < value(e, "tokenspout_engine_time_to_first_token_seconds_sum", **served)
    assert value(e, "tokenspout_engine_queue_wait_seconds_count", **served) == 2
    assert value(e, "tokenspout_engine_cancel_to_final_seconds_count") == 1
    assert value(e, "tokenspout_engine_generations_running") == 0
    assert value(e, "tokenspout_engine_capacity") == 256
    assert value(e, "tokenspout_engine_draining") == 0


async def test_queued_and_running_gauges_follow_the_queue_in_redis(stack: Stack) -> None:
    gateway = stack.gateway(TOKENSPOUT_DEFAULT_MODEL="synthetic")  # queued before its worker
    metrics = f"{gateway.url}/metrics"
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        generation = await send(client, session, "[[stall]] wait for me", max_tokens=50)
        g = await scrape(client, metrics)
        assert value(g, "tokenspout_gateway_generations_queued") == 1
        assert value(g, "tokenspout_gateway_generations_running") == 0
        assert value(g, "tokenspout_gateway_model_generations_queued", model="synthetic") == 1

        stack.synthetic(50)

        async def taken() -> bool:
            g = await scrape(client, metrics)
            return (
                value(g, "tokenspout_gateway_generations_queued") == 0
                and value(g, "tokenspout_gateway_generations_running") == 1
            )

        await eventually(taken)
        response = await client.post(
            f"{gateway.url}/v1/sessions/{session.session_id}/generations/{generation}/cancel",
            headers=session.headers,
        )
        assert response.json()["state"] == "cancelled"

        async def drained() -> bool:
            g = await scrape(client, metrics)
            return value(g, "tokenspout_gateway_generations_running") == 0

        await eventually(drained)


async def test_a_reader_leaving_mid_generation_counts_as_abandoned_and_the_engine_aborts(
    stack: Stack,
) -> None:
    engine_port = free_port()
    stack.synthetic(20, "--metrics-port", str(engine_port))
    gateway = stack.gateway(TOKENSPOUT_ABANDON_GRACE_S="1")
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        reading = Reading()

        async def leave_after_two_tokens() -> None:
            async with client.stream(
                "GET", session.events_url, headers=session.headers
            ) as response:
                async for event in parse(response.aiter_lines(), reading.parser):
                    reading.events.append(event)
                    if sum(e.event == "token" for e in reading.events) == 2:
                        return

        reader = asyncio.create_task(leave_after_two_tokens())

        async def subscribed() -> bool:
            g = await scrape(client, f"{gateway.url}/metrics")
            return value(g, "tokenspout_gateway_active_streams") == 1

        await eventually(subscribed)
        await stack.wait_live_readers(session.session_id)
        await send(client, session, "nobody will read this", max_tokens=400)
        await reader

        async def counted() -> bool:
            g = await scrape(client, f"{gateway.url}/metrics")
            return value(g, "tokenspout_gateway_abandoned_generations_total") == 1

        await eventually(counted)

        async def aborted() -> bool:
            e = await scrape(client, f"http://127.0.0.1:{engine_port}/metrics")
            key = ("tokenspout_engine_cancels_total", frozenset({("reason", "abandoned")}))
            return e.get(key) == 1

        await eventually(aborted)
