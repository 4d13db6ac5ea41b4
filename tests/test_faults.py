"""Faults with real processes and a real Redis: reconnects, kills, restarts.

Each test states the guarantee of docs/reliability.md that it checks.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stack import processes
from stack.redis_server import EmbeddedRedis
from tests.client import Reading, Session, create_session, read_events, send
from tests.conftest import Stack
from tests.sse import parse
from tests.test_sessions import expected_reply

pytestmark = pytest.mark.timeout(180)


def event_key(event_id: str) -> tuple[int, int]:
    ms, seq = event_id.split("-")
    return int(ms), int(seq)


async def test_random_reconnects_lose_and_repeat_nothing(stack: Stack) -> None:
    """Guarantee 1: resume from any Last-Event-ID; the text equals the engine's output."""
    stack.synthetic(tokens_per_s=300)
    gateway = stack.gateway()
    rng = random.Random(7)
    checked = 0

    async def one(client: httpx.AsyncClient, index: int) -> int:
        session = await create_session(client, gateway.url)
        content = f"reconnect {index}"
        generation = await send(client, session, content, max_tokens=150)
        reading, last = Reading(), None
        while not any(e.event == "done" for e in reading.events):
            before = len(reading.events)
            await read_events(
                client,
                session,
                until_final_of=generation,
                last_event_id=last,
                limit=before + rng.randint(1, 25),
                reading=reading,
            )
            last = reading.events[-1].id
        ids = [event_key(e.id or "") for e in reading.events]
        assert ids == sorted(set(ids)), "events repeated or out of order"
        assert reading.text(generation) == expected_reply(content, 150)
        return len(reading.events)

    async with httpx.AsyncClient(timeout=30) as client:
        checked = sum(await asyncio.gather(*(one(client, i) for i in range(10))))
    assert checked >= 10 * 153
    print(f"\nreconnects: {checked} events checked over 10 sessions, 0 lost, 0 repeated")


async def test_a_killed_gateway_is_replaced_and_the_stream_resumes(stack: Stack) -> None:
    """Guarantee 2: the gateway holds no state; a restarted one serves the resume."""
    stack.synthetic(tokens_per_s=60)
    gateway = stack.gateway()
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        generation = await send(client, session, "survive a crash", max_tokens=60)
        first = await read_events(client, session, limit=12)
        processes.kill(gateway.process)
        began = time.monotonic()
        restarted = stack.gateway(port=gateway.port)
        print(f"\ngateway back in {time.monotonic() - began:.2f} s")
        moved = Session(restarted.url, session.session_id, session.token)
        rest = await read_events(
            client, moved, until_final_of=generation, last_event_id=first.events[-1].id
        )
        assert first.text(generation) + rest.text(generation) == expected_reply(
            "survive a crash", 60
        )


async def test_a_killed_worker_ends_its_generation_and_a_survivor_serves_the_queue(
    stack: Stack,
) -> None:
    """Guarantee 3: a dead worker's running generation ends with an error in bounded
    time; what was still queued is served by another worker."""
    doomed = stack.synthetic(20, "--capacity", "1")
    gateway = stack.gateway(TOKENSPOUT_WORKER_TIMEOUT_S="2")
    async with httpx.AsyncClient(timeout=30) as client:
        running_session = await create_session(client, gateway.url)
        running = await send(client, running_session, "long one", max_tokens=400)
        partial = await read_events(client, running_session, limit=5)
        waiting_session = await create_session(client, gateway.url)
        waiting = await send(client, waiting_session, "queued one", max_tokens=5)

        processes.kill(doomed)
        killed_at = time.monotonic()
        ended = await read_events(
            client,
            running_session,
            until_final_of=running,
            last_event_id=partial.events[-1].id,
            timeout_s=30,
        )
        recovery_s = time.monotonic() - killed_at
        error = ended.final(running).json()
        assert error["type"] == "error" and error["code"] == "worker_lost"
        assert recovery_s < 15, "docs/reliability.md promises worker_timeout_s + ~2 s"
        print(f"\nworker lost -> error event after {recovery_s:.2f} s")

        stack.synthetic(200)
        served = await read_events(client, waiting_session, until_final_of=waiting)
        assert served.final(waiting).event == "done"
        assert served.text(waiting) == expected_reply("queued one", 5)


@pytest.fixture
def restartable_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(data_dir=tmp_path / "redis", persist=True)
    server.data_dir.mkdir()
    with server:
        yield server


