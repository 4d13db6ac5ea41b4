"""The load generator: N concurrent token streams, each token's arrival time recorded.

Three readers, one per mode, all on the same engine and the same token schedule:

- ``gateway``: SSE from tokenspout (``GET /v1/sessions/{id}/events``), the message sent with
  ``POST /v1/sessions/{id}/messages``;
- ``direct``: no gateway; the session's live channel read straight from Redis over one
  pub/sub connection for all streams (what the gateway's relay itself reads), the message
  submitted with ``SessionStore`` (the same Redis scripts the gateway runs);
- ``reference``: the reference relay (bench/reference_relay.py) over SSE, the message
  submitted with ``SessionStore``;
- ``ws``: tokenspout's WebSocket (``WS /v1/ws``), one socket per stream, one ``generate``
  frame (which also makes the session) per stream.

The clients are plain asyncio protocols (HTTP/1.1 with chunked decoding, RESP2 pub/sub), so
one load-generator core can read thousands of streams; a token's arrival time is the
``perf_counter`` of the ``data_received`` call that completed its frame.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

TERMINAL = (b"done", b"cancelled", b"error")


@dataclass
class StreamRecord:
    """One stream: when its message was sent, when each token arrived, how it ended."""

    opened_at: float = 0.0
    submitted_at: float = 0.0
    accepted_at: float = 0.0
    """When the submit call returned (the gateway's 202, or the Redis script's reply)."""
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

    def on_event(self, event_type: bytes, now: float, count: int | None = None) -> None:
        """``count``: the token event's count (tokens so far): an event may carry several
        (an engine step that made more than one, or the worker joining tokens while Redis
        was behind), and each is counted, arriving now."""
        if event_type == b"token":
            self.arrive(now, count)
        elif event_type in TERMINAL:
            self.end(final=event_type.decode())

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

    def __init__(self, request: bytes, record: StreamRecord) -> None:
        self.request = request
        self.record = record
        self.transport: asyncio.Transport | None = None
        self._raw = b""
        self._body = b""
        self._headers_done = False
        self._chunked = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def connection_lost(self, exc: Exception | None) -> None:
        self.record.end(failure=f"connection closed ({exc})")

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
            if self.record.final is not None or self.record.failure is not None:
                self.close()

    def on_frame(self, frame: bytes, now: float) -> None:
        """One SSE frame (without its blank line): a session event names its type."""
        start = frame.find(b"event: ")
        if start >= 0:
            stop = frame.find(b"\n", start)
            event_type = frame[start + 7 : stop]
            count = number_after(frame, b'"count":') if event_type == b"token" else None
            self.record.on_event(event_type, now, count)

    def _dechunk(self) -> None:
        raw, pos, parts = self._raw, 0, [self._body]
        while True:
            line_end = raw.find(b"\r\n", pos)
            if line_end < 0:
                break
            size = int(raw[pos:line_end].split(b";")[0], 16)
            if size == 0:
                pos = len(raw)
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


def post_request(host: str, port: int, path: str, body: bytes) -> bytes:
    head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Accept: text/event-stream"]
    head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def open_chat_stream(host: str, port: int, body: bytes, record: StreamRecord) -> OpenAIStream:
    """Send one streaming chat completion; ``record.submitted_at`` is set just before the
    connection opens (a new client's first request pays its connect, on either path)."""
    loop = asyncio.get_running_loop()
    record.ready = loop.create_future()
    record.finished = loop.create_future()
    record.opened_at = record.submitted_at = time.perf_counter()
    request = post_request(host, port, "/v1/chat/completions", body)
    _, protocol = await loop.create_connection(lambda: OpenAIStream(request, record), host, port)
    return protocol


async def open_responses_stream(
    host: str, port: int, body: bytes, record: StreamRecord
) -> ResponsesStream:
    """Send one streaming ``/v1/responses`` request, timed as ``open_chat_stream``."""
    loop = asyncio.get_running_loop()
    record.ready = loop.create_future()
    record.finished = loop.create_future()
    record.opened_at = record.submitted_at = time.perf_counter()
    request = post_request(host, port, "/v1/responses", body)
    _, protocol = await loop.create_connection(lambda: ResponsesStream(request, record), host, port)
    return protocol


def get_request(host: str, port: int, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}", "Accept: text/event-stream"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def open_sse(
    host: str, port: int, path: str, headers: dict[str, str], record: StreamRecord
) -> SSEStream:
    loop = asyncio.get_running_loop()
    record.ready = loop.create_future()
    record.finished = loop.create_future()
    record.opened_at = time.perf_counter()
    _, protocol = await loop.create_connection(
        lambda: SSEStream(get_request(host, port, path, headers), record), host, port
    )
    return protocol


