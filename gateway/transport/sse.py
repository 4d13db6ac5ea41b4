"""The Server-Sent Events wire format, in one place.

Litestar's ``ServerSentEvent`` encodes one message per write. A gateway relaying thousands
of streams writes every event that is ready in one chunk instead, so this module builds the
frames itself (the data is compact JSON, which never holds a line break) and hands Litestar a
``Stream`` with the headers ``ServerSentEvent`` would set.

That ``Stream`` is also lighter per open stream than Litestar's: see ``LeanStreamingResponse``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

import msgspec
from litestar.background_tasks import BackgroundTask, BackgroundTasks
from litestar.connection import Request
from litestar.datastructures.cookie import Cookie
from litestar.enums import MediaType
from litestar.response import Stream
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse
from litestar.types import HTTPResponseBodyEvent, Receive, Send, TypeEncodersMap

from gateway.core.relay.feed import RelayEvent
from gateway.core.walk import Spelling

HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
    "Connection": "keep-alive",
}
HEARTBEAT = b": keep-alive\n\n"


def frame(data: bytes, event: str | None = None, event_id: str | None = None) -> bytes:
    head = b""
    if event_id is not None:
        head += b"id: " + event_id.encode() + b"\n"
    if event is not None:
        head += b"event: " + event.encode() + b"\n"
    return head + b"data: " + data + b"\n\n"


def session_frames(events: Iterable[RelayEvent]) -> bytes:
    """Session events as SSE: the stream entry id is the ``id:``, the type the ``event:``."""
    return b"".join(
        b"id: %s\nevent: %s\ndata: %s\n\n" % (e.id.encode(), e.type.encode(), e.data)
        for e in events
    )


def events_lost(given: str, message: str) -> bytes:
    """The ``events_lost`` event: the reader's resume point ``given`` is ahead of the
    stream. Its empty ``id:`` clears an EventSource's last event id, so that its next
    reconnect, too, reads from the beginning instead of sending ``given`` again."""
    data = msgspec.json.encode({"type": "events_lost", "last_event_id": given, "message": message})
    return b"id:\n" + frame(data, event="events_lost")


class Last(bytes):
    """A stream's last chunk: ``LeanStreamingResponse`` sends it with the response's end,
    one write on the socket where there were two (uvicorn writes the chunked body's end
    marker with the last chunk when they come in one message). Nothing may follow it."""

    __slots__ = ()


class SseSpelling(Spelling[bytes, bytes]):
    """A spelling whose pieces are SSE frames: a heartbeat is a comment line, what arrived
    together is one write, the last one a ``Last``."""

    def heartbeat(self, out: list[bytes]) -> None:
        out.append(HEARTBEAT)

    def write(self, out: list[bytes], last: bool) -> bytes:
        chunk = out[0] if len(out) == 1 else b"".join(out)
        return Last(chunk) if last else chunk


def json_frame(body: object) -> bytes:
    """One ``data:`` frame of ``body`` as compact JSON."""
    return frame(msgspec.json.encode(body))


def retry(milliseconds: int) -> bytes:
    return b"retry: %d\n\n" % milliseconds


def comment(text: str) -> bytes:
    return b": " + text.replace("\n", " ").encode() + b"\n\n"


class LeanStreamingResponse(ASGIStreamingResponse):
    """Litestar's streaming response, with one task per stream instead of a task group.

    Litestar streams from a task of an anyio task group while the request's task waits for
    the client to disconnect. Here the request's own task writes the chunks, and one small
    task waits for the disconnect and cancels it. At 10,000 open streams that is a task, a
    task group and a cancel scope fewer each: less memory per stream and less work per wait.
    """

    __slots__ = ()

    async def send_body(self, send: Send, receive: Receive) -> None:
        await send_stream(self.iterator, send, receive, self.encoding)


async def send_stream(
    iterator: AsyncIterable[bytes | str], send: Send, receive: Receive, encoding: str = "utf-8"
) -> None:
    """Send a streamed body's chunks (a ``Last`` with the response's end) while a small
    task waits for the client to disconnect and cancels the sending."""
    streaming = asyncio.current_task()
    assert streaming is not None
    disconnected = False

    async def wait_for_disconnect() -> None:
        nonlocal disconnected
        while (await receive())["type"] != "http.disconnect":
            pass
        disconnected = True
        streaming.cancel()

    watcher = asyncio.create_task(wait_for_disconnect())
    try:
        last = False
        async for chunk in iterator:  # to its end, after a Last too: nothing left open
            if last:
                raise RuntimeError("a stream went on after its Last chunk")
            body = chunk if isinstance(chunk, bytes) else chunk.encode(encoding)
            last = isinstance(chunk, Last)
            event: HTTPResponseBodyEvent = {
                "type": "http.response.body",
                "body": body,
                "more_body": not last,
            }
            await send(event)
        if not last:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if not disconnected:
            raise
        streaming.uncancel()  # the client left: the response simply ends
    finally:
        watcher.cancel()
        await asyncio.wait({watcher})  # not `await watcher`: a cancel of ours must propagate
        if isinstance(iterator, AsyncIterator) and hasattr(iterator, "aclose"):
            await iterator.aclose()


class EventStream(Stream):
    """A ``Stream`` served by ``LeanStreamingResponse``."""

    def to_asgi_response(
        self,
        app: Any,
        request: Request[Any, Any, Any],
        *,
        background: BackgroundTask | BackgroundTasks | None = None,
        cookies: Iterable[Cookie] | None = None,
        encoded_headers: Iterable[tuple[bytes, bytes]] | None = None,
        headers: dict[str, str] | None = None,
        is_head_response: bool = False,
        media_type: MediaType | str | None = None,
        status_code: int | None = None,
        type_encoders: TypeEncodersMap | None = None,
    ) -> ASGIResponse:
        return LeanStreamingResponse(
            background=self.background or background,
            content_length=0,
            cookies=[*self.cookies, *(cookies or ())],
            encoded_headers=encoded_headers,
            encoding=self.encoding,
            headers={**(headers or {}), **self.headers},
            is_head_response=is_head_response,
            iterator=self.iterator,  # type: ignore[arg-type]
            media_type=str(self.media_type),
            status_code=self.status_code or status_code,
        )


def response(
    chunks: AsyncIterable[bytes],
    status_code: int = 200,
    background: BackgroundTask | None = None,
) -> Stream:
    """``background`` runs when the response ends, also when the client disconnected."""
    return EventStream(
        chunks,
        media_type="text/event-stream",
        headers=dict(HEADERS),
        status_code=status_code,
        background=background,
    )
