"""A client that follows a server-sent event stream as a browser's ``EventSource`` does
(the HTML standard, "Server-sent events"), for tests of what such a client meets.

What it shares with ``EventSource``: it sends ``Accept: text/event-stream`` and, once it
has one, ``Last-Event-ID``; the last event id is the ``id:`` field's value kept across
events (an empty ``id:`` clears it), set when an event is dispatched; ``retry:`` sets the
reconnection delay; a stream that ends or breaks is reconnected after that delay; an
answer that is not a 200 ``text/event-stream`` fails the connection for good (a browser
then gives the page only an ``error`` event; ``failure`` keeps the body a client library
could fetch). Unlike a browser it records when each thing happened.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

DEFAULT_RETRY_MS = 3000
"""A browser's reconnection delay until the stream sets one."""


@dataclass
class Received:
    event: str
    data: str
    last_event_id: str
    """The source's last event id once this event was dispatched."""
    at: float
    """``time.monotonic()`` when it came."""

    def json(self) -> Any:
        return json.loads(self.data)


@dataclass
class Failure:
    """The connection failed for good: a status other than 200, or another content type."""

    status: int
    body: str
    at: float

    @property
    def code(self) -> str | None:
        """The gateway's error code in the body, if it has one."""
        try:
            error = json.loads(self.body).get("error")
        except ValueError:
            return None
        return error.get("code") if isinstance(error, dict) else None


@dataclass
class EventSource:
    client: httpx.AsyncClient
    url: str
    last_event_id: str = ""
    retry_ms: int = DEFAULT_RETRY_MS
    events: list[Received] = field(default_factory=list)
    connects: list[float] = field(default_factory=list)
    """When each connection (the first and every reconnection) was made."""
    broken: int = 0
    """Connections that broke (a network error) rather than ended."""
    failure: Failure | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set at every event, connection and failure (a waiter clears it)."""

    async def run(self) -> None:
        """Connect, read, reconnect as ``EventSource`` does, until the connection fails."""
        while self.failure is None:
            self._note(self.connects)
            headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
            if self.last_event_id:
                headers["Last-Event-ID"] = self.last_event_id
            try:
                async with self.client.stream("GET", self.url, headers=headers) as response:
                    media = response.headers.get("content-type", "")
                    if response.status_code != 200 or not media.startswith("text/event-stream"):
                        body = (await response.aread()).decode(errors="replace")
                        self.failure = Failure(response.status_code, body, time.monotonic())
                        self.changed.set()
                        return
                    await self._read(response)
            except httpx.TransportError:
                self.broken += 1  # as a browser does: reconnect after the delay
            await asyncio.sleep(self.retry_ms / 1000)

    async def _read(self, response: httpx.Response) -> None:
        event_type, data, id_buffer = "", [], self.last_event_id  # type: ignore[var-annotated]
        async for line in response.aiter_lines():
            if line == "":
                self.last_event_id = id_buffer
                if data:
                    joined = "\n".join(data)
                    received = Received(
                        event_type or "message", joined, id_buffer, time.monotonic()
                    )
                    self.events.append(received)
                    self.changed.set()
                event_type, data = "", []
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event_type = value
            elif name == "data":
                data.append(value)
            elif name == "id" and "\0" not in value:
                id_buffer = value
            elif name == "retry" and value.isdigit():
                self.retry_ms = int(value)

    def _note(self, times: list[float]) -> None:
        times.append(time.monotonic())
        self.changed.set()

    def after(self, since: float) -> list[Received]:
        return [event for event in self.events if event.at >= since]
