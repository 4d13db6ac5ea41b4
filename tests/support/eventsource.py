"""A client that follows a server-sent event stream as a browser's ``EventSource`` does
(the HTML standard, "Server-sent events"), for tests of what such a client meets.

What it shares with ``EventSource``: it sends ``Accept: text/event-stream`` and, once it
has one, ``Last-Event-ID``; the last event id is the ``id:`` field's value kept across
events (an empty ``id:`` clears it), set when an event is dispatched; ``retry:`` sets the
reconnection delay; a stream that ends or breaks is reconnected after that delay; an
answer that is not a 200 ``text/event-stream`` fails the connection for good (a browser
then gives the page only an ``error`` event; ``failure`` keeps the body a client library
could fetch). Unlike a browser it records when each thing happened.

It speaks HTTP/1.1 on a plain asyncio connection, as a browser has its own network stack:
50 of them in one test process answered a burst of reconnections within 0.1 s, where httpx
clients took up to 1.7 s of the process's own time on a loaded machine (the gateway
answered each in under 25 ms), which is not what a test of the gateway should measure.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

DEFAULT_RETRY_MS = 3000
"""A browser's reconnection delay until the stream sets one."""
LINE_END = re.compile(rb"\r\n|\r|\n")


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
    url: str
    last_event_id: str = ""
    retry_ms: int = DEFAULT_RETRY_MS
    events: list[Received] = field(default_factory=list)
    connects: list[float] = field(default_factory=list)
    """When each connection (the first and every reconnection) was made."""
    broken: int = 0
    """Connections that broke (a network error) rather than ended."""
    failure: Failure | None = None

    async def run(self) -> None:
        """Connect, read, reconnect as ``EventSource`` does, until the connection fails."""
        while self.failure is None:
            self.connects.append(time.monotonic())
            try:
                await self._connect()
            except (OSError, asyncio.IncompleteReadError, ValueError):
                self.broken += 1  # as a browser does: reconnect after the delay
            if self.failure is None:
                await asyncio.sleep(self.retry_ms / 1000)

    async def _connect(self) -> None:
        url = urlsplit(self.url)
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        try:
            headers = {"Host": url.netloc, "Accept": "text/event-stream", "Connection": "close"}
            if self.last_event_id:
                headers["Last-Event-ID"] = self.last_event_id
            lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
            target = f"{url.path}?{url.query}" if url.query else url.path
            writer.write(f"GET {target} HTTP/1.1\r\n{lines}\r\n".encode())
            status = int((await reader.readline()).split()[1])
            head = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                head[name.strip().lower()] = value.strip()
            body = _body(reader, head)
            if status != 200 or not head.get("content-type", "").startswith("text/event-stream"):
                text = b"".join([chunk async for chunk in body]).decode(errors="replace")
                self.failure = Failure(status, text, time.monotonic())
                return
            await self._read(body)
        finally:
            writer.close()

    async def _read(self, body: AsyncIterator[bytes]) -> None:
        event_type, id_buffer, pending = "", self.last_event_id, b""
        data: list[str] = []
        async for chunk in body:
            buffer = pending + chunk
            # A CR that ends the buffer may be the first half of a CRLF: keep it back.
            cut = len(buffer) - 1 if buffer.endswith(b"\r") else len(buffer)
            *lines, pending = LINE_END.split(buffer[:cut])
            pending += buffer[cut:]
            for raw in lines:
                line = raw.decode()
                if line == "":
                    self.last_event_id = id_buffer
                    if data:
                        event = Received(
                            event_type or "message", "\n".join(data), id_buffer, time.monotonic()
                        )
                        self.events.append(event)
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

    def after(self, since: float) -> list[Received]:
        return [event for event in self.events if event.at >= since]


async def _body(reader: asyncio.StreamReader, head: dict[str, str]) -> AsyncIterator[bytes]:
    """The body's bytes as they come: chunked, of a length, or to the connection's end."""
    if head.get("transfer-encoding", "").lower() == "chunked":
        while size := int((await reader.readline()).split(b";")[0], 16):
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the chunk's CRLF
    elif "content-length" in head:
        yield await reader.readexactly(int(head["content-length"]))
    else:
        while chunk := await reader.read(65536):
            yield chunk
