"""Session ids for one-shot API requests whose live channels are subscribed ahead.

A one-shot request (a chat completion, a TGI ``/generate``) makes a session of its own and
must be subscribed to its live channel before it submits, so that its first event comes
live. Subscribing each request's channel on its own costs a ``SUBSCRIBE`` written and its
confirmation read, per request, and one turn of the event loop before the submit. This
process instead subscribes the channels of ``BATCH`` fresh session ids in one command,
ahead of need; a request takes one whose subscription Redis has confirmed. When none is
ready (the first requests, a burst, a lost connection) the request subscribes its own.

The ids are the same random session ids (gateway/core/ids.py); nothing publishes on a spare's
channel until a request has taken it and submitted.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from gateway.core.ids import new_id
from gateway.core.relay.live import LiveSource
from wire import Keys

log = logging.getLogger("tokenspout.relay")

BATCH = 32
"""Channels subscribed in one command; a new batch is asked for when fewer than half of
one are left."""


class SpareSessions:
    """The spares of one process: subscribed ones waiting for their confirmation, and
    confirmed ones ready to take."""

    def __init__(self, keys: Keys, live: LiveSource) -> None:
        self.keys = keys
        self.live = live
        self._ready: dict[str, str] = {}
        """channel -> session id: confirmed, ready to take (oldest first)."""
        self._waiting: dict[str, str] = {}
        """channel -> session id: asked for, its subscription not confirmed (yet, again)."""
        self._filling: asyncio.Task[None] | None = None

    @property
    def ready(self) -> int:
        return len(self._ready)

    def take(self) -> tuple[str, str] | None:
        """A confirmed spare, (session id, channel), now the caller's; None when none is
        ready. Asks for a new batch once few are left."""
        if len(self._ready) + len(self._waiting) < BATCH // 2:
            self.fill()
        if not self._ready:
            return None
        channel = next(iter(self._ready))
        return self._ready.pop(channel), channel

    def fill(self) -> None:
        """Subscribe a new batch, unless one is being subscribed."""
        if self._filling is not None and not self._filling.done():
            return
        batch = {}
        for _ in range(BATCH):
            session_id = new_id("s")
            batch[self.keys.live_channel(session_id)] = session_id
        self._waiting.update(batch)
        self._filling = asyncio.create_task(self._subscribe(list(batch)), name="relay-spares")

    def confirmed(self, channel: str, ready: bool) -> None:
        """The subscription of ``channel`` holds, or was lost (the live source subscribes
        it again); nothing if it is no spare's."""
        source, target = (self._waiting, self._ready) if ready else (self._ready, self._waiting)
        if (session_id := source.pop(channel, None)) is not None:
            target[channel] = session_id

    async def close(self) -> None:
        if self._filling is not None:
            self._filling.cancel()
            await asyncio.gather(self._filling, return_exceptions=True)

    async def _subscribe(self, channels: list[str]) -> None:
        # Asked together, in one pass of the event loop: the live source sends them as one
        # command (gateway/core/relay/live.py).
        results = await asyncio.gather(
            *(self.live.subscribe(channel) for channel in channels), return_exceptions=True
        )
        for channel, result in zip(channels, results, strict=True):
            if isinstance(result, BaseException):
                self._waiting.pop(channel, None)
                # Anything but Redis or the network failing is a bug: nobody awaits this.
                expected = isinstance(result, RedisError | OSError)
                log.log(
                    logging.WARNING if expected else logging.ERROR,
                    "subscribing a spare session channel failed: %s",
                    result,
                    exc_info=None if expected else result,
                )
