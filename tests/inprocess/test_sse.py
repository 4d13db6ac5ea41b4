"""gateway/transport/sse.py: the SSE wire format, and ``LeanStreamingResponse`` driven through a
tiny ASGI receive/send pair."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from litestar.types import Message

from gateway.core.relay.feed import RelayEvent
from gateway.transport import sse


def test_frame_is_data_alone_or_with_id_and_event_first() -> None:
    assert sse.frame(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert sse.frame(b"x", event="token") == b"event: token\ndata: x\n\n"
    assert sse.frame(b"x", event_id="5-0") == b"id: 5-0\ndata: x\n\n"
    assert sse.frame(b"x", "done", "7-1") == b"id: 7-1\nevent: done\ndata: x\n\n"


def test_session_frames_write_every_event_in_one_chunk() -> None:
    events = [
        RelayEvent("1-0", "queued", "g1", b'{"type":"queued"}'),
        RelayEvent("1-1", "token", "g1", b'{"text":"hi"}'),
    ]
    assert sse.session_frames(events) == (
        b'id: 1-0\nevent: queued\ndata: {"type":"queued"}\n\n'
        b'id: 1-1\nevent: token\ndata: {"text":"hi"}\n\n'
    )
    assert sse.session_frames([]) == b""


def test_retry_and_comment_frames() -> None:
    assert sse.retry(1500) == b"retry: 1500\n\n"
    assert sse.comment("hello") == b": hello\n\n"
    # A line break would end the comment and start a field: it becomes a space.
    assert sse.comment("two\nlines") == b": two lines\n\n"
    assert sse.HEARTBEAT == b": keep-alive\n\n"


def test_response_sets_event_stream_headers() -> None:
    async def nothing() -> AsyncIterator[bytes]:
        yield b""

    chunks = nothing()
    stream = sse.response(chunks, status_code=201)
    assert stream.media_type == "text/event-stream"
    assert stream.status_code == 201
    assert stream.headers == {
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
        "Connection": "keep-alive",
    }


class Client:
    """Both ends of an ASGI connection for one streamed response."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.incoming: asyncio.Queue[Message] = asyncio.Queue()
        self.chunk_sent = asyncio.Event()

    async def receive(self) -> Message:
        return await self.incoming.get()

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body":
            self.chunk_sent.set()

    def bodies(self) -> list[tuple[bytes, bool]]:
        return [(m["body"], m["more_body"]) for m in self.sent if m["type"] == "http.response.body"]


class Source:
    """An async generator of chunks that records being closed, and waits when told."""

    def __init__(self, chunks: list[bytes | str], then_wait: bool) -> None:
        self.chunks = chunks
        self.then_wait = then_wait
        self.closed = False

    async def __call__(self) -> AsyncIterator[bytes | str]:
        try:
            for chunk in self.chunks:
                yield chunk
            if self.then_wait:
                await asyncio.Event().wait()  # a stream with nothing more to say yet
        finally:
            self.closed = True


def lean(iterator: AsyncIterator[bytes | str]) -> sse.LeanStreamingResponse:
    return sse.LeanStreamingResponse(iterator=iterator, media_type="text/event-stream")


async def test_a_stream_writes_each_chunk_then_an_empty_final_body() -> None:
    client = Client()
    source = Source([b"data: 1\n\n", "data: é\n\n"], then_wait=False)
    await lean(source()).send_body(client.send, client.receive)
    assert client.bodies() == [
        (b"data: 1\n\n", True),
        ("data: é\n\n".encode(), True),
        (b"", False),
    ]
    assert source.closed


async def test_a_last_chunk_goes_with_the_end_and_nothing_may_follow_it() -> None:
    client = Client()
    source = Source([b"data: 1\n\n", sse.Last(b"data: [DONE]\n\n")], then_wait=False)
    await lean(source()).send_body(client.send, client.receive)
    assert client.bodies() == [(b"data: 1\n\n", True), (b"data: [DONE]\n\n", False)]
    assert source.closed  # read to its end

    client = Client()
    after = Source([sse.Last(b"data: [DONE]\n\n"), b"data: late\n\n"], then_wait=False)
    with pytest.raises(RuntimeError, match="after its Last"):
        await lean(after()).send_body(client.send, client.receive)
    assert client.bodies() == [(b"data: [DONE]\n\n", False)] and after.closed


async def test_a_client_disconnect_ends_the_response_quietly_and_closes_the_source() -> None:
    client = Client()
    source = Source([b"data: 1\n\n"], then_wait=True)
    sending = asyncio.create_task(lean(source()).send_body(client.send, client.receive))
    await client.chunk_sent.wait()
    client.incoming.put_nowait({"type": "http.disconnect"})
    await sending  # returns, no CancelledError: the client left, the response simply ends
    assert not sending.cancelled()
    assert client.bodies() == [(b"data: 1\n\n", True)]  # no final body to a gone client
    assert source.closed
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0


async def test_other_messages_before_the_disconnect_are_ignored() -> None:
    client = Client()
    source = Source([b"a"], then_wait=True)
    sending = asyncio.create_task(lean(source()).send_body(client.send, client.receive))
    await client.chunk_sent.wait()
    client.incoming.put_nowait({"type": "http.request", "body": b"", "more_body": False})
    client.incoming.put_nowait({"type": "http.disconnect"})
    await asyncio.wait_for(sending, 5)
    assert client.bodies() == [(b"a", True)]
    assert source.closed


async def test_a_cancel_from_outside_propagates_and_still_closes_the_source() -> None:
    client = Client()
    source = Source([b"a"], then_wait=True)
    sending = asyncio.create_task(lean(source()).send_body(client.send, client.receive))
    await client.chunk_sent.wait()
    sending.cancel()  # the server shutting down, say: not the client leaving
    with pytest.raises(asyncio.CancelledError):
        await sending
    assert source.closed
    assert client.bodies() == [(b"a", True)]


async def test_a_failing_source_raises_through_and_stops_the_watcher() -> None:
    client = Client()

    async def failing() -> AsyncIterator[bytes]:
        yield b"a"
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await lean(failing()).send_body(client.send, client.receive)
    assert client.bodies() == [(b"a", True)]
    # The disconnect watcher ended with it (the autouse guard fails a leaked task too).
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
