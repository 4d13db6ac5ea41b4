"""The relay's promise (README.md, "How it works"): one Redis reader per gateway process
feeds every open stream, so the gateway's Redis connections do not grow with its streams."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlparse

import httpx
import pytest

from stack.procfs import tcp_connections_to
from tests.support.http import Session, create_session
from tests.support.sse import SSEParser
from tests.support.stack import Stack

pytestmark = pytest.mark.timeout(180)

BATCH = 5
"""Streams opened at once. The command pool grows to the most commands in flight at once
(opening a stream takes a few), so every batch asks as much of it as the first."""


async def hold_stream(
    client: httpx.AsyncClient, session: Session, attached: asyncio.Event, release: asyncio.Event
) -> None:
    """Read the session stream; ``attached`` once a heartbeat shows its feed is waiting."""
    parser = SSEParser()
    async with client.stream("GET", session.events_url, headers=session.headers) as response:
        assert response.status_code == 200
        lines = response.aiter_lines()
        while parser.comments == 0:
            assert parser.line(await anext(lines)) is None
        attached.set()
        await release.wait()


async def test_two_hundred_streams_share_the_gateway_s_few_redis_connections(
    stack: Stack,
) -> None:
    gateway = stack.gateway(TOKENSPOUT_SSE_HEARTBEAT_S="0.2")
    redis_port = urlparse(stack.redis_url).port
    assert redis_port is not None
    limits = httpx.Limits(max_connections=250, max_keepalive_connections=250)
    release = asyncio.Event()
    readers: list[asyncio.Task[None]] = []
    counts: dict[int, int] = {}
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        sessions = [await create_session(client, gateway.url) for _ in range(200)]
        try:
            for start in range(0, len(sessions), BATCH):
                batch = [asyncio.Event() for _ in range(BATCH)]
                readers += [
                    asyncio.create_task(hold_stream(client, session, attached, release))
                    for session, attached in zip(
                        sessions[start : start + BATCH], batch, strict=True
                    )
                ]
                async with asyncio.timeout(30):
                    await asyncio.gather(*(attached.wait() for attached in batch))
                open_streams = start + BATCH
                if open_streams in (20, 200):
                    await asyncio.sleep(1)  # a watchdog tick with every stream open
                    counts[open_streams] = tcp_connections_to(gateway.process.pid, redis_port)
            assert not [task for task in readers if task.done()]  # all 200 still open
        finally:
            release.set()
            for task in readers:
                task.cancel()
            for task in readers:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    print(f"\ngateway Redis connections: {counts}")
    # One command connection per stream would make it 200+; one reader plus a few pooled
    # command connections is what the design promises, whatever the number of streams.
    assert 2 <= counts[20] <= 2 + 2 * BATCH, counts
    assert counts[200] <= counts[20] + 2, counts
