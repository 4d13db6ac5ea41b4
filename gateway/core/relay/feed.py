"""A ``Feed``: the events of one session after a given id, for one open stream, fed by the
process's one Redis reader (``RelayHub``, gateway/core/relay/hub.py).

The hub pushes live events into the feed's small bounded buffer; a feed that opens,
resumes, falls behind or loses the pub/sub connection re-reads the session's stream from
its last delivered id (``FeedHub.read_after``), so it delivers every event in order,
exactly once. Where it stands is one ``FeedState``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator
from typing import NamedTuple, Protocol

from redis.exceptions import RedisError

from gateway.core.errors import SessionLost
from wire import TERMINAL_EVENTS, entry_id_key

log = logging.getLogger("tokenspout.relay")

CATCH_UP_PAGE = 256
RETRY_S = 0.25
LIVE_ONLY = "$"
"""``after_id`` of a feed of only the events that come after it is subscribed."""
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


class FeedHub(Protocol):
    """What a feed needs of its hub (``RelayHub``; a fake in tests/inprocess/test_feed.py)."""

    @property
    def draining(self) -> bool: ...

    @property
    def buffer_limit(self) -> int: ...

    async def read_after(self, session_id: str, after_id: str | None) -> list[RelayEvent]: ...

    async def last_event_id(self, session_id: str) -> str | None: ...

    async def session_exists(self, session_id: str) -> bool: ...

    def fell_behind(self) -> None: ...

    def redis_error(self, where: str) -> None: ...

    def went_quiet(self, session_id: str) -> None:
        """A feed of the session waited its whole timeout (a heartbeat) for an event."""


class FeedState(enum.Enum):
    """Where a feed stands. Live events are kept only in ``LIVE`` (and, the first one, in
    ``FIRST_EVENT``); in the states that need a read (``needs_read``) the next batch reads
    the stream, and live events are dropped meanwhile (the read finds them)."""

    SUBSCRIBING = "subscribing"
    """Waiting for the subscription; then ``BEHIND``."""
    SUBSCRIBING_FROM_NOW = "subscribing from now"
    """A live-only feed waiting for the subscription; then ``FROM_NOW``."""
    SUBSCRIBING_NEW = "subscribing to a new session"
    """Opened before its session exists, waiting for the subscription; then ``FIRST_EVENT``."""
    LOST = "lost"
    """The subscription was lost; once back, ``BEHIND_AFTER_LOSS``."""
    FROM_NOW = "from now"
    """Subscribed: the stream's last id becomes the position, then ``LIVE``."""
    BEHIND = "behind"
    """Subscribed: read the stream after the last id, then ``LIVE``."""
    BEHIND_AFTER_LOSS = "behind after a loss"
    """The same, and a read that finds nothing checks Redis still has the session."""
    FIRST_EVENT = "first event"
    """Subscribed to a new session: the first live event must be its first (``queued``),
    else the feed subscribed too late and is ``BEHIND``."""
    LIVE = "live"
    """Live events go to the buffer."""

    @property
    def needs_read(self) -> bool:
        return self in _NEEDS_READ


_NEEDS_READ = {FeedState.FROM_NOW, FeedState.BEHIND, FeedState.BEHIND_AFTER_LOSS}
_CONFIRMED = {
    FeedState.SUBSCRIBING: FeedState.BEHIND,
    FeedState.SUBSCRIBING_FROM_NOW: FeedState.FROM_NOW,
    FeedState.SUBSCRIBING_NEW: FeedState.FIRST_EVENT,
    FeedState.LOST: FeedState.BEHIND_AFTER_LOSS,
    FeedState.FROM_NOW: FeedState.FROM_NOW,
    FeedState.BEHIND: FeedState.BEHIND,
    FeedState.BEHIND_AFTER_LOSS: FeedState.BEHIND_AFTER_LOSS,
    FeedState.FIRST_EVENT: FeedState.BEHIND,  # resubscribed: some may have come meanwhile
    FeedState.LIVE: FeedState.BEHIND,
}
"""The state after a (re)confirmed subscription."""
_KEEPS_LIVE = {FeedState.LIVE, FeedState.FIRST_EVENT}
"""Subscribed and up to date: a wait ends only with news (or the heartbeat)."""
_UNRESOLVED = {FeedState.SUBSCRIBING_FROM_NOW, FeedState.FROM_NOW}
"""Live-only feeds whose position is not known yet (a loss keeps them live-only)."""
_NEW = {FeedState.SUBSCRIBING_NEW, FeedState.FIRST_EVENT}
"""Feeds of a new session with no event yet: a loss makes them read it from the start once
back (its first events may have come meanwhile), and an empty read is no lost session (the
request that opened the feed may not have made it yet)."""


