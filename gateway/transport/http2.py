"""gRPC over HTTP/2, served on ``h2``'s connection state machine in the gateway's own loop.

Why not grpcio's asyncio server: each message it sends is a batch of operations on grpc's
completion queue, finished in a polling thread and handed back to the loop, about 70 us of
CPU per message more than an HTTP/1.1 chunk from uvicorn on this machine (docs/bench.md).
A token stream is many small messages. Here a message is a DATA frame queued on the
connection, and every frame the loop queued in one pass goes out in one socket write.

What is served: the gRPC protocol over HTTP/2 as its specification (PROTOCOL-HTTP2.md)
states it for a server: ``POST`` with ``content-type: application/grpc[+proto]``, each
message behind its 5-byte prefix, uncompressed (a compressed one is ``UNIMPLEMENTED``),
``grpc-timeout`` as the call's deadline, the status in trailers (trailers only when no
message was sent), ``grpc-message`` percent-encoded. A client's ``RST_STREAM`` cancels its
call; a call that ends while the client still sends is reset with ``NO_ERROR``. Flow
control is HTTP/2's: a call whose window is spent waits in ``send`` (so a slow reader's
generations wait too, as a slow SSE reader's do); what it receives is acknowledged as it
arrives, with at most ``MAX_QUEUED_MESSAGES`` unread messages per call.

A ``Method`` is a coroutine that takes its ``Call``: it reads requests with ``receive``,
writes responses with ``send``, and ends the call by returning (``OK``) or raising
``GrpcError`` (its status); anything else it raises is ``INTERNAL``, logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from gateway.core import tracing
from gateway.core.errors import over_body_limit

log = logging.getLogger("tokenspout.grpc")

MAX_CONCURRENT_STREAMS = 4096
"""Calls one connection may run at once (a load generator runs hundreds on one channel)."""
REFUSAL_HOLD_S = 1.0
"""How long a call refused before its first response waits for the client to end its side
(after its requests) before the status goes out. grpcio's asyncio client sends a stream's
requests in operations of their own: one still under way when the status comes fails, and
the call ends ``INTERNAL`` "Internal error from Core" in place of the status (3 to 19 of
200 refused streams here), so a client would not see the ``UNAVAILABLE`` it retries."""
MAX_QUEUED_MESSAGES = 256
"""Requests a call has received and not read: past it the call ends ``RESOURCE_EXHAUSTED``."""
RECEIVE_WINDOW = 1 << 20
"""Bytes a client may send ahead, per call and per connection."""
STREAM_GONE = (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError)
"""What h2 raises for a frame on a stream the client has closed (or reset) meanwhile."""
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


class StatusCode(enum.IntEnum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


SERVER_FAULTS = frozenset(
    {
        StatusCode.UNKNOWN,
        StatusCode.DEADLINE_EXCEEDED,
        StatusCode.UNIMPLEMENTED,
        StatusCode.INTERNAL,
        StatusCode.UNAVAILABLE,
        StatusCode.DATA_LOSS,
    }
)
"""The statuses that mark a call's span an error (OpenTelemetry's gRPC server spans)."""


def begin_trace(call: Call, path: str) -> tracing.RequestTrace | None:
    """A call's trace, continuing the caller's ``traceparent`` metadata (None: off)."""
    if not tracing.enabled():
        return None
    attributes = {"rpc.system": "grpc", "rpc.method": path}
    return tracing.begin(path.lstrip("/"), call.metadata.get("traceparent"), attributes)


class GrpcError(Exception):
    """Ends a call with ``code`` and ``message``."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


Method = Callable[["Call"], Awaitable[None]]


