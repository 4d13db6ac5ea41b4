"""``REDIS_URL`` may name a local Redis's Unix socket (``unix:///path/redis.sock``).

The gateway opened its pool with a TCP-only option (``socket_keepalive``), so over a Unix
socket every command failed: ``POST /v1/sessions`` answered 500 and the reaper logged a
traceback ten times a second. Now the option is left out there (wire/connect.py).
"""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx

from stack.redis_server import EmbeddedRedis
from tests.support.http import cancel_mid_reply, create_session, read_events, send
from tests.support.oracle import synthetic_text
from tests.support.stack import Stack


async def test_gateway_and_worker_serve_over_a_unix_socket(tmp_path: Path) -> None:
    with EmbeddedRedis(unix_socket=True) as server:
        stack = Stack(server.unix_url, f"u-{secrets.token_hex(4)}", tmp_path)
        try:
            gateway = stack.gateway()
            stack.synthetic()
            async with httpx.AsyncClient(timeout=30) as client:
                (worker,) = (await client.get(f"{gateway.url}/ready")).json()["workers"]
                assert worker["backend"] == "synthetic", worker

                session = await create_session(client, gateway.url)
                gid = await send(client, session, "over a socket", max_tokens=6)
                reading = await read_events(client, session, until_final_of=gid)
                assert reading.final(gid).event == "done", reading.final(gid).data
                assert reading.text(gid) == synthetic_text("over a socket", 6)

                long = await send(client, session, "a long one", max_tokens=4000)
                reading = await cancel_mid_reply(
                    client, session, long, 3, after=reading.events[-1].id
                )
                assert reading.final(long).event == "cancelled", reading.final(long).data
        finally:
            stack.stop()
        errors = _errors_logged(tmp_path)
        assert not errors, errors[:3]


def _errors_logged(folder: Path) -> list[str]:
    """The error lines of every process log of the test (the reaper's went there)."""
    return [
        line
        for log in sorted(folder.glob("*.log"))
        for line in log.read_text().splitlines()
        if "level=error" in line
    ]
