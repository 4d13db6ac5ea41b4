"""gateway/transport/http2.py, the gateway's gRPC server, against grpcio's own client (the C
core every gRPC client in the Triton family sits on): statuses, deadlines, cancels, flow
control, a slow reader and the drain, with methods of the test's own in one process."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import httpx
import pytest

from gateway.transport.http2 import Call, GrpcError, GrpcServerCore, Method, StatusCode

pytestmark = pytest.mark.timeout(60)

MAX_MESSAGE = 1 << 20
BIG = 300_000
"""A message over HTTP/2's default frame (16 KB) and window (64 KB): split and paced."""
CLEAN_UP_S = 1.0
"""Long enough that the client's reset lands inside a deadline's clean-up."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Methods:
    """The test's methods, and what they saw."""

    def __init__(self) -> None:
        self.cancelled: asyncio.Event = asyncio.Event()
        self.cleaned_up: asyncio.Event = asyncio.Event()
        self.sent = 0

    async def echo(self, call: Call) -> None:
        """Each request back, then one more saying how many; the metadata's ``x-tag``."""
        count = 0
        while (message := await call.receive()) is not None:
            count += 1
            await call.send(message)
        await call.send(f"{count} {call.metadata.get('x-tag', '')}".encode())

    async def refuse(self, call: Call) -> None:
        await call.receive()
        raise GrpcError(StatusCode.NOT_FOUND, "no such thing: ünïcode, 100 % sure\n")

    async def fail_after_one(self, call: Call) -> None:
        await call.receive()
        await call.send(b"one")
        raise RuntimeError("a bug")

    async def forever(self, call: Call) -> None:
        """Sends a message, then waits until cancelled; then takes a while to clean up (as
        the gateway's methods abort their generation)."""
        await call.receive()
        await call.send(b"started")
        try:
            await asyncio.Event().wait()
        finally:
            self.cancelled.set()
            await asyncio.sleep(CLEAN_UP_S)
            self.cleaned_up.set()

    async def big(self, call: Call) -> None:
        """``count`` (the request) messages of ``BIG`` bytes, each filled with its index."""
        count = int(await call.receive() or b"0")
        for index in range(count):
            await call.send(bytes([index % 256]) * BIG)
            self.sent = index + 1

    def table(self) -> dict[str, Method]:
        return {
            f"/test.T/{name}": getattr(self, name)
            for name in ("echo", "refuse", "fail_after_one", "forever", "big")
        }


@pytest.fixture
async def served() -> AsyncIterator[tuple[GrpcServerCore, Methods, str]]:
    methods = Methods()
    core = GrpcServerCore(methods.table(), max_message_bytes=MAX_MESSAGE)
    port = _free_port()
    await core.listen("127.0.0.1", port)
    try:
        yield core, methods, f"127.0.0.1:{port}"
    finally:
        await core.stop(0)


def _raw(channel: grpc.aio.Channel, name: str) -> Any:
    identity = lambda message: message  # noqa: E731
    return channel.stream_stream(
        f"/test.T/{name}", request_serializer=identity, response_deserializer=identity
    )


def _unary(channel: grpc.aio.Channel, name: str) -> Any:
    identity = lambda message: message  # noqa: E731
    return channel.unary_unary(
        f"/test.T/{name}", request_serializer=identity, response_deserializer=identity
    )


async def _requests(*messages: bytes) -> AsyncIterator[bytes]:
    for message in messages:
        yield message


async def test_a_stream_carries_requests_and_responses_and_ends_ok(served: Any) -> None:
    _, _, address = served
    async with grpc.aio.insecure_channel(address) as channel:
        call = _raw(channel, "echo")(
            _requests(b"a", b"", b"c" * 40_000), metadata=(("x-tag", "t"),)
        )
        got = [message async for message in call]
        assert got == [b"a", b"", b"c" * 40_000, b"3 t"]
        assert await call.code() == grpc.StatusCode.OK
        # Many calls at once on one connection.
        calls = [_raw(channel, "echo")(_requests(str(i).encode())) for i in range(200)]
        answers = await asyncio.gather(*[_collect(c) for c in calls])
        assert answers == [[str(i).encode(), b"1 "] for i in range(200)]


async def _collect(call: Any) -> list[bytes]:
    return [message async for message in call]