class PubSubReader(asyncio.Protocol):
    """The no-gateway baseline: one RESP2 pub/sub connection, a channel per stream.

    A live message is ``<entry id> <type> <generation id> <json>`` (wire/scripts.py), so
    the event type is the second word of the payload.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.records: dict[bytes, StreamRecord] = {}
        self._buffer = b""
        self._confirmations: dict[bytes, asyncio.Future[None]] = {}
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        for record in self.records.values():
            record.end(failure=f"pub/sub connection closed ({exc})")
        if not self.closed.done():
            self.closed.set_result(None)

    async def subscribe(self, channel: str, record: StreamRecord) -> None:
        assert self.transport is not None
        name = channel.encode()
        loop = asyncio.get_running_loop()
        record.finished = loop.create_future()
        record.opened_at = time.perf_counter()
        self.records[name] = record
        confirmed = self._confirmations[name] = loop.create_future()
        self.transport.write(b"*2\r\n$9\r\nSUBSCRIBE\r\n$%d\r\n%s\r\n" % (len(name), name))
        await confirmed

    def unsubscribe_all(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        buffer = self._buffer + data
        pos = 0
        while True:
            parsed = _parse_array(buffer, pos)
            if parsed is None:
                break
            items, pos = parsed
            kind, channel = items[0], items[1]
            if kind == b"message":
                record = self.records.get(channel)
                payload = items[2]
                assert isinstance(payload, bytes)
                if record is not None:
                    kind = payload.split(b" ", 2)[1]
                    count = number_after(payload, b'"count":') if kind == b"token" else None
                    record.on_event(kind, now, count)
            elif kind == b"subscribe":
                confirmed = self._confirmations.pop(channel, None)  # type: ignore[arg-type]
                if confirmed is not None and not confirmed.done():
                    confirmed.set_result(None)
        self._buffer = buffer[pos:]


def _parse_array(buffer: bytes, pos: int) -> tuple[list[bytes | int], int] | None:
    """One RESP2 array of bulk strings and integers at ``pos``, or None if incomplete."""
    end = buffer.find(b"\r\n", pos)
    if end < 0:
        return None
    if buffer[pos : pos + 1] != b"*":
        raise ValueError(f"unexpected RESP reply {buffer[pos : pos + 40]!r}")
    count = int(buffer[pos + 1 : end])
    pos = end + 2
    items: list[bytes | int] = []
    for _ in range(count):
        end = buffer.find(b"\r\n", pos)
        if end < 0:
            return None
        marker = buffer[pos : pos + 1]
        if marker == b":":
            items.append(int(buffer[pos + 1 : end]))
            pos = end + 2
        elif marker == b"$":
            size = int(buffer[pos + 1 : end])
            if len(buffer) < end + 2 + size + 2:
                return None
            items.append(buffer[end + 2 : end + 2 + size])
            pos = end + 2 + size + 2
        else:
            raise ValueError(f"unexpected RESP item {buffer[pos : pos + 40]!r}")
    return items, pos


async def open_pubsub(host: str, port: int) -> PubSubReader:
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_connection(PubSubReader, host, port)
    return protocol


class HTTPPool:
    """Keep-alive HTTP/1.1 connections for the load generator's POSTs (no client library:
    httpx costs the load-generator core about a millisecond per request)."""

    def __init__(self, host: str, port: int, size: int = 64) -> None:
        self.host, self.port = host, port
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._gate = asyncio.Semaphore(size)

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        lines = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        request = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
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


async def read_ws(conn: Any, record: StreamRecord, ack: asyncio.Future[dict[str, Any]]) -> None:
    """Frames of one WebSocket generation: the ack, then tokens (``count`` says how many a
    coalesced frame holds), until the final frame."""
    seen = 0
    async for raw in conn:
        now = time.perf_counter()
        frame = json.loads(raw)
        kind = frame["type"]
        if kind == "token":
            record.arrivals.extend([now] * max(1, frame["count"] - seen))
            seen = frame["count"]
        elif kind == "ack" and not ack.done():
            ack.set_result(frame)
        elif kind == "error" and "event_id" not in frame:
            record.end(failure=f"refused: {frame.get('message')}")
            if not ack.done():
                ack.set_exception(RuntimeError(f"generate refused: {frame}"))
            return
        elif kind.encode() in TERMINAL:
            record.end(final=kind)
            return
    record.end(failure="WebSocket closed")
