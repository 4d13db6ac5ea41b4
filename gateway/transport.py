"""The HTTP protocol the gateway serves with: uvicorn's httptools protocol, writing a
response's head and the start of its body in one system call.

uvicorn writes the head the moment the app sends ``http.response.start`` and the body with
each ``http.response.body``: two ``write`` calls at least, and on a loopback or LAN socket a
small write is the costliest step of a short response (the kernel runs the whole send
there). A profile of one-shot streamed requests put uvicorn's writes at 14 % of the
gateway's CPU (docs/bench.md, issue 27). Here a head is held for a moment and goes out
with the next write: a whole answer's body, sent in the same turn of the event loop, or a
stream's first chunk, which for a short reply follows within milliseconds. A head that
nothing follows within ``HEAD_HOLD_S`` is written alone then; a client waiting for the
body sees no delay, since the body's write carries the head with it.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEAD_HOLD_S = 0.005
"""The longest a response head waits for its body: only a client that reads headers before
the first token (an EventSource's ``onopen``) can see it."""

_HEAD = b"HTTP/1.1 "
_INTERIM = b"HTTP/1.1 1"  # "100 Continue": the client waits for it to send its body


class HeadHoldingTransport(asyncio.Transport):
    """A socket's transport that holds a response head until the next write joins it.

    Everything but writing goes to the transport it wraps. After ``set_protocol`` (an
    upgrade to WebSocket) it holds nothing: frames are written as they come."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.transport = transport
        self.loop = loop
        self.held = b""
        self.flush_timer: asyncio.TimerHandle | None = None
        self.holding = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.held:
            data, self.held = self.held + data, b""
            self._cancel_timer()
        elif (
            self.holding
            and isinstance(data, bytes)  # uvicorn writes bytes; anything else goes on
            and data.startswith(_HEAD)
            and not data.startswith(_INTERIM)
            and not self.transport.is_closing()
        ):
            self.held = data
            self.flush_timer = self.loop.call_later(HEAD_HOLD_S, self.flush)
            return
        self.transport.write(data)

    def flush(self) -> None:
        """Write a held head now."""
        self._cancel_timer()
        if self.held:
            held, self.held = self.held, b""
            if not self.transport.is_closing():
                self.transport.write(held)

    def _cancel_timer(self) -> None:
        if self.flush_timer is not None:
            self.flush_timer.cancel()
            self.flush_timer = None

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def write_eof(self) -> None:
        self.flush()
        self.transport.write_eof()

    def can_write_eof(self) -> bool:
        return self.transport.can_write_eof()

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def abort(self) -> None:
        self._cancel_timer()
        self.held = b""
        self.transport.abort()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.flush()
        self.holding = False
        self.transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.transport.get_protocol()

    def pause_reading(self) -> None:
        self.transport.pause_reading()

    def resume_reading(self) -> None:
        self.transport.resume_reading()

    def is_reading(self) -> bool:
        return self.transport.is_reading()

    def get_write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size() + len(self.held)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self.transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.transport.set_write_buffer_limits(high, low)


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a ``HeadHoldingTransport``."""

    holding: HeadHoldingTransport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport's subclasses, but are ones in kind
        self.holding = HeadHoldingTransport(cast(asyncio.Transport, transport), self.loop)
        super().connection_made(self.holding)

    def on_response_complete(self) -> None:
        self.holding.flush()  # a response without a body write (to HEAD) ends with its head
        super().on_response_complete()
