"""One Redis reader per gateway process, fanned out to every open stream in it.

Engines append each event to the session's stream and publish the same event on the
session's live channel in one script (wire/scripts.py). The hub holds one pub/sub
connection for the whole process; each ``Feed`` (gateway/core/relay/feed.py: one per open
SSE stream, WebSocket subscription or API request) gets live events pushed into a small
bounded buffer.

Redis is the source of truth, the live channel only a shortcut: a feed that opens, resumes,
falls behind (its buffer overflows because the client reads slowly) or loses the pub/sub
connection simply re-reads the stream from its last delivered id. That gives ordered,
gap-free, duplicate-free delivery with bounded memory per reader and a constant number of
Redis connections per process.

Where live events come from is a ``LiveSource`` (gateway/core/relay/live.py): one pub/sub connection
(``PlainLive``), or on a Redis Cluster sharded pub/sub, one connection per primary that
serves a watched session (``ShardedLive``, gateway/core/relay/shards.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Protocol, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

import wire
from gateway.core.errors import AGAIN_AFTER_S, EventsExpired, EventsLost, ShuttingDown, bad_event_id
from gateway.core.ids import new_id
from gateway.core.relay.feed import CATCH_UP_PAGE, LIVE_ONLY, NEW_SESSION, Feed, RelayEvent
from gateway.core.relay.live import LiveSource, PlainLive
from gateway.core.relay.shards import ShardedLive
from gateway.core.relay.spares import SpareSessions
from gateway.core.relay.waiting import WaitingGenerations
from wire import FinalEvent, Keys, entry_id_key
from wire.topology import topology_of

log = logging.getLogger("tokenspout.relay")


class RelayObserver(Protocol):
    """Told of every live event once per process (gateway/server/metrics.py counts with it)."""

    def event(self, session_id: str, event: RelayEvent) -> None: ...

    def unwatched(self, session_id: str) -> None:
        """The last feed of the session in this process closed."""

    def redis_error(self, where: str) -> None: ...

    def fell_behind(self) -> None:
        """A feed's buffer overflowed (its reader is slow): dropped, re-read from Redis."""


EVENT_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")
FROM_THE_START = "0"
"""The id before every event (Redis's own spelling of it), as a resume point."""
NO_STREAM: dict[str, object] = {"last-generated-id": b"0-0"}
"""What ``XINFO STREAM`` would say of a stream that was never written."""


def check_event_id(given: str) -> None:
    """``BadRequest`` unless ``given`` is an id Redis could have made (``<ms>-<seq>``)."""
    if given == FROM_THE_START:
        return
    match = EVENT_ID.fullmatch(given)
    if match is None or any(int(part) >= 1 << 64 for part in match.groups()):
        raise bad_event_id(given)


def _check_position(
    stream_info: dict[str, object], after_id: str, known: bool, created: bytes | None
) -> None:
    """Raise ``EventsLost`` when ``after_id`` is past the last id the stream ever made (it
    could only have come from a stream Redis since lost, or from nowhere: a reader would
    wait for ever, every later event sorting before it), or is within the stream but
    ``known`` to it neither as an event nor as the id right before one (``just_before``: a
    WebSocket turn reads from its ``queued`` event so), or is such an id made after the
    session was (``created``, its meta's) but before a stream that never dropped an event:
    Redis lost it, and may have written new events since (a lost turn submitted again, its
    reply from the start; an id before the session, ``0-0`` say, reads it from its start);
    ``EventsExpired`` when events after it were trimmed (an id at the exact trim boundary
    counts as gone too: a needless reload is better than a silent gap)."""
    last = stream_info.get("last-generated-id")
    last_id = None if last is None or wire.text(last) == "0-0" else wire.text(last)
    if last is not None and entry_id_key(after_id) > entry_id_key(wire.text(last)):
        raise EventsLost(after_id, last_id)
    first = stream_info.get("first-entry")
    if not isinstance(first, (tuple, list)) or not first:
        return
    if entry_id_key(after_id) < entry_id_key(wire.text(first[0])):
        trimmed = int(cast(int, stream_info.get("entries-added", 1 << 62))) > int(
            cast(int, stream_info.get("length", 0))
        )
        if trimmed:
            raise EventsExpired(
                f"events after {after_id} were trimmed (a session keeps its last "
                "TOKENSPOUT_EVENTS_MAXLEN); reload the session's history"
            )
        # Made since the session was, before a stream that never dropped an event: one made
        # anew after Redis lost the old (a lost turn submitted again, its reply from the start).
        made_since = created is not None and entry_id_key(after_id)[0] >= float(created) * 1000
        if made_since and not known:
            raise EventsLost(after_id, last_id, missing=True)
    elif not known:
        raise EventsLost(after_id, last_id, missing=True)


def _same_id(entry_id: bytes | str, event_id: str) -> bool:
    return entry_id_key(wire.text(entry_id)) == entry_id_key(event_id)


