"""A TCP proxy in front of a server, whose client connections a test can reset (RST), as a
restarting server or a network does to a connection nobody is reading."""

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

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"redis://{HOST}:{self._server.sockets[0].getsockname()[1]}"

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
            if writer.transport.is_closing():
                continue
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(HOST, self.port)
        self._clients.append(writer)
        self._writers += [writer, upstream_writer]
        for source, sink in ((reader, upstream_writer), (upstream_reader, writer)):
            pipe = asyncio.create_task(self._pipe(source, sink))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    @staticmethod
    async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        sink.close()
