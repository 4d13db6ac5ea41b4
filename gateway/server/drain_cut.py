"""Requests still unanswered when a shutdown's grace is nearly over end 503
``shutting_down`` in their API's format, whatever they wait on (a Redis away or paused, a
session's create or send), so their clients send them again to another replica. uvicorn
would cancel them when the grace ends and answer a plain-text 500. A request waiting for a
generation's events is cut the same way by the relay (``RelayHub.raise_if_cut``); one whose
answer has begun (a stream) ends as its stream does.
"""

from __future__ import annotations

import asyncio

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.core.errors import ShuttingDown


class UnansweredRequests:
    """The HTTP requests of this process whose answer has not begun; ``cut`` ends them."""

    def __init__(self) -> None:
        self._waiting: set[asyncio.Task[object]] = set()
        self._cut: set[asyncio.Task[object]] = set()

    def cut(self) -> None:
        """End every request still unanswered (``ShuttingDown``, rendered by its API)."""
        for task in self._waiting - self._cut:
            self._cut.add(task)
            task.cancel()

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """The Litestar middleware that keeps the set (inside its error handling)."""

        async def watched(scope: Scope, receive: Receive, send: Send) -> None:
            task = asyncio.current_task()
            if scope["type"] != ScopeType.HTTP or task is None:
                await app(scope, receive, send)
                return
            self._waiting.add(task)

            async def answer(message: Message) -> None:
                if message["type"] == "http.response.start":
                    self._waiting.discard(task)
                await send(message)

            try:
                await app(scope, receive, answer)
            except asyncio.CancelledError:
                if task not in self._cut:
                    raise
                task.uncancel()
                raise ShuttingDown(
                    "the gateway is shutting down; send the request again", retry_after_s=1
                ) from None
            finally:
                self._waiting.discard(task)
                self._cut.discard(task)

        return watched