async def test_statuses_come_as_trailers_with_their_message(
    served: Any, caplog: pytest.LogCaptureFixture
) -> None:
    _, _, address = served
    async with grpc.aio.insecure_channel(address) as channel:
        refused = _raw(channel, "refuse")(_requests(b"x"))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _collect(refused)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert error.value.details() == "no such thing: ünïcode, 100 % sure\n"

        failing = _raw(channel, "fail_after_one")(_requests(b"x"))
        got = []
        with (
            caplog.at_level(logging.ERROR, "tokenspout.grpc"),
            pytest.raises(grpc.aio.AioRpcError) as error,
        ):
            async for message in failing:
                got.append(message)
        assert got == [b"one"]  # the message before the failure, then the status
        assert error.value.code() == grpc.StatusCode.INTERNAL
        assert "a gRPC call failed" in caplog.text and "a bug" in caplog.text

        # A unary call sends its request in one batch with its close: the client's side is
        # over when the server answers (a stream call's pending send would fail instead).
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _unary(channel, "nothing")(b"x")
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "/test.T/nothing" in str(error.value.details())

        # Over the server's message limit: refused, and the connection serves on.
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _unary(channel, "echo")(b"x" * (MAX_MESSAGE + 1))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await _collect(_raw(channel, "echo")(_requests(b"y"))) == [b"y", b"1 "]


async def test_a_deadline_or_a_cancel_stops_the_method_and_its_clean_up_runs_whole(
    served: Any,
) -> None:
    """The client's deadline ends its call with a reset at about the time the server's
    copy of it (``grpc-timeout``) cancels the method: the method is cancelled once, and its
    clean-up (in the gateway, the abort of the generation) runs to its end."""
    _, methods, address = served
    async with grpc.aio.insecure_channel(address) as channel:
        for deadline_s in (0.5, None):  # None: the client cancels the call
            methods.cancelled.clear()
            methods.cleaned_up.clear()
            call = _raw(channel, "forever")(_requests(b"x"), timeout=deadline_s)
            assert await call.read() == b"started"
            if deadline_s is None:
                call.cancel()
            else:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await call.read()
                assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.wait_for(methods.cancelled.wait(), 5)
            await asyncio.wait_for(methods.cleaned_up.wait(), 5)


async def test_large_messages_come_whole_and_a_slow_reader_holds_only_its_own_call(
    served: Any,
) -> None:
    _, methods, address = served
    count = 40  # 12 MB: far past the window, so the method waits on its reader
    async with (
        # No bandwidth-delay probing: the client's window stays HTTP/2's 64 KB per stream.
        grpc.aio.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)]) as slow_channel,
        grpc.aio.insecure_channel(address) as other,
    ):
        slow = _raw(slow_channel, "big")(_requests(str(count).encode()))
        first = await slow.read()
        assert first == bytes([0]) * BIG
        await asyncio.sleep(0.5)
        held = methods.sent
        assert held < count, "the method should wait while its reader does not read"
        # Meanwhile another call goes through whole.
        assert await _collect(_raw(other, "echo")(_requests(b"z"))) == [b"z", b"1 "]
        rest = []
        while (message := await slow.read()) is not grpc.aio.EOF:
            rest.append(message)
        assert [message[:1] * BIG == message for message in rest] == [True] * (count - 1)
        assert [message[0] for message in rest] == list(range(1, count))
        assert methods.sent == count


async def test_the_drain_refuses_new_calls_and_ends_the_running_ones_unavailable(
    served: Any,
) -> None:
    core, methods, address = served
    async with grpc.aio.insecure_channel(address) as channel:
        running = _raw(channel, "forever")(_requests(b"x"))
        assert await running.read() == b"started"
        stopping = asyncio.create_task(core.stop(0.5))
        await asyncio.sleep(0.1)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _unary(channel, "echo")(b"late")
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await running.read()
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in str(error.value.details())
        await stopping
        assert methods.cancelled.is_set()


async def test_a_request_that_is_not_grpc_gets_an_http_status(served: Any) -> None:
    _, _, address = served
    async with httpx.AsyncClient(http1=False, http2=True) as client:
        answer = await client.post(f"http://{address}/test.T/echo", json={"not": "grpc"})
        assert answer.status_code == 415
        answer = await client.get(f"http://{address}/test.T/echo")
        assert answer.status_code == 405


async def test_a_connection_that_breaks_http2_is_closed_and_the_others_serve_on(
    served: Any, caplog: pytest.LogCaptureFixture
) -> None:
    _, _, address = served
    host, port = address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    headers = [
        (":method", "POST"),
        (":path", "/test.T/echo"),
        (":scheme", "http"),
        (":authority", address),
    ]
    raw = [(name.encode(), value.encode()) for name, value in headers]
    client.send_headers(1, [*raw, (b"content-type", b"application/grpc"), (b"x-bad", b"\xff")])
    events: list[Any] = []
    try:
        writer.write(client.data_to_send())
        with caplog.at_level(logging.WARNING):
            while not any(isinstance(e, h2.events.ConnectionTerminated) for e in events):
                data = await asyncio.wait_for(reader.read(65_536), 5)
                assert data, "closed without a GOAWAY"
                events += client.receive_data(data)
    finally:
        writer.close()
        await writer.wait_closed()
    assert "closing a gRPC connection" in caplog.text and "Traceback" not in caplog.text
    async with grpc.aio.insecure_channel(address) as channel:
        assert await _collect(_raw(channel, "echo")(_requests(b"ok"))) == [b"ok", b"1 "]
