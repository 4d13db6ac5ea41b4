"""One Redis reader per gateway process, fanned out to every open stream in it.

Engines append each event to the session's stream and publish the same event on the
session's live channel in one script (wire/scripts.py). The hub holds one pub/sub
connection for the whole process; each ``Feed`` (gateway/feed.py: one per open SSE stream,
WebSocket subscription or API request) gets live events pushed into a small bounded buffer.

Redis is the source of truth, the live channel only a shortcut: a feed that opens, resumes,
falls behind (its buffer overflows because the client reads slowly) or loses the pub/sub
connection simply re-reads the stream from its last delivered id. That gives ordered,
gap-free, duplicate-free delivery with bounded memory per reader and a constant number of
Redis connections per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Protocol, cast

import redis.asyncio as aioredis
from redis._parsers.hiredis import NOT_ENOUGH_DATA
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

import wire
from gateway.errors import BadRequest, EventsExpired
from gateway.feed import CATCH_UP_PAGE, LIVE_ONLY, Feed, RelayEvent
from wire import FinalEvent, Keys, entry_id_key

log = logging.getLogger("tokenspout.relay")


class RelayObserver(Protocol):
    """Told of every live event once per process (gateway/metrics.py counts with it)."""

    def event(self, session_id: str, event: RelayEvent) -> None: ...

    def unwatched(self, session_id: str) -> None:
        """The last feed of the session in this process closed."""

    def redis_error(self, where: str) -> None: ...

    def fell_behind(self) -> None:
        """A feed's buffer overflowed (its reader is slow): dropped, re-read from Redis."""


def _raise_if_trimmed(stream_info: dict[str, object], after_id: str) -> None:
    """Events after ``after_id`` are gone when it lies before the oldest entry kept and the
    stream has been trimmed (an id at the exact trim boundary counts as gone too: a
    needless reload is better than a silent gap)."""
    first = stream_info.get("first-entry")
    if not isinstance(first, (tuple, list)) or not first:
        return
    trimmed = int(cast(int, stream_info.get("entries-added", 1 << 62))) > int(
        cast(int, stream_info.get("length", 0))
    )
    if trimmed and entry_id_key(after_id) < entry_id_key(wire.text(first[0])):
        raise EventsExpired(f"events after {after_id} were trimmed; reload the session history")