class RelayHub:
    """The process-wide reader: one live source, any number of feeds; to each feed it is
    the ``FeedHub`` that reads the session's stream."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        buffer_limit: int,
        observer: RelayObserver | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.buffer_limit = buffer_limit
        self.observer = observer
        self.draining = False
        self._cut_at: float | None = None
        self.live: LiveSource = (
            ShardedLive(redis, self._deliver, self._confirm)
            if topology_of(redis).sharded
            else PlainLive(redis, self._deliver, self._confirm, self._connection_lost)
        )
        self.spares = SpareSessions(keys, self.live) if isinstance(self.live, PlainLive) else None
        """Session ids of one-shot requests, subscribed ahead (gateway/core/relay/spares.py).
        Not on a cluster, where spread over every slot they would hold a connection to
        every primary, not only to those serving a watched session."""
        self._feeds: dict[str, set[Feed]] = {}
        self._confirmed: set[str] = set()
        self.waiting = WaitingGenerations()
        """What this process's readers wait on that has not started
        (gateway/core/relay/waiting.py)."""

    @property
    def open_feeds(self) -> int:
        return sum(len(feeds) for feeds in self._feeds.values())

    def watched_sessions(self) -> list[str]:
        return [self.keys.session_id_of_channel(channel) for channel in self._feeds]

    def watches(self, session_id: str) -> bool:
        """A feed of this process reads the session now."""
        return self.keys.live_channel(session_id) in self._feeds

    def begin_drain(self, cut_after_s: float = 0.0) -> None:
        """The process is shutting down: wake every feed so transports can end streams.
        One-shot requests still waiting ``cut_after_s`` from now are answered
        ``ShuttingDown`` (``raise_if_cut``)."""
        self.draining = True
        self._cut_at = time.monotonic() + cut_after_s
        for feeds in self._feeds.values():
            for feed in feeds:
                feed.wake()

    def raise_if_cut(self) -> None:
        """For a request that waits for its whole generation: past the drain's cut, end it
        with a retryable 503 in its own format, before the server's grace runs out: uvicorn
        would cancel it and answer a plain-text 500."""
        if self._cut_at is not None and time.monotonic() >= self._cut_at:
            raise ShuttingDown(
                "the gateway is shutting down; send the request again", retry_after_s=AGAIN_AFTER_S
            )

    async def start(self) -> None:
        await self.live.start()
        if self.spares is not None:
            self.spares.fill()

    async def stop(self) -> None:
        if self.spares is not None:
            await self.spares.close()
        await self.live.close()

    def fell_behind(self) -> None:
        if self.observer is not None:
            self.observer.fell_behind()

    def redis_error(self, where: str) -> None:
        if self.observer is not None:
            self.observer.redis_error(where)

    def went_quiet(self, session_id: str) -> None:
        self.waiting.went_quiet(session_id)

    @contextlib.asynccontextmanager
    async def open(self, session_id: str, after_id: str | None = None) -> AsyncIterator[Feed]:
        """A feed of the session's events after ``after_id`` (None: from the first kept,
        ``"$"``: only new ones)."""
        feed = Feed(self, session_id, after_id)
        channel = self.keys.live_channel(session_id)
        feeds = self._feeds.setdefault(channel, set())
        feeds.add(feed)
        try:
            if channel in self._confirmed:
                feed.confirmed(True)
            elif len(feeds) == 1:
                await self.live.subscribe(channel)
            yield feed
        finally:
            feed.close()
            feeds.discard(feed)
            if not feeds:
                del self._feeds[channel]
                self._confirmed.discard(channel)
                self.waiting.unwatched(session_id)
                if self.observer is not None:
                    self.observer.unwatched(session_id)
                try:
                    await self.live.unsubscribe(channel)
                except (RedisError, OSError) as exc:
                    # Harmless: messages of an unwatched channel are dropped, and a lost
                    # pub/sub connection resubscribes only the channels still watched.
                    log.warning("unsubscribing %s failed: %s", channel, exc)
                    self.redis_error("relay")

    @contextlib.asynccontextmanager
    async def open_new_session(self) -> AsyncIterator[Feed]:
        """A feed of a session not made yet, under a fresh id (``feed.session_id``): a
        spare whose channel is subscribed already, or else a new one subscribed now."""
        spare = self.spares.take() if self.spares is not None else None
        if spare is None:
            session_id = new_id("s")
        else:
            session_id, channel = spare
            self._confirmed.add(channel)
        async with self.open(session_id, NEW_SESSION) as feed:
            yield feed

    async def read_after(self, session_id: str, after_id: str | None) -> list[RelayEvent]:
        """The next page of the stream after ``after_id``; ``EventsExpired`` if some of what
        follows it was trimmed (a reader slower than ``TOKENSPOUT_EVENTS_MAXLEN`` allows)."""
        key = self.keys.events(session_id)
        if after_id is None:
            entries = wire.entries_of(await self.redis.xrange(key, count=CATCH_UP_PAGE))
        else:
            # One transaction: the page and the trim mark describe the same moment. The
            # page starts at ``after_id`` itself: whether the stream still holds it.
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xrange(key, min=after_id, count=CATCH_UP_PAGE + 1)
                pipe.xinfo_stream(key)
                pipe.hget(self.keys.meta(session_id), "created")
                page, info, created = await pipe.execute(raise_on_error=False)
            if isinstance(info, RedisError):
                if "no such key" not in str(info).lower():
                    raise info
                if created is None:  # no session either: its reader is told it is lost
                    return []
                # The session is there, its stream is not: Redis lost it (its last second
                # before a crash), and the feed read events of it. A turn submitted again
                # would write a new one, the reply from its start, after this feed's id.
                info = NO_STREAM
            for reply in (page, created):
                if isinstance(reply, RedisError):
                    raise reply
            entries = wire.entries_of(page)
            held = bool(entries) and _same_id(entries[0][0], after_id)
            right_before = bool(entries) and _same_id(
                wire.just_before(wire.text(entries[0][0])), after_id
            )
            _check_position(info, after_id, held or right_before, created)
            entries = entries[1:] if held else entries[:CATCH_UP_PAGE]
        events = [
            RelayEvent(
                entry_id.decode(),
                fields[b"t"].decode(),
                fields[b"g"].decode(),
                fields[b"d"],
            )
            for entry_id, fields in entries
        ]
        if self.keys.live_channel(session_id) in self._feeds:  # a reader's catch-up
            for event in events:
                if event.type != "token":
                    self.waiting.saw(session_id, event.type, event.generation_id, event.id)
        return events

    async def session_exists(self, session_id: str) -> bool:
        return bool(await self.redis.exists(self.keys.meta(session_id)))

    async def last_event_id(self, session_id: str) -> str | None:
        entries = wire.entries_of(await self.redis.xrevrange(self.keys.events(session_id), count=1))
        return entries[0][0].decode() if entries else None

    async def wait_final(
        self, session_id: str, generation_id: str, timeout: float
    ) -> FinalEvent | None:
        """The generation's final event, waiting up to ``timeout`` for it to happen."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with self.open(session_id, LIVE_ONLY) as feed:
            looked_up = False
            while (remaining := deadline - loop.time()) > 0:
                for event in await feed.next_batch(remaining):
                    if event.generation_id == generation_id and event.is_final:
                        return wire.decode_final(event.data)
                if not looked_up and feed.positioned:
                    # Subscribed: a final event from now on reaches the feed, and one
                    # from before is in the generation's hash.
                    looked_up = True
                    key = self.keys.generation(session_id, generation_id)
                    stored = await self.redis.hget(key, "final")
                    if stored is not None:
                        return wire.decode_final(stored)
        return None

    async def check_resumable(self, session_id: str, after_id: str | None) -> None:
        """Whether a reader can resume after ``after_id``: ``BadRequest`` when it is no
        event id, ``EventsExpired`` when events after it are no longer kept, ``EventsLost``
        when it is ahead of the stream (a session with no stream has made no id)."""
        if after_id in (None, LIVE_ONLY):
            return
        check_event_id(after_id)
        key = self.keys.events(session_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xrange(key, min=after_id, max=after_id, count=1)
            pipe.xinfo_stream(key)
            pipe.hget(self.keys.meta(session_id), "created")
            held, info, created = await pipe.execute(raise_on_error=False)
        if isinstance(info, RedisError):
            if "no such key" not in str(info).lower():
                raise info
            info = NO_STREAM
        for reply in (held, created):
            if isinstance(reply, RedisError):
                raise reply
        _check_position(info, after_id, bool(held), created)

    def _connection_lost(self) -> None:
        """The plain source's pub/sub connection broke (it reports each channel lost)."""
        self.redis_error("relay")

    def _deliver(self, raw_channel: bytes, data: bytes) -> None:
        """One live message: an event, or an engine step's events of the session, one a
        line (wire/lua/emit_core.lua)."""
        channel = raw_channel.decode()
        feeds = self._feeds.get(channel)
        if feeds is None:  # nobody here watches it (live.py unsubscribes it late)
            return
        session_id = self.keys.session_id_of_channel(channel)
        for line in data.split(b"\n") if b"\n" in data else (data,):
            event_id, event_type, generation_id, payload = line.split(b" ", 3)
            event = RelayEvent(
                event_id.decode(), event_type.decode(), generation_id.decode(), payload
            )
            if self.observer is not None:
                self.observer.event(session_id, event)
            if event.type != "token":
                self.waiting.saw(session_id, event.type, event.generation_id, event.id)
            for feed in feeds:
                feed.push(event)

    def _confirm(self, channel: str, ready: bool) -> None:
        """The channel's subscription is confirmed (its feeds read the stream, then go
        live), or was lost (they wait, then read from their last id)."""
        if channel not in self._feeds:
            if self.spares is not None:
                self.spares.confirmed(channel, ready)
            return
        if ready:
            self._confirmed.add(channel)
        else:
            self._confirmed.discard(channel)
        for feed in self._feeds[channel]:
            feed.confirmed(ready)
