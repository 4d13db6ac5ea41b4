"""The gRPC server's life inside the gateway process: started by the app's lifespan after
the relay hub, told to drain with it at the shutdown signal, stopped before it.

grpcio's asyncio server on its own port (``TOKENSPOUT_GRPC_PORT``, Triton's 8001 by
default) and the HTTP server's host. The port is bound exclusively: a second gateway on the
same port fails to start instead of sharing it (grpcio sets SO_REUSEPORT by default).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from gateway.grpc.service import InferenceService, handler

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
    ) -> None:
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.grace_s = grace_s
        self._service = service
        self._options = [
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        self._server: grpc.aio.Server | None = None
        self._stopping: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Listen (in the running loop, which grpcio's asyncio server binds to)."""
        server = grpc.aio.server(options=self._options)
        server.add_generic_rpc_handlers((handler(self._service),))
        try:
            server.add_insecure_port(self.address)
        except RuntimeError as exc:
            raise OSError(f"the gRPC server cannot listen on {self.address}: {exc}") from exc
        await server.start()
        self._server = server
        log.info("gRPC inference service listening", extra={"address": self.address})

    def begin_drain(self) -> None:
        """Refuse new RPCs now; running ones get ``grace_s`` to end, then are cancelled
        (their generations aborted, as when their clients leave)."""
        if self._server is not None and self._stopping is None:
            self._stopping = asyncio.create_task(
                self._server.stop(self.grace_s), name="grpc server stop"
            )

    async def stop(self) -> None:
        self.begin_drain()
        if self._stopping is not None:
            await self._stopping
