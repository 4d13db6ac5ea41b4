"""A WebSocket's frames as the APIs read them: one receive loop for every socket API."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from litestar import WebSocket
from litestar.exceptions import WebSocketDisconnect


async def received(socket: WebSocket[Any, Any, Any]) -> AsyncIterator[str | bytes]:
    """The client's frames, text or binary, until it disconnects (then it ends)."""
    try:
        while True:
            message = await socket.receive()
            if message["type"] == "websocket.disconnect":
                return
            text, binary = message.get("text"), message.get("bytes")
            data = text if isinstance(text, str) else binary
            yield data if isinstance(data, str | bytes) else b""
    except WebSocketDisconnect:
        return
