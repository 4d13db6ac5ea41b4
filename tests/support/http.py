"""Test helpers that talk to a gateway the way a client would: httpx and SSE."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from tests.support.sse import Event, SSEParser, parse

TERMINAL = {"done", "cancelled", "error"}
T = TypeVar("T")


async def all_of(*coroutines: Coroutine[Any, Any, T]) -> list[T]:
    """Run concurrently and return every result; the first failure cancels the others.

    ``asyncio.gather`` would leave them running past the test, using a closed client.
    """
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(coroutine) for coroutine in coroutines]
    return [task.result() for task in tasks]


@dataclass
class Session:
    base: str
    session_id: str
    token: str

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Session-Token": self.token}

    @property
    def events_url(self) -> str:
        return f"{self.base}/v1/sessions/{self.session_id}/events"


async def create_session(client: httpx.AsyncClient, base: str) -> Session:
    response = await client.post(f"{base}/v1/sessions")
    assert response.status_code == 201, response.text
    body = response.json()
    return Session(base, body["session_id"], body["token"])


async def send(client: httpx.AsyncClient, session: Session, content: str, **params: Any) -> str:
    response = await client.post(
        f"{session.base}/v1/sessions/{session.session_id}/messages",
        json={"content": content, **params},
        headers=session.headers,
    )
    assert response.status_code == 202, response.text
    return str(response.json()["generation_id"])


async def cancel(client: httpx.AsyncClient, session: Session, gid: str) -> dict[str, Any]:
    """``POST .../cancel``; its answer (the final state, or ``cancelling``)."""
    response = await client.post(
        f"{session.base}/v1/sessions/{session.session_id}/generations/{gid}/cancel",
        headers=session.headers,
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


@dataclass
class Reading:
    events: list[Event] = field(default_factory=list)
    parser: SSEParser = field(default_factory=SSEParser)
    arrived: dict[str, float] = field(default_factory=dict)
    """Event id -> when the client got it (unix seconds); its id says when Redis took it."""

    def add(self, event: Event) -> None:
        self.events.append(event)
        if event.id is not None:
            self.arrived[event.id] = time.time()

    def of(self, generation_id: str) -> list[Event]:
        return [e for e in self.events if e.json().get("generation_id") == generation_id]

    def text(self, generation_id: str) -> str:
        return "".join(e.json()["text"] for e in self.of(generation_id) if e.event == "token")

    def final(self, generation_id: str) -> Event:
        finals = [e for e in self.of(generation_id) if e.event in TERMINAL]
        assert len(finals) == 1, finals
        return finals[0]


async def read_events(
    client: httpx.AsyncClient,
    session: Session,
    until_final_of: str | None = None,
    last_event_id: str | None = None,
    limit: int | None = None,
    timeout_s: float = 60,
    reading: Reading | None = None,
    as_query: bool = False,
    until_event: str | None = None,
) -> Reading:
    """Read the session stream until a generation ends (or ``limit`` events arrive, or an
    ``until_event`` event)."""
    reading = reading or Reading()
    headers = dict(session.headers)
    params = {}
    if last_event_id is not None and as_query:
        params["last_event_id"] = last_event_id
    elif last_event_id is not None:
        headers["Last-Event-ID"] = last_event_id

    async def consume() -> None:
        async with client.stream(
            "GET", session.events_url, headers=headers, params=params
        ) as response:
            assert response.status_code == 200, await response.aread()
            assert response.headers["content-type"].startswith("text/event-stream")
            assert "content-encoding" not in response.headers
            async for event in parse(response.aiter_lines(), reading.parser):
                reading.add(event)
                if limit is not None and len(reading.events) >= limit:
                    return
                if event.event == until_event:
                    return
                data = event.json()
                if event.event in TERMINAL and data["generation_id"] == until_final_of:
                    return

    await asyncio.wait_for(consume(), timeout_s)
    return reading


STREAM_BROKE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError)
"""What a client meets when the gateway serving its stream goes away."""


async def resume_until_final(
    client: httpx.AsyncClient,
    session: Session,
    generation_id: str,
    reading: Reading,
    timeout_s: float = 600,
    most_breaks: int = 5,
) -> int:
    """Resume after the last event read until ``generation_id``'s final, reconnecting at
    once whenever the stream breaks, as EventSource does; how many more times it broke."""
    deadline = time.monotonic() + timeout_s
    breaks = 0
    while True:
        try:
            await read_events(
                client,
                session,
                until_final_of=generation_id,
                reading=reading,
                last_event_id=reading.events[-1].id,
                timeout_s=deadline - time.monotonic(),
            )
            return breaks
        except STREAM_BROKE:
            breaks += 1
            if breaks > most_breaks:
                raise


@dataclass
class Follower:
    """An SSE reader that notes when each event arrived."""

    reading: Reading = field(default_factory=Reading)
    arrived: list[float] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    def tokens(self) -> int:
        return sum(e.event == "token" for e in self.reading.events)

    def first_token_after(self, moment: float) -> float:
        """Seconds from ``moment`` to the first token the new worker wrote (after the
        ``resumed`` event): the reader's view of the takeover."""
        resumed = False
        for at, event in zip(self.arrived, self.reading.events, strict=True):
            resumed = resumed or event.event == "resumed"
            if resumed and event.event == "token":
                return at - moment
        raise AssertionError("no token after a resumed event")

    async def until_end(self, timeout_s: float = 30) -> None:
        """Wait until the stream has brought the generation's final event."""
        assert self.task is not None, "follow() starts the reader"
        await asyncio.wait_for(self.task, timeout_s)

    async def until_event(self, name: str, timeout_s: float = 30) -> None:
        """Wait until the stream has brought an event of type ``name``."""
        async with asyncio.timeout(timeout_s):
            while not any(event.event == name for event in self.reading.events):
                assert self.task is None or not self.task.done(), "the stream ended"
                await asyncio.sleep(0.01)

    async def until_tokens(self, count: int, timeout_s: float = 30) -> None:
        async with asyncio.timeout(timeout_s):
            while self.tokens() < count:
                assert self.task is None or not self.task.done(), "the stream ended"
                await asyncio.sleep(0.01)