class RelayHub:
    """The process-wide reader: one pub/sub connection, any number of feeds."""

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
        self._pubsub: PubSub = redis.pubsub()
        self._feeds: dict[str, set[Feed]] = {}
        self._confirmed: set[str] = set()
        self._reader: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._commands = asyncio.Lock()
        """One (un)subscribe at a time: redis-py's PubSub opens its connection on first use,
        and concurrent first calls would each open one, stranding their channels."""

    @property
    def open_feeds(self) -> int:
        return sum(len(feeds) for feeds in self._feeds.values())

    def watched_sessions(self) -> list[str]:
        return [self.keys.session_id_of_channel(channel) for channel in self._feeds]

    def begin_drain(self) -> None:
        """The process is shutting down: wake every feed so transports can end streams."""
        self.draining = True
        for feeds in self._feeds.values():
            for feed in feeds:
                feed._wake()

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read_forever(), name="relay-reader")

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self._pubsub.aclose()  # type: ignore[no-untyped-call]

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
                feed._set_ready(True)
            elif len(feeds) == 1:
                async with self._commands:
                    await self._pubsub.subscribe(channel)
                self._subscribed.set()
            yield feed
        finally:
            feed._close()
            feeds.discard(feed)
            if not feeds:
                del self._feeds[channel]
                self._confirmed.discard(channel)
                if self.observer is not None:
                    self.observer.unwatched(session_id)
                try:
                    async with self._commands:
                        await self._pubsub.unsubscribe(channel)
                except (RedisError, OSError) as exc:
                    # Harmless: messages of an unwatched channel are dropped, and a lost
                    # pub/sub connection resubscribes only the channels still watched.
                    log.warning("unsubscribing %s failed: %s", channel, exc)
                    if self.observer is not None:
                        self.observer.redis_error("relay")

    async def read_after(self, session_id: str, after_id: str | None) -> list[RelayEvent]:
        """The next page of the stream after ``after_id``; ``EventsExpired`` if some of what
        follows it was trimmed (a reader slower than ``TOKENSPOUT_EVENTS_MAXLEN`` allows)."""
        key = self.keys.events(session_id)
        if after_id is None:
            entries = wire.entries_of(await self.redis.xrange(key, count=CATCH_UP_PAGE))
        else:
            # One transaction: the page and the trim mark describe the same moment.
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xrange(key, min=f"({after_id}", count=CATCH_UP_PAGE)
                pipe.xinfo_stream(key)
                try:
                    page, info = await pipe.execute()
                except RedisError as exc:
                    if "no such key" not in str(exc).lower():
                        raise
                    return []
            _raise_if_trimmed(info, after_id)
            entries = wire.entries_of(page)
        return [
            RelayEvent(
                entry_id.decode(),
                fields[b"t"].decode(),
                fields[b"g"].decode(),
                fields[b"d"],
            )
            for entry_id, fields in entries
        ]

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
                if not looked_up and feed.last_id != LIVE_ONLY:
                    # Subscribed: a final event from now on reaches the feed, and one
                    # from before is in the generation's hash.
                    looked_up = True
                    key = self.keys.generation(session_id, generation_id)
                    stored = await self.redis.hget(key, "final")
                    if stored is not None:
                        return wire.decode_final(stored)
        return None

    async def check_resumable(self, session_id: str, after_id: str | None) -> None:
        """Raise ``EventsExpired`` when events after ``after_id`` are no longer kept."""
        if after_id not in (None, LIVE_ONLY):
            await self._check_not_trimmed(session_id, after_id)

    async def _check_not_trimmed(self, session_id: str, after_id: str) -> None:
        try:
            entry_id_key(after_id)
        except ValueError:
            raise BadRequest(
                f"{after_id!r} is not an event id", code="bad_event_id", field="last_event_id"
            ) from None
        try:
            info = await self.redis.xinfo_stream(self.keys.events(session_id))
        except RedisError as exc:
            if "no such key" in str(exc).lower():
                return
            raise
        _raise_if_trimmed(info, after_id)

    async def _read_forever(self) -> None:
        backoff = 0.05
        while True:
            try:
                if not self._pubsub.subscribed:
                    if self._feeds:
                        await self._resubscribe()
                    else:
                        await self._subscribed.wait()
                        self._subscribed.clear()
                    continue
                message = await self._pubsub.get_message(timeout=1.0)
                backoff = 0.05
                if message is not None:
                    self._dispatch(message)
                    await self._drain_parsed()
            except (RedisError, OSError) as exc:
                # Pub/sub lost: every feed re-reads the stream once resubscribed.
                log.warning("relay pub/sub connection lost (%s); reconnecting", exc)
                if self.observer is not None:
                    self.observer.redis_error("relay")
                self._confirmed.clear()
                for feeds in self._feeds.values():
                    for feed in feeds:
                        feed._set_ready(False)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                with contextlib.suppress(RedisError, OSError):
                    await self._pubsub.aclose()  # type: ignore[no-untyped-call]
                self._pubsub = self.redis.pubsub()

    async def _drain_parsed(self) -> None:
        """Dispatch the replies already read and parsed, without redis-py's per-message path.

        One socket read brings many live messages at load; ``get_message`` costs tens of
        microseconds each (timeouts, retry wrapper, a dict per message), the hiredis reader
        a microsecond. Live messages go straight to the feeds; anything else (subscribe
        confirmations) still goes through redis-py's ``handle_message`` bookkeeping.
        This reads redis-py's parser internals (``_parser._reader``, ``NOT_ENOUGH_DATA``):
        redis is pinned in pyproject.toml, and tests/test_sessions.py covers the path.
        """
        parser = getattr(self._pubsub.connection, "_parser", None)
        reader = getattr(parser, "_reader", None)
        if reader is None:  # not the hiredis parser: get_message does it all
            return
        pubsub = self._pubsub
        while (reply := reader.gets()) is not NOT_ENOUGH_DATA:
            if isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message":
                self._deliver(reply[1], reply[2])
            elif isinstance(reply, Exception):
                raise reply
            elif reply not in pubsub.health_check_response:
                message = await pubsub.handle_message(reply)  # type: ignore[no-untyped-call]
                if message is not None:
                    self._dispatch(message)

    async def _resubscribe(self) -> None:
        async with self._commands:
            await self._pubsub.subscribe(*self._feeds)

    def _deliver(self, raw_channel: bytes, data: bytes) -> None:
        channel = raw_channel.decode()
        event_id, event_type, generation_id, payload = data.split(b" ", 3)
        event = RelayEvent(event_id.decode(), event_type.decode(), generation_id.decode(), payload)
        if self.observer is not None:
            self.observer.event(self.keys.session_id_of_channel(channel), event)
        for feed in self._feeds.get(channel, ()):
            feed._push(event)

    def _dispatch(self, message: dict[str, object]) -> None:
        kind = message["type"]
        channel = message["channel"]
        if kind == "message":
            data = message["data"]
            assert isinstance(channel, bytes) and isinstance(data, bytes)
            self._deliver(channel, data)
            return
        channel = channel.decode() if isinstance(channel, bytes) else str(channel)
        if kind == "subscribe" and channel in self._feeds:
            self._confirmed.add(channel)
            for feed in self._feeds[channel]:
                feed._set_ready(True)