class Call:
    """One RPC on one HTTP/2 stream: its request messages in, its responses out."""

    def __init__(
        self, connection: GrpcConnection, stream_id: int, metadata: dict[str, str]
    ) -> None:
        self.connection = connection
        self.stream_id = stream_id
        self.metadata = metadata
        """The request's headers but HTTP/2's own (``authorization``, ``grpc-timeout``...)."""
        self.task: asyncio.Task[None] | None = None
        self.headers_sent = False
        self.ended = False
        """The call's status went out (or the stream is gone): nothing more is sent."""
        self.status = (StatusCode.OK, "")
        """What the trailers say, once the method ended."""
        self.past_deadline = False
        """``grpc-timeout`` passed: the method was stopped for it."""
        self._received = bytearray()
        self._messages: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._unsent = bytearray()
        """Framed response bytes waiting for flow-control window."""
        self._drained: asyncio.Future[None] | None = None
        self._client_closed = asyncio.Event()
        """Set once the client ended its side of the stream (or reset it)."""

    # --- the method's side ---------------------------------------------------------------

    async def receive(self) -> bytes | None:
        """The next request message; None once the client has sent its last."""
        return await self._messages.get()

    async def send(self, message: bytes) -> None:
        """Queue one response message; waits only while the client's window is spent (or
        the connection's socket is full)."""
        if self.ended:
            raise asyncio.CancelledError  # the stream is gone: the method is being cancelled
        framed = b"\x00" + len(message).to_bytes(4, "big") + message
        connection = self.connection
        if not self.headers_sent:
            connection.send_headers(self)
        if self._unsent:
            self._unsent += framed
        elif not connection.send_whole(self, framed):
            self._unsent = bytearray(framed)
            connection.push(self)
        if self._unsent:
            await self._until_drained()
        if connection.paused:
            await connection.until_writable()

    @property
    def client_done(self) -> bool:
        """The client ended its side of the stream (or reset it, or was told to stop)."""
        return self._client_closed.is_set()

    def client_side_closed(self) -> None:
        """Nothing more is read from the client (its side ended, or it was told to stop)."""
        self._client_closed.set()

    async def until_client_done(self, within_s: float) -> None:
        """Until the client ended its side of the stream (or reset it), at most ``within_s``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                await self._client_closed.wait()

    async def _until_drained(self) -> None:
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._drained)

    # --- the connection's side -----------------------------------------------------------

    def take_unsent(self, size: int) -> bytes:
        chunk = bytes(self._unsent[:size])
        del self._unsent[:size]
        return chunk

    @property
    def unsent(self) -> int:
        return len(self._unsent)

    def drained(self) -> None:
        """Everything queued went out: wake a ``send`` waiting for window."""
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def received(self, data: bytes, max_message_bytes: int) -> None:
        """Bytes of the request stream: complete messages go to ``receive``."""
        self._received += data
        while len(self._received) >= 5:
            compressed = self._received[0]
            length = int.from_bytes(self._received[1:5], "big")
            if compressed:
                raise GrpcError(StatusCode.UNIMPLEMENTED, "compressed messages are not supported")
            if length > max_message_bytes:
                raise GrpcError(
                    StatusCode.RESOURCE_EXHAUSTED,
                    over_body_limit(f"a message of {length} bytes", max_message_bytes),
                )
            if len(self._received) < 5 + length:
                return
            message = bytes(self._received[5 : 5 + length])
            del self._received[: 5 + length]
            if self._messages.qsize() >= MAX_QUEUED_MESSAGES:
                raise GrpcError(
                    StatusCode.RESOURCE_EXHAUSTED,
                    f"over {MAX_QUEUED_MESSAGES} requests sent and not yet read",
                )
            self._messages.put_nowait(message)

    def client_ended(self) -> None:
        if self._received:
            raise GrpcError(StatusCode.INTERNAL, "the request stream ended inside a message")
        self.client_side_closed()
        self._messages.put_nowait(None)

    def gone(self) -> None:
        """The stream is reset or its connection lost: stop the method."""
        self.ended = True
        self.client_side_closed()
        self._unsent.clear()
        self.drained()
        self.stop_method()

    def deadline_passed(self) -> None:
        self.past_deadline = True
        self.stop_method()

    def stop_method(self) -> None:
        """Cancel the method's task, once: a second cancel (the client's reset arriving
        while the deadline's cancel still runs the method's clean-up, or the other way
        round) would cut that clean-up short, and with it the abort of the generation."""
        if self.task is not None and not self.task.done() and not self.task.cancelling():
            self.task.cancel()


class GrpcConnection(asyncio.Protocol):
    """One client connection: HTTP/2 frames in and out, a task per call."""

    def __init__(self, server: GrpcServerCore) -> None:
        self.server = server
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        )
        self.transport: asyncio.Transport | None = None
        self.calls: dict[int, Call] = {}
        self.paused = False
        self._writable: asyncio.Event | None = None
        self._flush_pending = False

    # --- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.server.connections.add(self)
        self.h2.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: RECEIVE_WINDOW,
            },
        )
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(RECEIVE_WINDOW)
        self.flush()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except (h2.exceptions.ProtocolError, UnicodeDecodeError) as exc:
            # Frames HTTP/2 forbids, or header bytes that are no UTF-8: the connection's
            # state is lost, so it ends (GOAWAY); the others serve on.
            log.warning("closing a gRPC connection: %s", exc)
            self.flush()
            self.close()
            return
        for event in events:
            self._on_event(event)
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for call in list(self.calls.values()):
            call.gone()
        self.calls.clear()
        if self._writable is not None:
            self._writable.set()

    def pause_writing(self) -> None:
        self.paused = True
        self._writable = self._writable or asyncio.Event()
        self._writable.clear()

    def resume_writing(self) -> None:
        self.paused = False
        if self._writable is not None:
            self._writable.set()

    async def until_writable(self) -> None:
        if self._writable is not None:
            await self._writable.wait()

    # --- frames in -----------------------------------------------------------------------

    def _on_event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.DataReceived):
            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            call = self.calls.get(event.stream_id)
            if call is not None and not call.ended:
                self._feed(
                    call,
                    functools.partial(call.received, event.data, self.server.max_message_bytes),
                )
        elif isinstance(event, h2.events.RequestReceived):
            self._start_call(event.stream_id, event.headers)
        elif isinstance(event, h2.events.StreamEnded):
            call = self.calls.get(event.stream_id)
            if call is not None and not call.ended:
                self._feed(call, call.client_ended)
        elif isinstance(event, h2.events.StreamReset):
            call = self.calls.pop(event.stream_id, None)
            if call is not None:
                call.gone()
        elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            for call in list(self.calls.values()):
                if call.unsent:
                    self.push(call)
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.close()

    def _feed(self, call: Call, step: Callable[[], None]) -> None:
        """Hand the call what came; a request stream it cannot read ends the call."""
        try:
            step()
        except GrpcError as error:
            self.end(call, error.code, error.message)
            call.stop_method()

    def _start_call(self, stream_id: int, raw_headers: Any) -> None:
        headers = dict(raw_headers)
        if self.server.draining:
            self._refuse(stream_id, StatusCode.UNAVAILABLE, "the gateway is shutting down")
            return
        if headers.get(":method") != "POST":
            self._answer_http(stream_id, "405")
            return
        content_type = headers.get("content-type", "")
        if not content_type.startswith("application/grpc"):
            self._answer_http(stream_id, "415")
            return
        method = self.server.methods.get(headers.get(":path", ""))
        if method is None:
            path = headers.get(":path", "")
            self._refuse(stream_id, StatusCode.UNIMPLEMENTED, f"no method {path}")
            return
        metadata = {name: value for name, value in headers.items() if not name.startswith(":")}
        call = Call(self, stream_id, metadata)
        self.calls[stream_id] = call
        path = headers[":path"]
        call.task = asyncio.create_task(self._run(call, method, path), name=f"grpc {path}")
        self.server.running.add(call.task)
        call.task.add_done_callback(self.server.running.discard)

    def _refuse(self, stream_id: int, code: StatusCode, message: str) -> None:
        """A call refused as it opens, its status held as any refusal's (``_refused``)."""
        call = Call(self, stream_id, {})
        self.calls[stream_id] = call
        call.task = asyncio.create_task(self._hold_refusal(call, GrpcError(code, message)))
        self.server.running.add(call.task)
        call.task.add_done_callback(self.server.running.discard)

    async def _hold_refusal(self, call: Call, error: GrpcError) -> None:
        try:
            await self._refused(call, error)
        finally:
            if not call.ended:  # reset meanwhile, or the server stopped it
                call.gone()
            self.calls.pop(call.stream_id, None)

    def _answer_http(self, stream_id: int, status: str) -> None:
        self.h2.send_headers(stream_id, [(":status", status)], end_stream=True)

    async def _run(self, call: Call, method: Method, path: str) -> None:
        trace = begin_trace(call, path)  # None: tracing off
        timeout_s = _deadline(call.metadata.get("grpc-timeout"))
        loop = asyncio.get_running_loop()
        timer = None if timeout_s is None else loop.call_later(timeout_s, call.deadline_passed)
        try:
            await method(call)
            self.end(call, StatusCode.OK, "")
        except GrpcError as error:
            await self._refused(call, error)
        except asyncio.CancelledError:
            if not call.past_deadline:
                # The client reset the stream or went away, or the server stops (and
                # ended the call itself): nothing more goes out on this stream.
                raise
            if call.task is not None:  # this task: the deadline's cancel is handled here
                call.task.uncancel()
            self.end(call, StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed")
        except Exception:
            log.exception("a gRPC call failed")
            self.end(call, StatusCode.INTERNAL, "the gateway failed answering it (logged)")
        finally:
            if timer is not None:
                timer.cancel()
            if not call.ended:
                call.gone()
            if call.unsent == 0:
                self.calls.pop(call.stream_id, None)
            if trace is not None:
                code = call.status[0]
                status = {"rpc.grpc.status_code": code.value}
                trace.end(path.lstrip("/"), code in SERVER_FAULTS, status)

    async def _refused(self, call: Call, error: GrpcError) -> None:
        """End ``call`` with ``error``'s status; one refused before any response first
        waits (``REFUSAL_HOLD_S`` at most) for the client to have sent its requests."""
        if not call.headers_sent:
            await call.until_client_done(REFUSAL_HOLD_S)
        self.end(call, error.code, error.message)

    # --- frames out ----------------------------------------------------------------------

    def send_headers(self, call: Call) -> None:
        """The response's headers, before its first message."""
        self.h2.send_headers(call.stream_id, _RESPONSE_HEADERS)
        call.headers_sent = True
        self.schedule_flush()

    def send_whole(self, call: Call, data: bytes) -> bool:
        """Send ``data`` as one frame if the window and the frame size take it (a token's
        message nearly always): the common case, without ``push``'s bookkeeping."""
        stream_id = call.stream_id
        size = len(data)
        if size > self.h2.max_outbound_frame_size:
            return False
        try:
            if size > self.h2.local_flow_control_window(stream_id):
                return False
            self.h2.send_data(stream_id, data)
        except STREAM_GONE:
            self._lost(call)
            return True
        self.schedule_flush()
        return True

    def push(self, call: Call) -> None:
        """Frame as much of the call's unsent bytes as its window takes."""
        stream_id = call.stream_id
        try:
            while call.unsent:
                size = min(
                    self.h2.local_flow_control_window(stream_id),
                    self.h2.max_outbound_frame_size,
                    call.unsent,
                )
                if size <= 0:
                    break
                self.h2.send_data(stream_id, call.take_unsent(size))
        except STREAM_GONE:
            self._lost(call)
            return
        self.schedule_flush()
        if not call.unsent:
            call.drained()
            if call.ended:  # the status waited for these bytes
                self._send_trailers(call)

    def _lost(self, call: Call) -> None:
        """The client closed the stream while its call was sending."""
        self.calls.pop(call.stream_id, None)
        call.gone()

    def end(self, call: Call, code: StatusCode, message: str) -> None:
        """Send the call's status (after its unsent messages, when window allows)."""
        if call.ended:
            return
        call.ended = True
        if not call.headers_sent:
            with contextlib.suppress(*STREAM_GONE):
                self.h2.send_headers(call.stream_id, _trailers_only(code, message), end_stream=True)
            self._after_end(call)
            return
        call.status = (code, message)
        if not call.unsent:
            self._send_trailers(call)

    def _send_trailers(self, call: Call) -> None:
        code, message = call.status
        with contextlib.suppress(*STREAM_GONE):
            self.h2.send_headers(call.stream_id, _trailers(code, message), end_stream=True)
        self._after_end(call)

    def _after_end(self, call: Call) -> None:
        if not call.client_done:
            # The client may still be sending: tell it to stop, without error.
            with contextlib.suppress(*STREAM_GONE):
                self.h2.reset_stream(call.stream_id, h2.errors.ErrorCodes.NO_ERROR)
            call.client_side_closed()
        self.calls.pop(call.stream_id, None)
        self.schedule_flush()

    def schedule_flush(self) -> None:
        """One socket write for every frame queued in this pass of the loop."""
        if not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._flush_pending = False
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.h2.close_connection()
        self.flush()
        if self.transport is not None:
            self.transport.close()


class GrpcServerCore:
    """Listens and keeps its connections; ``methods`` by path (``/package.Service/Method``)."""

    def __init__(self, methods: dict[str, Method], *, max_message_bytes: int) -> None:
        self.methods = methods
        self.max_message_bytes = max_message_bytes
        self.connections: set[GrpcConnection] = set()
        self.running: set[asyncio.Task[None]] = set()
        self.draining = False
        self._server: asyncio.Server | None = None

    async def listen(self, host: str, port: int, sock: socket.socket | None = None) -> None:
        """On ``host:port``, or on ``sock``, a listening socket bound elsewhere."""
        loop = asyncio.get_running_loop()
        where: dict[str, Any] = {"sock": sock} if sock else {"host": host, "port": port}
        self._server = await loop.create_server(lambda: GrpcConnection(self), **where)

    def refuse_new_calls(self) -> None:
        """New calls are answered ``UNAVAILABLE`` and new connections refused."""
        self.draining = True
        if self._server is not None:
            self._server.close()

    async def stop(self, grace_s: float) -> None:
        """Give running calls ``grace_s`` to end, then end them ``UNAVAILABLE``."""
        self.refuse_new_calls()
        deadline = time.monotonic() + grace_s
        while self.running and time.monotonic() < deadline:
            await asyncio.wait(set(self.running), timeout=deadline - time.monotonic())
        for connection in list(self.connections):
            for call in list(connection.calls.values()):
                connection.end(call, StatusCode.UNAVAILABLE, "the gateway is shutting down")
                call.stop_method()
        if self.running:
            await asyncio.gather(*self.running, return_exceptions=True)
        for connection in list(self.connections):
            connection.close()
        if self._server is not None:
            await self._server.wait_closed()


_RESPONSE_HEADERS = [(":status", "200"), ("content-type", "application/grpc")]


def _trailers(code: StatusCode, message: str) -> list[tuple[str, str]]:
    trailers = [("grpc-status", str(int(code)))]
    if message:
        trailers.append(("grpc-message", _percent_encoded(message)))
    return trailers


def _trailers_only(code: StatusCode, message: str) -> list[tuple[str, str]]:
    return [*_RESPONSE_HEADERS, *_trailers(code, message)]


def _percent_encoded(message: str) -> str:
    """``grpc-message``'s encoding: printable ASCII but ``%`` as is, every other byte %XX."""
    return "".join(
        chr(byte) if 0x20 <= byte <= 0x7E and byte != 0x25 else f"%{byte:02X}"
        for byte in message.encode()
    )


def _deadline(timeout: str | None) -> float | None:
    """``grpc-timeout`` (``1S``, ``250m``...) as seconds from now; None: no deadline."""
    if not timeout or timeout[-1] not in _TIMEOUT_UNITS or not timeout[:-1].isdigit():
        return None
    return int(timeout[:-1]) * _TIMEOUT_UNITS[timeout[-1]]