async def cancel_mid_reply(
    client: httpx.AsyncClient,
    session: Session,
    gid: str,
    events: int,
    after: str | None = None,
    timeout_s: float = 60,
) -> Reading:
    """Read ``events`` events of the session (after ``after``), cancel ``gid``, then read on
    to its final event: the reading of both."""
    reading = await read_events(
        client, session, limit=events, last_event_id=after, timeout_s=timeout_s
    )
    await cancel(client, session, gid)
    return await read_events(
        client,
        session,
        until_final_of=gid,
        reading=reading,
        last_event_id=reading.events[-1].id,
        timeout_s=timeout_s,
    )


def follow(
    client: httpx.AsyncClient, session: Session, gid: str, after: str | None = None
) -> Follower:
    follower = Follower()

    async def read() -> None:
        headers = dict(session.headers)
        if after is not None:
            headers["Last-Event-ID"] = after
        async with client.stream("GET", session.events_url, headers=headers) as response:
            assert response.status_code == 200
            async for event in parse(response.aiter_lines(), follower.reading.parser):
                follower.reading.events.append(event)
                follower.arrived.append(time.monotonic())
                if event.event in TERMINAL and event.json()["generation_id"] == gid:
                    return

    follower.task = asyncio.create_task(read())
    return follower


async def reply_under_way(
    client: httpx.AsyncClient, base: str, content: str, tokens: int, **params: Any
) -> tuple[Session, str, Follower]:
    """A new session's reply to ``content``, followed until ``tokens`` tokens arrived (the
    moment a fault test strikes): its session, generation id and follower."""
    session = await create_session(client, base)
    gid = await send(client, session, content, **params)
    follower = follow(client, session, gid)
    await follower.until_tokens(tokens)
    return session, gid, follower


@asynccontextmanager
async def slot_held(base: str) -> AsyncIterator[None]:
    """A session generation that never ends (``[[stall]]``) holds one in-flight slot until
    the block ends; it is then cancelled and its slot freed."""
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, base)
        generation_id = await send(client, session, "hold [[stall]]", max_tokens=50)
        try:
            yield
        finally:
            cancel = await client.post(
                f"{base}/v1/sessions/{session.session_id}/generations/{generation_id}/cancel",
                headers=session.headers,
            )
            assert cancel.status_code == 200, cancel.text
