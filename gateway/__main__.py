"""``python -m gateway --host H --port P [--grpc-port G] [--workers N]``: serve the gateway
(configuration from the env), and its gRPC inference service on the same host
(gateway/apis/oip/grpc/); ``--workers N`` (or ``auto``): N processes on those ports
(gateway/server/supervisor.py).

SIGTERM drains: the listening socket closes, idle event streams end at once, streams with a
generation in flight end right after its final event, and whatever is still open after
``TOKENSPOUT_SHUTDOWN_GRACE_S`` is cut (clients resume on another replica with
``Last-Event-ID``); the gRPC server takes no new RPC and gives running ones as long.

``python -m gateway keys ...``: make, list, change and revoke API keys, and read their
usage, on the Redis of ``REDIS_URL`` (gateway/apis/admin/cli.py; ``keys --help``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import msgspec
import uvicorn

from gateway.core import tracing
from gateway.core.settings import Settings
from gateway.server.http1 import HttpProtocol
from gateway.server.supervisor import OrphanWatch, Supervisor, auto_workers
from wire.connect import misconfiguration
from wire.logs import configure_logging
from wire.runtime import open_files_to_the_hard_limit, tune_gc
from wire.tracing import start_tracer

if TYPE_CHECKING:
    from gateway.server.app import Services

log = logging.getLogger("tokenspout.gateway")

WS_HARD_LIMIT_FACTOR = 4
"""uvicorn refuses a WebSocket frame over this many times ``TOKENSPOUT_MAX_BODY_BYTES``
(close 1009) before the gateway sees it; frames between the two limits get the typed
``frame_too_large`` error and the socket stays open."""


def ws_max_size(settings: Settings) -> int:
    return WS_HARD_LIMIT_FACTOR * settings.max_body_bytes


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the relay hub and the gRPC server when a shutdown signal
    arrives; as one of several processes, draining by itself if its parent dies."""

    def __init__(
        self, config: uvicorn.Config, services: Services, orphan: OrphanWatch | None = None
    ) -> None:
        super().__init__(config)
        self.services = services
        self.orphan = orphan
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def on_tick(self, counter: int) -> bool:
        if self.orphan is not None and counter % 10 == 0 and self.orphan.orphaned():
            self.handle_exit(signal.SIGTERM, None)  # uvicorn ticks every 0.1 s
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self.loop is not None:
            open_streams = self.services.hub.open_feeds
            log.info("draining", extra={"signal": sig, "open_streams": open_streams})
            self.loop.call_soon_threadsafe(self.services.begin_drain)
        super().handle_exit(sig, frame)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="port of the gRPC inference service on --host (default: TOKENSPOUT_GRPC_PORT, "
        "8001); 0: none",
    )
    parser.add_argument(
        "--workers",
        default="1",
        help="gateway processes on these ports, or 'auto' (one below 8 cores, then one per 4 "
        "cores, at most 8); each has its own Redis pool of 64 connections and one pub/sub",
    )
    hidden = argparse.SUPPRESS  # one process of several, as its parent starts it
    parser.add_argument("--fd", type=int, default=None, help=hidden)
    parser.add_argument("--grpc-fd", type=int, default=None, help=hidden)
    parser.add_argument("--process-index", type=int, default=0, help=hidden)
    parser.add_argument("--peers-dir", type=Path, default=None, help=hidden)
    return parser


def workers(value: str) -> int:
    if value == "auto":
        return auto_workers()
    if not value.isdigit() or int(value) < 1:
        sys.exit(f"tokenspout gateway: --workers takes a number from 1 or 'auto', not {value!r}")
    return int(value)


def start_tracing() -> None:
    """Traces of the requests, when OpenTelemetry's variables ask for them (wire/tracing.py)."""
    try:
        tracing.configure(start_tracer("tokenspout-gateway"))
    except ValueError as exc:  # an OTEL_ variable it cannot follow
        sys.exit(f"tokenspout gateway: cannot start: {exc}")


def main(argv: list[str] | None = None) -> None:
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["keys"]:
        from gateway.apis.admin.cli import main as keys  # the server's imports are not needed

        keys(given[1:])
        return
    args = parser().parse_args(argv)
    from gateway.core.auth import ConfigError
    from gateway.server.app import create_asgi_app  # here: the parser alone stays cheap to import

    settings = Settings.from_env()
    if args.grpc_port is not None:
        settings = msgspec.structs.replace(settings, grpc_port=args.grpc_port)
    child = args.peers_dir is not None
    service = f"gateway.{args.process_index}" if child else "gateway"
    configure_logging(settings.log_level, service, settings.log_format)
    if not child and (raised := open_files_to_the_hard_limit())[0] != raised[1]:
        logging.getLogger("tokenspout.gateway").info("open files: limit %d -> %d", *raised)
    if not child and (problem := asyncio.run(misconfiguration(settings.redis_url))):
        sys.exit(f"tokenspout gateway: cannot start: {problem}")
    processes = 1 if child else workers(args.workers)
    if processes > 1:
        own = ["--host", args.host, "--port", str(args.port)]
        own += ["--grpc-port", str(settings.grpc_port)]
        try:
            supervisor = Supervisor(own, args.host, args.port, settings.grpc_port, processes)
        except OSError as exc:
            sys.exit(f"tokenspout gateway: cannot start: {exc}")
        sys.exit(supervisor.run())
    place = {}
    if child:
        grpc_socket = None if args.grpc_fd is None else socket.socket(fileno=args.grpc_fd)
        place = {"grpc_socket": grpc_socket, "peers_dir": args.peers_dir}
        place["process_index"] = args.process_index
    start_tracing()
    try:
        app, services = create_asgi_app(settings, grpc_host=args.host, **place)
    except ConfigError as exc:
        sys.exit(f"tokenspout gateway: cannot start: {exc}")
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        access_log=False,
        # Named, not uvicorn's "auto", which falls back to asyncio's loop and h11 where these
        # are missing (an image without them costs 15-30 % more CPU per request).
        loop="uvloop",
        http=HttpProtocol,  # httptools' protocol, one write for a head and its body
        timeout_graceful_shutdown=settings.shutdown_grace_s,
        timeout_keep_alive=settings.keepalive_s,
        ws_max_size=ws_max_size(settings),
    )
    tune_gc()
    server = DrainingServer(config, services, OrphanWatch() if child else None)
    server.run(sockets=None if args.fd is None else [socket.socket(fileno=args.fd)])


if __name__ == "__main__":
    main()
