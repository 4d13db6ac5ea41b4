"""Requests still unanswered when a shutdown's grace is nearly over end 503
``shutting_down`` in their API's format, whatever they wait on (a Redis away or paused, a
session's create or send, a one-shot request's submit), so their clients send them again
to another replica. uvicorn would cancel them when the grace ends and answer a plain-text
500. A request waiting for a generation's events is cut the same way by the relay
(``RelayHub.raise_if_cut``); one whose answer has begun (a stream) ends as its stream does.

The Litestar routes are watched by ``middleware`` (inside Litestar's error handling, which
renders the ``ShuttingDown``); the hot OpenAI routes, ahead of Litestar, by ``waiting``
around what they do before they answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.core.errors import AGAIN_AFTER_S, ShuttingDown


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

    @contextlib.asynccontextmanager
    async def waiting(self) -> AsyncIterator[Callable[[], None]]:
        """The current request is unanswered while the block runs, or until it calls what
        it is given (its answer began); a cut ends the block with ``ShuttingDown``."""
        task = asyncio.current_task()
        assert task is not None  # a request is served in a task
        self._waiting.add(task)
        try:
            yield lambda: self._waiting.discard(task)
        except asyncio.CancelledError:
            if task not in self._cut:
                raise
            task.uncancel()
            raise ShuttingDown(
                "the gateway is shutting down; send the request again", retry_after_s=AGAIN_AFTER_S
            ) from None
        finally:
            self._waiting.discard(task)
            self._cut.discard(task)

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """The Litestar middleware that watches its HTTP requests until their answer
        starts."""

        async def watched(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != ScopeType.HTTP:
                await app(scope, receive, send)
                return
            async with self.waiting() as answered:

                async def answer(message: Message) -> None:
                    if message["type"] == "http.response.start":
                        answered()
                    await send(message)

                await app(scope, receive, answer)

        return watched
