"""The gRPC server's life inside the gateway process: started by the app's lifespan after
the relay hub, told to drain with it at the shutdown signal, stopped before it.

The gateway's own gRPC-over-HTTP/2 server (gateway/transport/http2.py) on its own port
(``TOKENSPOUT_GRPC_PORT``, Triton's 8001 by default) and the HTTP server's host, in the
gateway's event loop. The port is bound exclusively: a second gateway on the same port
fails to start instead of sharing it.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from gateway.apis.oip.grpc.service import InferenceService
from gateway.transport.http2 import GrpcServerCore

log = logging.getLogger("tokenspout.grpc")


class GrpcServer:
    def __init__(
        self,
        service: InferenceService,
        host: str,
        port: int,
        *,
        max_message_bytes: int,
        grace_s: float,
        sock: socket.socket | None = None,
    ) -> None:
        """``sock``: listen there (a socket a parent process bound), not on host:port."""
        self.host = host
        self.sock = sock
        self.port = port
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.grace_s = grace_s
        self._core = GrpcServerCore(service.methods(), max_message_bytes=max_message_bytes)
        self._stopping: asyncio.Task[None] | None = None

    async def start(self) -> None:
        try:
            await self._core.listen(self.host, self.port, self.sock)
        except OSError as exc:
            raise OSError(f"the gRPC server cannot listen on {self.address}: {exc}") from exc
        log.info("gRPC inference service listening", extra={"address": self.address})

    def begin_drain(self) -> None:
        """Refuse new RPCs now; running ones get ``grace_s`` to end, then are ended
        ``UNAVAILABLE`` (their generations aborted, as when their clients leave)."""
        if self._stopping is None:
            self._stopping = asyncio.create_task(
                self._core.stop(self.grace_s), name="grpc server stop"
            )

    async def stop(self) -> None:
        self.begin_drain()
        if self._stopping is not None:
            await self._stopping
