"""A TCP proxy in front of a server, whose client connections a test can reset (RST), as a
restarting server or a network does to a connection nobody is reading, silence from a
given moment on (``hold_after``), as a client that dies then does, or cut both ways for a
while (``cut``, ``mend``), as a network that drops then comes back does."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from types import TracebackType

HOST = "127.0.0.1"


class ResettingProxy:
    def __init__(self, port: int) -> None:
        self.port = port
        self._server: asyncio.Server | None = None
        self._clients: list[asyncio.StreamWriter] = []
        self._writers: list[asyncio.StreamWriter] = []
        self._pipes: set[asyncio.Task[None]] = set()
        self._hold_marker: bytes | None = None
        self._holding = False
        self._mended = asyncio.Event()
        self._mended.set()
        self.refusing = False
        """New connections are reset at once, as by a server that is down."""

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.listening_port}"

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.listening_port}"

    @property
    def listening_port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def __aenter__(self) -> ResettingProxy:
        self._server = await asyncio.start_server(self._accept, HOST, 0)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        for pipe in self._pipes:
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await self._server.wait_closed()

    @property
    def accepted(self) -> int:
        """Client connections accepted so far."""
        return len(self._clients)

    def reset_clients(self) -> None:
        """Close every client connection with an RST (SO_LINGER 0), not a FIN."""
        for writer in self._clients:
            if not writer.transport.is_closing():
                _reset(writer)

    def hold_after(self, marker: bytes) -> None:
        """Once a write of a client holding ``marker`` has gone through, drop everything
        any client writes after it (the server's replies still come back)."""
        self._hold_marker = marker

    def cut(self) -> None:
        """From now on no byte gets through either way: each waits (as TCP retransmits it)
        until ``mend``. The connections stay open."""
        self._mended.clear()

    def mend(self) -> None:
        """What waited goes through, in order, and so does what follows."""
        self._mended.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            _reset(writer)
            return
        upstream_reader, upstream_writer = await asyncio.open_connection(HOST, self.port)
        self._clients.append(writer)
        self._writers += [writer, upstream_writer]
        for source, sink, upstream in (
            (reader, upstream_writer, True),
            (upstream_reader, writer, False),
        ):
            pipe = asyncio.create_task(self._pipe(source, sink, upstream))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    async def _pipe(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, upstream: bool
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await source.read(65536):
                await self._mended.wait()
                if upstream and self._holding:
                    continue
                if sink.transport.is_closing():
                    # Reset (``reset_clients``): uvloop refuses a write to it with a
                    # RuntimeError, not a ConnectionError, which ended this task unretrieved.
                    break
                sink.write(data)
                await sink.drain()
                if upstream and self._hold_marker is not None and self._hold_marker in data:
                    self._holding = True
        sink.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close a connection with an RST (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
