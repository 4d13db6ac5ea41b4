"""gateway/server/http1.py: a response's head goes out with the start of its body, in one
write, when the body is sent in the same turn of the event loop, and never waits for a
later one. A real uvicorn server with the gateway's protocol, real clients; the socket's
writes are read through a pass-through log."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
import websockets
from litestar.types import Receive, Scope, Send

from gateway.server.http1 import HttpProtocol


class WriteLog:
    """A socket's transport, passed through, with every write it was given."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.inner.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


LOGS: list[WriteLog] = []


class LoggedProtocol(HttpProtocol):
    def connection_made(self, transport: Any) -> None:
        LOGS.append(WriteLog(transport))
        super().connection_made(LOGS[-1])


class App:
    """Answers: ``/whole`` a JSON body; ``/stream`` a head and a chunk at once, then a
    last one; ``/wait`` a head, then a chunk once ``go`` is set; ``/ws`` echoes."""

    def __init__(self) -> None:
        self.go = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return
        if scope["type"] == "websocket":
            await receive()  # connect
            await send({"type": "websocket.accept"})
            message = await receive()
            await send({"type": "websocket.send", "text": "echo " + message["text"]})
            await send({"type": "websocket.close", "code": 1000})
            return
        body = await receive()
        if scope["path"] == "/whole":
            answer = json.dumps({"read": body["body"].decode()}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-length", str(len(answer)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": answer})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/wait":
            await self.go.wait()
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"last"})


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, App]]:
    LOGS.clear()
    app = App()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app, http=LoggedProtocol, lifespan="off", log_config=None, timeout_graceful_shutdown=2
    )
    running = uvicorn.Server(config)
    task = asyncio.create_task(running.serve(sockets=[sock]))
    while not running.started:
        await asyncio.sleep(0.01)
    host, port = sock.getsockname()
    yield f"{host}:{port}", app
    running.should_exit = True
    await task
    sock.close()


def http_writes() -> list[bytes]:
    (log,) = LOGS
    return log.writes


async def test_a_whole_answer_goes_out_in_one_write(server: tuple[str, App]) -> None:
    address, _ = server
    async with httpx.AsyncClient(base_url=f"http://{address}") as client:
        answer = await client.post("/whole", content=b"hi")
    assert answer.json() == {"read": "hi"}
    (write,) = http_writes()
    assert write.startswith(b"HTTP/1.1 200 OK\r\n") and write.endswith(b'{"read": "hi"}')


async def test_a_streams_head_goes_with_its_first_chunk(server: tuple[str, App]) -> None:
    address, _ = server
    async with httpx.AsyncClient(base_url=f"http://{address}") as client:
        answer = await client.post("/stream", content=b"hi")
    assert answer.content == b"firstlast"
    first, last = http_writes()
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and first.endswith(b"5\r\nfirst\r\n")
    assert last == b"4\r\nlast\r\n0\r\n\r\n"


async def test_a_head_nothing_follows_reaches_the_client_on_its_own(
    server: tuple[str, App],
) -> None:
    """The body waits for the client to have the head: a head held for its body would
    never come. (A stream's head held for its first token costs its time to it.)"""
    address, app = server
    async with (
        httpx.AsyncClient(base_url=f"http://{address}", timeout=5) as client,
        client.stream("POST", "/wait", content=b"hi") as answer,
    ):
        assert answer.status_code == 200
        app.go.set()
        assert await answer.aread() == b"firstlast"
    head, first, _ = http_writes()
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
    assert first == b"5\r\nfirst\r\n"


async def test_a_response_without_a_body_write_is_its_head_alone(
    server: tuple[str, App],
) -> None:
    """A HEAD request's answer: its head, written at the end of the turn; the connection
    serves the next request."""
    address, _ = server
    async with httpx.AsyncClient(base_url=f"http://{address}", timeout=5) as client:
        answer = await client.head("/whole")
        assert answer.status_code == 200
        assert answer.headers["content-length"] == "12"  # {"read": ""}
        again = await client.post("/whole", content=b"hi")  # the same connection
    assert again.json() == {"read": "hi"}
    head, whole = http_writes()
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
    assert whole.endswith(b'{"read": "hi"}')


async def test_a_100_continue_goes_out_before_the_body_is_read(
    server: tuple[str, App],
) -> None:
    """The client sends its body only once it has the interim answer, a write of its own."""
    address, _ = server
    host, port = address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /whole HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n"
    )
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"hi")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert await reader.readexactly(14) == b'{"read": "hi"}'
    writer.close()
    await writer.wait_closed()
    interim_write, answer_write = http_writes()
    assert interim_write == interim and answer_write.startswith(b"HTTP/1.1 200 OK\r\n")


async def test_a_websocket_upgrade_hands_the_socket_on(server: tuple[str, App]) -> None:
    """After the upgrade the WebSocket protocol reads and writes the socket."""
    address, _ = server
    async with websockets.connect(f"ws://{address}/ws", open_timeout=5) as ws:
        await ws.send("hi")
        assert await asyncio.wait_for(ws.recv(), 5) == "echo hi"
