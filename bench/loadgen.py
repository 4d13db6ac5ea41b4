"""The load generator's readers: N concurrent token streams, each token's arrival time recorded.

Plain asyncio protocols (HTTP/1.1 with chunked decoding), so one load-generator core can
read thousands of streams: ``SSEStream`` counts a session's ``token`` events, ``OpenAIStream``
a chat completion's chunks, ``ResponsesStream`` a Responses stream's text deltas; a token's
arrival time is the ``perf_counter`` of the ``data_received`` call that completed its frame.
``HTTPPool`` sends the POSTs on kept-alive connections; ``sse_events`` parses an httpx
response for the scripts that read with httpx.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import cast

import httpx

TERMINAL = (b"done", b"cancelled", b"error")


@dataclass
class StreamRecord:
    """One stream: when its message was sent, when each token arrived, how it ended."""

    submitted_at: float = 0.0
    accepted_at: float = 0.0
    """When the gateway accepted the message (the session API's 202, the WebSocket's ack)."""
    headers_at: float = 0.0
    """When the response's headers arrived (SSE readers)."""
    arrivals: list[float] = field(default_factory=list)
    final: str | None = None
    failure: str | None = None
    finished: asyncio.Future[None] | None = None
    ready: asyncio.Future[None] | None = None

    def end(self, final: str | None = None, failure: str | None = None) -> None:
        if self.final is None and self.failure is None:
            self.final, self.failure = final, failure
        for future in (self.ready, self.finished):
            if future is not None and not future.done():
                future.set_result(None)

    def arrive(self, now: float, count: int | None) -> None:
        """Tokens arrived: one (``count`` None), or as many as make ``count`` in all."""
        if count is None:
            self.arrivals.append(now)
        elif count > len(self.arrivals):
            self.arrivals.extend([now] * (count - len(self.arrivals)))


def number_after(data: bytes, key: bytes) -> int | None:
    """The integer after ``key`` (``b'"count":'``) in some JSON; None when it is not there."""
    start = data.find(key)
    if start < 0:
        return None
    start = end = start + len(key)
    while data[end : end + 1].isdigit():
        end += 1
    return int(data[start:end]) if end > start else None


