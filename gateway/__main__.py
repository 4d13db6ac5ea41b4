"""``python -m gateway --host H --port P``: serve the gateway (configuration from the env).

SIGTERM drains: the listening socket closes, idle event streams end at once, streams with a
generation in flight end right after its final event, and whatever is still open after
``TOKENSPOUT_SHUTDOWN_GRACE_S`` is cut (clients resume on another replica with
``Last-Event-ID``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from types import FrameType

import uvicorn

from gateway.relay import RelayHub
from gateway.settings import Settings
from wire.logs import configure_logging
from wire.runtime import tune_gc

log = logging.getLogger("tokenspout.gateway")

WS_HARD_LIMIT_FACTOR = 4
"""uvicorn refuses a WebSocket frame over this many times ``TOKENSPOUT_MAX_BODY_BYTES``
(close 1009) before the gateway sees it; frames between the two limits get the typed
``frame_too_large`` error and the socket stays open."""


def ws_max_size(settings: Settings) -> int:
    return WS_HARD_LIMIT_FACTOR * settings.max_body_bytes


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the relay hub when a shutdown signal arrives."""

    def __init__(self, config: uvicorn.Config, hub: RelayHub) -> None:
        super().__init__(config)
        self.hub = hub
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self.loop is not None:
            log.info("draining", extra={"signal": sig, "open_streams": self.hub.open_feeds})
            self.loop.call_soon_threadsafe(self.hub.begin_drain)
        super().handle_exit(sig, frame)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    from gateway.app import create_asgi_app  # here: the parser alone stays cheap to import
    from gateway.auth import ConfigError

    settings = Settings.from_env()
    configure_logging(settings.log_level, "gateway")
    try:
        app, services = create_asgi_app(settings)
    except ConfigError as exc:
        sys.exit(f"tokenspout gateway: cannot start: {exc}")
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=settings.shutdown_grace_s,
        timeout_keep_alive=settings.keepalive_s,
        ws_max_size=ws_max_size(settings),
    )
    tune_gc()
    DrainingServer(config, services.hub).run()


if __name__ == "__main__":
    main()