class Feed:
    """Events of one session after a given id, delivered in order, each exactly once.

    A process holds one per open stream, 10,000 of them or more: slots, a list for the
    buffer and a future only while waiting (an ``asyncio.Event`` and a ``deque`` each carry
    a deque of over 600 bytes).

    The heartbeat timeout is a timer that is moved lazily: a feed that gets events every
    few milliseconds only pushes its deadline forward (a float), and the timer, when it
    fires before that deadline, re-arms itself once. An ``asyncio.timeout`` per wait would
    cost a timer, a cancel and an uncancel for every batch: a tenth of the relay's CPU at
    load.
    """

    __slots__ = (
        "_buffer",
        "_deadline",
        "_last_key",
        "_loop",
        "_timer",
        "_waiter",
        "hub",
        "last_id",
        "session_id",
        "state",
    )

    def __init__(self, hub: FeedHub, session_id: str, after_id: str | None) -> None:
        """``after_id``: an event id, None (from the first kept), ``LIVE_ONLY`` or
        ``NEW_SESSION``."""
        self.hub = hub
        self.session_id = session_id
        self.state = FeedState.SUBSCRIBING
        if after_id == LIVE_ONLY:
            self.state, after_id = FeedState.SUBSCRIBING_FROM_NOW, None
        elif after_id == NEW_SESSION:
            self.state, after_id = FeedState.SUBSCRIBING_NEW, None
        self.last_id = after_id
        """The last event delivered (or the one to start after); None: none yet."""
        self._last_key = entry_id_key(after_id) if after_id else (0, 0)
        self._buffer: list[RelayEvent] = []
        self._waiter: asyncio.Future[bool] | None = None
        """Resolved with True when the deadline passed, False when there is news."""
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        """Looked up once: CPython 3.11's ``get_running_loop`` makes a ``getpid`` system
        call each time (4-9 % of the gateway's busy samples when called per batch)."""

    @property
    def positioned(self) -> bool:
        """Its position in the stream is known (a live-only feed: once subscribed, read)."""
        return self.state not in _UNRESOLVED

    # called by the hub, in the reader task

    def push(self, event: RelayEvent) -> None:
        """A live event of the session."""
        state = self.state
        if state is FeedState.FIRST_EVENT:
            if event.type != "queued":  # subscribed too late for the first: read them
                self._fall_behind()
                return
            self.state = state = FeedState.LIVE
        if state is not FeedState.LIVE:
            return  # the next catch-up read gets it from the stream
        self._buffer.append(event)
        if len(self._buffer) > self.hub.buffer_limit:
            self._fall_behind()
            self.hub.fell_behind()
        self.wake()

    def confirmed(self, ready: bool) -> None:
        """The session's subscription holds (``ready``), or was lost."""
        if ready:
            self.state = _CONFIRMED[self.state]
            if self.state is FeedState.FIRST_EVENT:
                return  # nothing to read yet: every event comes live
        elif self.state in _UNRESOLVED:
            self.state = FeedState.SUBSCRIBING_FROM_NOW
        elif self.state in _NEW:
            self.state = FeedState.SUBSCRIBING
        else:
            self.state = FeedState.LOST
        self._buffer.clear()
        self.wake()

    def wake(self) -> None:
        """End a wait of ``next_batch`` now (news, or the process drains)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(False)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fall_behind(self) -> None:
        self.state = FeedState.BEHIND
        self._buffer.clear()
        self.wake()

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

    # called by the transport

    async def next_batch(self, timeout: float) -> list[RelayEvent]:
        """The next events in order; an empty list when ``timeout`` passes with none."""
        while True:
            state = self.state
            if state.needs_read:
                try:
                    events = await self._catch_up()
                except (RedisError, OSError) as exc:
                    # Redis is away: keep the client (heartbeats) and try again shortly.
                    log.warning("catch-up read for %s failed: %s", self.session_id, exc)
                    self.hub.redis_error("catch_up")
                    if self.state in (FeedState.LIVE, FeedState.BEHIND):
                        self.state = state  # the read is still to do
                    await asyncio.sleep(min(timeout, RETRY_S))
                    return []
                if events or state is FeedState.FROM_NOW:
                    return events
                continue
            if self._buffer and state is FeedState.LIVE:
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
                self.hub.went_quiet(self.session_id)
                return []
            if self.hub.draining and not self._buffer and self.state in _KEEPS_LIVE:
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
        before, self.state = self.state, FeedState.LIVE
        self._buffer.clear()
        if before is FeedState.FROM_NOW:
            self._advance(await self.hub.last_event_id(self.session_id) or "0-0")
            return []
        page = await self.hub.read_after(self.session_id, self.last_id)
        # Back from a lost connection: if Redis lost the session, say so instead of waiting
        # for events that will never come.
        lost = before is FeedState.BEHIND_AFTER_LOSS and not page
        if lost and not await self.hub.session_exists(self.session_id):
            raise SessionLost("the session's data was lost (Redis restarted without it)")
        if len(page) >= CATCH_UP_PAGE and self.state is FeedState.LIVE:
            self.state = FeedState.BEHIND
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