class SSEStream(asyncio.Protocol):
    """One ``GET`` of an event stream; counts ``token`` frames and stops at a final one."""

    def __init__(self, request: bytes, record: StreamRecord, keep_alive: bool = False) -> None:
        self.request = request
        self.record = record
        self.keep_alive = keep_alive
        """Keep the connection after the final frame, for ``again`` (``answered`` tells
        when the response has ended)."""
        self.answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self._raw = b""
        self._body = b""
        self._headers_done = False
        self._chunked = False

    def again(self, record: StreamRecord) -> None:
        """Send the request once more on this kept-alive connection, into ``record``."""
        assert self.transport is not None and self.answered.done()
        self.record = record
        self.answered = asyncio.get_running_loop().create_future()
        self._raw, self._body = b"", b""
        self._headers_done = self._chunked = False
        _arm(record)
        self.transport.write(self.request)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream's transport (uvloop's is no subclass of asyncio.Transport: the load
        # processes of bench.gpu run on uvloop).
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(self.request)

    def connection_lost(self, exc: Exception | None) -> None:
        self.record.end(failure=f"connection closed ({exc})")
        if not self.answered.done():
            self.answered.set_result(None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self._raw += data
        if not self._headers_done:
            end = self._raw.find(b"\r\n\r\n")
            if end < 0:
                return
            head, self._raw = self._raw[:end].lower(), self._raw[end + 4 :]
            status = head.split(b" ", 2)[1]
            if status != b"200":
                self.record.end(failure=f"HTTP {status.decode()}")
                self.close()
                return
            self._headers_done = True
            self.record.headers_at = now
            self._chunked = b"transfer-encoding: chunked" in head
            if self.record.ready is not None and not self.record.ready.done():
                self.record.ready.set_result(None)
        if self._chunked:
            self._dechunk()
        else:
            self._body += self._raw
            self._raw = b""
        if b"\n\n" in self._body:
            *frames, self._body = self._body.split(b"\n\n")
            for frame in frames:
                self.on_frame(frame, now)
            ended = self.record.final is not None or self.record.failure is not None
            if ended and not self.keep_alive:
                self.close()

    def on_frame(self, frame: bytes, now: float) -> None:
        """One SSE frame (without its blank line): a session event names its type. A token
        event may carry several tokens (an engine step that made more than one, or the worker
        joining tokens while Redis was behind): its ``count`` (tokens so far) says how many."""
        start = frame.find(b"event: ")
        if start >= 0:
            kind = frame[start + 7 : frame.find(b"\n", start)]
            if kind == b"token":
                self.record.arrive(now, number_after(frame, b'"count":'))
            elif kind in TERMINAL:
                self.record.end(final=kind.decode())

    def _dechunk(self) -> None:
        raw, pos, parts = self._raw, 0, [self._body]
        while True:
            line_end = raw.find(b"\r\n", pos)
            if line_end < 0:
                break
            size = int(raw[pos:line_end].split(b";")[0], 16)
            if size == 0:  # the response's last chunk
                pos = len(raw)
                if not self.answered.done():
                    self.answered.set_result(None)
                break
            if len(raw) < line_end + 2 + size + 2:
                break
            parts.append(raw[line_end + 2 : line_end + 2 + size])
            pos = line_end + 2 + size + 2
        self._raw = raw[pos:]
        self._body = b"".join(parts)


class OpenAIStream(SSEStream):
    """One ``POST /v1/chat/completions`` with ``stream: true``: a chunk whose delta has
    content is a token, ``data: [DONE]`` ends the stream, an ``{"error": ...}`` chunk fails
    it. A chunk may carry several tokens (the worker joins a reply's tokens while Redis is
    behind) and says nothing of how many: the usage chunk at the end
    (``stream_options.include_usage``) gives the count, and the tokens it adds are counted
    as arriving with it."""

    def on_frame(self, frame: bytes, now: float) -> None:
        if not frame.startswith(b"data: "):
            return  # a comment (heartbeat)
        if frame.startswith(b"data: [DONE]"):
            self.record.end(final="done")
        elif frame.startswith(b'data: {"error"'):
            self.record.end(failure=frame[6:200].decode(errors="replace"))
        elif b'"content":"' in frame and b'"content":""' not in frame:
            self.record.arrivals.append(now)
        elif (tokens := number_after(frame, b'"completion_tokens":')) is not None:
            self.record.arrive(now, tokens)


class ResponsesStream(SSEStream):
    """One ``POST /v1/responses`` with ``stream: true``: each ``response.output_text.delta``
    is a token (or an engine step's several: the final event's usage counts them, arriving
    with it); ``response.completed`` or ``.incomplete`` ends it, ``.failed`` or an ``error``
    event fails it."""

    def on_frame(self, frame: bytes, now: float) -> None:
        if not frame.startswith(b"event: "):
            return  # a comment (heartbeat)
        kind = frame[7 : frame.find(b"\n")]
        if kind == b"response.output_text.delta":
            self.record.arrivals.append(now)
        elif kind in (b"response.completed", b"response.incomplete"):
            self.record.arrive(now, number_after(frame, b'"output_tokens":'))
            self.record.end(final="done")
        elif kind in (b"response.failed", b"error"):
            self.record.end(failure=frame[:200].decode(errors="replace"))


def http_request(
    method: str, host: str, port: int, path: str, headers: dict[str, str], body: bytes = b""
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if method == "POST":
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def sse_request(
    host: str, port: int, path: str, headers: dict[str, str], body: bytes = b""
) -> bytes:
    """A GET (or, with a body, a POST) that asks for an event stream."""
    method = "POST" if body else "GET"
    return http_request(method, host, port, path, {"Accept": "text/event-stream", **headers}, body)


async def open_stream(
    host: str,
    port: int,
    request: bytes,
    record: StreamRecord,
    kind: type[SSEStream] = SSEStream,
    keep_alive: bool = False,
) -> SSEStream:
    """Send ``request`` on a new connection and read its event stream as ``kind``;
    ``record.submitted_at`` is just before the connection opens (a new client's first request
    pays its connect, on every path; the session API's is its message's POST).
    ``keep_alive``: the connection stays open after the response, for ``SSEStream.again``."""
    _arm(record)
    _, protocol = await asyncio.get_running_loop().create_connection(
        lambda: kind(request, record, keep_alive), host, port
    )
    return protocol


def _arm(record: StreamRecord) -> None:
    """``record``'s futures, and its clock started: the request goes now."""
    loop = asyncio.get_running_loop()
    record.ready = loop.create_future()
    record.finished = loop.create_future()
    record.submitted_at = time.perf_counter()


async def sse_events(response: httpx.Response) -> AsyncIterator[tuple[str, str, str]]:
    """(id, event, data) of an httpx SSE response, comments skipped: for the scripts that
    read with httpx (bench.takeover, bench.chaos)."""
    event_id, event, data = "", "message", list[str]()
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield event_id, event, "\n".join(data)
            event_id, event, data = "", "message", list[str]()
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                data.append(value)
            elif name == "event":
                event = value
            elif name == "id":
                event_id = value


class TaskStream:
    """A stream read by a task of its own (gRPC, WebSocket); ``close`` cancels it."""

    def __init__(self, task: asyncio.Task[None]) -> None:
        self.task = task

    def close(self) -> None:
        self.task.cancel()


class HTTPPool:
    """Keep-alive HTTP/1.1 connections for the load generator's POSTs (no client library:
    httpx costs the load-generator core about a millisecond per request)."""

    def __init__(self, host: str, port: int, size: int = 64) -> None:
        self.host, self.port = host, port
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._gate = asyncio.Semaphore(size)

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        request = http_request("POST", self.host, self.port, path, headers, body)
        async with self._gate:
            for attempt in range(2):
                reader, writer = await self._connection()
                try:
                    writer.write(request)
                    status, reply = await self._read(reader)
                except (ConnectionError, asyncio.IncompleteReadError):
                    writer.close()
                    if attempt:
                        raise
                    continue  # a kept-alive connection the server had closed: once more
                self._idle.append((reader, writer))
                return status, reply
        raise AssertionError("unreachable")

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return await asyncio.open_connection(self.host, self.port)

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> tuple[int, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.lower().split(b"\r\n"):
            if line.startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        return status, await reader.readexactly(length)

    def close(self) -> None:
        for _reader, writer in self._idle:
            writer.close()
        self._idle.clear()
