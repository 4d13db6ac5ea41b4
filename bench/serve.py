"""``python -m bench.serve granian PORT``: the gateway app under granian instead of uvicorn.

One worker, the ASGI interface, the same ``create_app`` factory and environment as
``python -m gateway``; the suite uses it (``--server granian``) to compare the two servers.
"""

from __future__ import annotations

import sys

from granian import Granian
from granian.constants import Interfaces


def main() -> None:
    server, port = sys.argv[1], int(sys.argv[2])
    if server != "granian":
        raise SystemExit(f"unknown server {server!r}")
    Granian(
        "gateway.app:create_app",
        address="127.0.0.1",
        port=port,
        interface=Interfaces.ASGI,
        workers=1,
        factory=True,
        log_enabled=False,
        websockets=False,
    ).serve()


if __name__ == "__main__":
    main()
