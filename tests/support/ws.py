"""A WebSocket client for tests: the ``websockets`` library, frames as dicts, kept per id."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

FINAL = {"done", "cancelled", "error"}


def is_final(frame: dict[str, Any]) -> bool:
    return frame["type"] in FINAL and "event_id" in frame


def ws_url(base: str, token: str | None = None) -> str:
    url = base.replace("http://", "ws://", 1) + "/v1/ws"
    return f"{url}?token={token}" if token else url


@dataclass
class WsClient:
    """Reads every frame the gateway sends; ``frames[id]`` holds them by client id."""

    conn: ClientConnection
    frames: dict[str | None, list[dict[str, Any]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    log: list[dict[str, Any]] = field(default_factory=list)

    async def send(self, **frame: Any) -> None:
        await self.conn.send(json.dumps(frame))

    async def recv(self, timeout_s: float = 30) -> dict[str, Any]:
        raw = await asyncio.wait_for(self.conn.recv(), timeout_s)
        frame: dict[str, Any] = json.loads(raw)
        self.log.append(frame)
        self.frames[frame.get("id")].append(frame)
        return frame

    async def until(
        self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 30
    ) -> dict[str, Any]:
        """Read frames until one matches ``predicate``; return it."""
        async with asyncio.timeout(timeout_s):
            while True:
                frame = await self.recv(timeout_s)
                if predicate(frame):
                    return frame

    async def final_of(self, client_id: str, timeout_s: float = 30) -> dict[str, Any]:
        """The generation's final frame (one with an ``event_id``: not a refusal)."""
        for frame in self.frames[client_id]:
            if is_final(frame):
                return frame
        return await self.until(lambda f: f.get("id") == client_id and is_final(f), timeout_s)

    async def generate(self, client_id: str, content: str, **params: Any) -> dict[str, Any]:
        """Send ``generate``; return its ``ack`` (or the ``error`` that refused it)."""
        await self.send(type="generate", id=client_id, content=content, **params)
        return await self.until(
            lambda f: f.get("id") == client_id and f["type"] in ("ack", "error")
        )

    def tokens(self, client_id: str) -> list[dict[str, Any]]:
        return [f for f in self.frames[client_id] if f["type"] == "token"]

    def text(self, client_id: str) -> str:
        return "".join(f["text"] for f in self.tokens(client_id))


async def open_ws(base: str, token: str | None = None, **options: Any) -> WsClient:
    """A socket that keeps reading while the test awaits something else, as a browser's
    does: past ``max_queue`` unread frames the library stops reading the socket, so the
    gateway's keepalive pings go unanswered and it closes the socket (1011) 20 s on. A test
    of a reader that stops passes its own ``max_queue``."""
    options.setdefault("max_queue", None)
    conn = await connect(ws_url(base, token), **options)
    return WsClient(conn)
