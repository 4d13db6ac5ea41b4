"""``python -m gateway --host H --port P``: serve the gateway (configuration from the env)."""

from __future__ import annotations

import argparse

import uvicorn

from gateway.app import create_app
from gateway.logs import configure_logging
from gateway.settings import Settings


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    settings = Settings.from_env()
    configure_logging(settings.log_level, "gateway")
    uvicorn.run(
        create_app(settings),
        host=args.host,
        port=args.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
