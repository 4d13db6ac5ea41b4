"""The Server-Sent Events wire format, in one place.

Litestar's ``ServerSentEvent`` encodes one message per write. A gateway relaying thousands
of streams writes every event that is ready in one chunk instead, so this module builds the
frames itself (the data is compact JSON, which never holds a line break) and hands Litestar a
plain ``Stream`` with the headers ``ServerSentEvent`` would set.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable

from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from gateway.relay import RelayEvent

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


def retry(milliseconds: int) -> bytes:
    return b"retry: %d\n\n" % milliseconds


def comment(text: str) -> bytes:
    return b": " + text.replace("\n", " ").encode() + b"\n\n"


def response(
    chunks: AsyncIterable[bytes],
    status_code: int = 200,
    background: BackgroundTask | None = None,
) -> Stream:
    """``background`` runs when the response ends, also when the client disconnected."""
    return Stream(
        chunks,
        media_type="text/event-stream",
        headers=dict(HEADERS),
        status_code=status_code,
        background=background,
    )