async def test_redis_restart_with_persistence_resumes_every_stream(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """Guarantee 4a: Redis restarts with its data (AOF): streams pause, then resume whole."""
    stack = Stack(restartable_redis.url, "restart", tmp_path)
    try:
        stack.synthetic(tokens_per_s=25)
        gateway = stack.gateway()
        async with httpx.AsyncClient(timeout=30) as client:
            session = await create_session(client, gateway.url)
            generation = await send(client, session, "through a restart", max_tokens=100)
            reading = Reading()
            reader = asyncio.create_task(
                read_events(
                    client, session, until_final_of=generation, reading=reading, timeout_s=90
                )
            )
            while len(reading.events) < 10:
                await asyncio.sleep(0.05)
            restartable_redis.stop()
            outage = await client.get(f"{gateway.url}/ready")
            assert outage.status_code == 503 and outage.json()["ready"] is False
            await asyncio.sleep(1.5)
            seen = len(reading.events)
            restartable_redis.start()
            back = time.monotonic()
            while len(reading.events) == seen and not reader.done():
                await asyncio.sleep(0.01)
            print(f"\nRedis back -> next event after {time.monotonic() - back:.2f} s")
            await reader  # the same SSE connection carries on
            assert reading.text(generation) == expected_reply("through a restart", 100)
            ids = [event_key(e.id or "") for e in reading.events]
            assert ids == sorted(set(ids))
            await _a_new_session_works(client, gateway.url)
    finally:
        stack.stop()


async def test_redis_restart_without_its_data_ends_streams_clearly(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """Guarantee 4b: Redis comes back empty: open streams end with `session_lost`,
    nothing crashes, and new sessions work."""
    stack = Stack(restartable_redis.url, "wiped", tmp_path)
    try:
        worker = stack.synthetic(tokens_per_s=25)
        gateway = stack.gateway()
        async with httpx.AsyncClient(timeout=30) as client:
            session = await create_session(client, gateway.url)
            await send(client, session, "into the void", max_tokens=200)
            await read_events(client, session, limit=5)
            frames: list[str] = []

            async def read_raw() -> None:
                async with client.stream(
                    "GET", session.events_url, headers=session.headers
                ) as response:
                    async for line in response.aiter_lines():
                        frames.append(line)

            reader = asyncio.create_task(read_raw())
            await asyncio.sleep(0.5)
            restartable_redis.kill(wipe=True)
            restartable_redis.start()
            await asyncio.wait_for(reader, 30)  # the stream ends by itself
            assert "event: error" in frames
            assert any('"code":"session_lost"' in line for line in frames)
            await _a_new_session_works(client, gateway.url)
            assert worker.poll() is None and gateway.process.poll() is None
    finally:
        stack.stop()


async def _a_new_session_works(client: httpx.AsyncClient, base: str) -> None:
    deadline = time.monotonic() + 20
    while (await client.get(f"{base}/ready")).status_code != 200:
        assert time.monotonic() < deadline, "/ready did not recover"
        await asyncio.sleep(0.2)
    session = await create_session(client, base)
    generation = await send(client, session, "after the storm", max_tokens=4)
    reading = await read_events(client, session, until_final_of=generation)
    assert reading.text(generation) == expected_reply("after the storm", 4)


async def test_api_streams_that_lose_their_session_end_in_their_own_error_format(
    restartable_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    """Once the headers are out, a failure (here: Redis comes back empty, `session_lost`)
    ends each adapter's stream with its error frame instead of cutting it off."""
    stack = Stack(restartable_redis.url, "adapters", tmp_path)
    try:
        stack.synthetic(tokens_per_s=25)
        gateway = stack.gateway()
        streams = {
            "openai": (
                "/v1/chat/completions",
                {
                    "model": "m",
                    "messages": [{"role": "user", "content": "into the void"}],
                    "max_tokens": 200,
                    "stream": True,
                },
            ),
            "tgi": (
                "/generate_stream",
                {"inputs": "into the void", "parameters": {"max_new_tokens": 200}},
            ),
            "oip": (
                "/v2/models/m/generate_stream",
                {"text_input": "into the void", "parameters": {"max_tokens": 200}},
            ),
        }
        data: dict[str, list[str]] = {name: [] for name in streams}
        async with httpx.AsyncClient(timeout=30) as client:

            async def read(name: str) -> None:
                path, body = streams[name]
                async with client.stream("POST", gateway.url + path, json=body) as response:
                    assert response.status_code == 200
                    async for event in parse(response.aiter_lines()):
                        data[name].append(event.data)

            readers = [asyncio.create_task(read(name)) for name in streams]
            async with asyncio.timeout(30):
                while not all(len(events) >= 3 for events in data.values()):
                    await asyncio.sleep(0.05)
            restartable_redis.kill(wipe=True)
            restartable_redis.start()
            await asyncio.wait_for(asyncio.gather(*readers), 30)  # each ends by itself
            await _a_new_session_works(client, gateway.url)

        *_, error, done = data["openai"]
        assert done == "[DONE]"
        assert json.loads(error)["error"]["code"] == "session_lost"
        assert json.loads(error)["error"]["type"] == "invalid_request_error"
        tgi = json.loads(data["tgi"][-1])
        assert tgi["error_type"] == "generation" and "lost" in tgi["error"]
        assert "lost" in json.loads(data["oip"][-1])["error"]
        for name in ("tgi", "oip"):
            assert all("error" not in json.loads(item) for item in data[name][:-1])
    finally:
        stack.stop()
