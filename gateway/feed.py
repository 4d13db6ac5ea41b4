"""A ``Feed``: the events of one session after a given id, for one open stream, fed by the
process's one Redis reader (``RelayHub``, gateway/relay.py).

The hub pushes live events into the feed's small bounded buffer; a feed that opens,
resumes, falls behind or loses the pub/sub connection re-reads the session's stream from
its last delivered id (``RelayHub.read_after``), so it delivers every event in order,
exactly once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, NamedTuple

from redis.exceptions import RedisError

from gateway.errors import SessionLost
from wire import TERMINAL_EVENTS, entry_id_key

if TYPE_CHECKING:
    from gateway.relay import RelayHub

log = logging.getLogger("tokenspout.relay")

CATCH_UP_PAGE = 256
RETRY_S = 0.25
LIVE_ONLY = "$"
NEW_SESSION = "new"
"""``after_id`` of a feed opened before its session has any event (a one-shot API request
subscribes, then makes the session): no catch-up read, unless the first live event is not
the session's first (``queued``), i.e. the subscription came after some were published."""
DRAIN_POLL_S = 0.25
"""While the process drains, a waiting feed returns at least this often."""


class RelayEvent(NamedTuple):
    id: str
    type: str
    generation_id: str
    data: bytes

    @property
    def is_final(self) -> bool:
        return self.type in TERMINAL_EVENTS


class Feed:
    """Events of one session after a given id, delivered in order, each exactly once.

    A process holds one per open stream, 10,000 of them or more: slots, a list for the
    buffer and a future only while waiting (an ``asyncio.Event`` and a ``deque`` each carry
    a deque of over 600 bytes).

    The heartbeat timeout is a timer that is moved lazily: a feed that gets events every
    few milliseconds only pushes its deadline forward (a float), and the timer, when it
    fires before that deadline, re-arms itself once. An ``asyncio.timeout`` per wait cost a
    timer, a cancel and an uncancel for every batch: a tenth of the relay's CPU at load.
    """

    __slots__ = (
        "_buffer",
        "_deadline",
        "_lagging",
        "_last_key",
        "_loop",
        "_new_session",
        "_ready",
        "_recovering",
        "_timer",
        "_waiter",
        "hub",
        "last_id",
        "session_id",
    )

    def __init__(self, hub: RelayHub, session_id: str, after_id: str | None) -> None:
        self.hub = hub
        self.session_id = session_id
        self._new_session = after_id == NEW_SESSION
        if self._new_session:
            after_id = None
        self.last_id = after_id
        self._last_key = entry_id_key(after_id) if after_id and after_id != LIVE_ONLY else (0, 0)
        self._buffer: list[RelayEvent] = []
        self._lagging = True
        self._ready = False
        self._waiter: asyncio.Future[bool] | None = None
        """Resolved with True when the deadline passed, False when there is news."""
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._recovering = False
        self._loop = asyncio.get_running_loop()
        """Looked up once: CPython 3.11's ``get_running_loop`` makes a ``getpid`` system
        call each time (4-9 % of the gateway's busy samples when called per batch)."""

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(False)

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # not waiting: the next wait arms a timer again
        loop = waiter.get_loop()
        if loop.time() >= self._deadline:
            waiter.set_result(True)
        else:  # the deadline moved on since this timer was set
            self._timer = loop.call_at(self._deadline, self._on_timer)

    def _close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # called by the hub, in the reader task

    def _push(self, event: RelayEvent) -> None:
        if self._lagging:
            return  # the next catch-up read gets it from the stream
        if self._new_session:
            self._new_session = False
            if event.type != "queued":  # subscribed too late for the first: read them
                self._fall_behind()
                return
        self._buffer.append(event)
        if len(self._buffer) > self.hub.buffer_limit:
            self._fall_behind()
            if self.hub.observer is not None:
                self.hub.observer.fell_behind()
        self._wake()

    def _fall_behind(self) -> None:
        self._lagging = True
        self._buffer.clear()
        self._wake()

    def _set_ready(self, ready: bool) -> None:
        if not ready:
            self._recovering = True
            self._new_session = False
        self._ready = ready
        if ready and self._new_session:
            self._lagging = False  # nothing to read yet: every event comes live
            return
        self._fall_behind()

    # called by the transport

    async def next_batch(self, timeout: float) -> list[RelayEvent]:
        """The next events in order; an empty list when ``timeout`` passes with none."""
        while True:
            if self._lagging and self._ready:
                resolving_live = self.last_id == LIVE_ONLY
                try:
                    events = await self._catch_up()
                except (RedisError, OSError) as exc:
                    # Redis is away: keep the client (heartbeats) and try again shortly.
                    log.warning("catch-up read for %s failed: %s", self.session_id, exc)
                    if self.hub.observer is not None:
                        self.hub.observer.redis_error("catch_up")
                    self._lagging = True
                    await asyncio.sleep(min(timeout, RETRY_S))
                    return []
                if events or resolving_live:
                    return events
                continue
            if self._buffer and not self._lagging:
                events = self._fresh(self._buffer)
                self._buffer = []
                if events:
                    self._advance(events[-1].id)
                    return events
                continue
            if self.hub.draining:
                timeout = min(timeout, DRAIN_POLL_S)
            # Nothing else runs between the checks above and this wait, so no wake-up is
            # lost: the hub can only push once this task awaits.
            loop = self._loop
            self._deadline = deadline = loop.time() + timeout
            timer = self._timer
            if timer is None or timer.when() > deadline:
                if timer is not None:
                    timer.cancel()
                self._timer = loop.call_at(deadline, self._on_timer)
            self._waiter = loop.create_future()
            try:
                timed_out = await self._waiter
            finally:
                self._waiter = None
            if timed_out:
                return []
            if self.hub.draining and not self._buffer and not self._lagging:
                return []  # woken by begin_drain: let the transport decide to close

    def _fresh(self, events: list[RelayEvent]) -> list[RelayEvent]:
        # Live events arrive in stream order, so only a prefix can repeat what a catch-up
        # read already delivered: compare ids until the first new one, not for every event.
        start = 0
        while start < len(events) and entry_id_key(events[start].id) <= self._last_key:
            start += 1
        return events[start:] if start else events

    async def _catch_up(self) -> list[RelayEvent]:
        # Live events that arrive while the stream is read land in the buffer; any that
        # overlap with the read are dropped by id, so nothing is lost or repeated.
        self._lagging = False
        self._buffer.clear()
        if self.last_id == LIVE_ONLY:
            self._advance(await self.hub.last_event_id(self.session_id) or "0-0")
            return []
        page = await self.hub.read_after(self.session_id, self.last_id)
        if self._recovering:
            # Back from a lost connection: if Redis lost the session, say so instead of
            # waiting for events that will never come.
            self._recovering = False
            if not page and not await self.hub.session_exists(self.session_id):
                raise SessionLost("the session's data was lost (Redis restarted without it)")
        if len(page) >= CATCH_UP_PAGE:
            self._lagging = True
        if page:
            self._advance(page[-1].id)
        return page

    def _advance(self, event_id: str) -> None:
        self.last_id = event_id
        self._last_key = entry_id_key(event_id)

    async def events(self, heartbeat_s: float) -> AsyncIterator[list[RelayEvent]]:
        """Batches forever; an empty batch every ``heartbeat_s`` while nothing happens."""
        while True:
            yield await self.next_batch(heartbeat_s)
