"""The HTTP protocol the gateway serves with: uvicorn's httptools protocol, writing a
response's head and the start of its body in one system call when they are sent together.

uvicorn writes the head the moment the app sends ``http.response.start`` and the body with
each ``http.response.body``: two ``write`` calls at least, and on a loopback or LAN socket a
small write is the costliest step of a short response (the kernel runs the whole send
there). Here a head waits for the rest of its turn of the event loop: a body sent in the
same turn (a whole answer, or a stream whose first chunk is ready) goes out with it in one
write; otherwise it is written alone at the turn's end.

It waits no longer than that, so a client gets a stream's headers as soon as the app sends
them (an EventSource's ``onopen``, a ``fetch`` resolving). Holding a stream's head for its
first token would save a write per short reply, within this VM's noise (docs/bench.md): not
worth a client's later ``onopen``.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_HEAD = b"HTTP/1.1 "


class HeadHoldingTransport(asyncio.Transport):
    """A socket's transport that holds a response head to the end of the event loop's turn,
    for a write of the same turn to join.

    Everything but writing goes to the transport it wraps. After ``set_protocol`` (an
    upgrade to WebSocket) it holds nothing: frames are written as they come."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.transport = transport
        self.loop = loop
        self.held = b""
        self.turn_end: asyncio.Handle | None = None
        self.holding = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.held:
            data, self.held = self.held + data, b""
            self._cancel_turn_end()
        elif (
            self.holding
            and isinstance(data, bytes)  # uvicorn writes bytes; anything else goes on
            and data.startswith(_HEAD)
            and not self.transport.is_closing()
        ):
            self.held = data
            self.turn_end = self.loop.call_soon(self.flush)
            return
        self.transport.write(data)

    def flush(self) -> None:
        """Write a held head now."""
        self._cancel_turn_end()
        if self.held:
            held, self.held = self.held, b""
            if not self.transport.is_closing():
                self.transport.write(held)

    def _cancel_turn_end(self) -> None:
        if self.turn_end is not None:
            self.turn_end.cancel()
            self.turn_end = None

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
        self._cancel_turn_end()
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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport's subclasses, but are ones in kind
        super().connection_made(HeadHoldingTransport(cast(asyncio.Transport, transport), self.loop))
