"""gateway/core/relay/hub.py: ``RelayHub`` and its ``Feed``s against the session's real Redis
server, events written the way engines write them (wire/lua/emit_core.lua's emit: XADD, then
PUBLISH)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis

import wire
from gateway.core.errors import BadRequest, EventsExpired, EventsLost
from gateway.core.relay import live
from gateway.core.relay.feed import LIVE_ONLY, NEW_SESSION, Feed, FeedState, RelayEvent
from gateway.core.relay.hub import RelayHub
from gateway.core.relay.spares import BATCH as SPARE_BATCH
from tests.support.redis_probes import command_calls, live_readers
from wire import Keys, Usage
from wire.emit_step import EmitStep, StepCall
from wire.scripts import EMIT_CORE

pytestmark = pytest.mark.timeout(30)

EMIT = EMIT_CORE + "return emit(KEYS[1], '', ARGV[1], ARGV[2], 0, ARGV[3], ARGV[4], ARGV[5])"
SESSION = "s1"


class Observer:
    def __init__(self) -> None:
        self.events: list[RelayEvent] = []
        self.fell = 0
        self.unwatched_sessions: list[str] = []

    def event(self, session_id: str, event: RelayEvent) -> None:
        self.events.append(event)

    def unwatched(self, session_id: str) -> None:
        self.unwatched_sessions.append(session_id)

    def redis_error(self, where: str) -> None:
        raise AssertionError(f"unexpected Redis error in {where}")

    def fell_behind(self) -> None:
        self.fell += 1


class Session:
    """Writes one session's events as an engine does."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, session_id: str = SESSION) -> None:
        self.redis = redis
        self.keys = keys
        self.session_id = session_id
        self.script = redis.register_script(EMIT)

    async def emit(self, event: wire.SessionEvent, maxlen: int = 1000) -> str:
        entry_id = await self.script(
            keys=[self.keys.events(self.session_id)],
            args=[
                self.keys.live_channel(self.session_id),
                maxlen,
                wire.event_type(event),
                event.generation_id,
                wire.encode(event),
            ],
        )
        return wire.text(entry_id)

    async def tokens(self, count: int, start: int = 0) -> list[str]:
        return [await self.emit(token(n)) for n in range(start, start + count)]


def token(n: int) -> wire.Token:
    return wire.Token("g", f"t{n}", n + 1)


@pytest.fixture
def keys() -> Keys:
    return Keys(f"t-{secrets.token_hex(4)}")


@pytest.fixture
def observer() -> Observer:
    return Observer()


HubFactory = Callable[..., Awaitable[RelayHub]]


@pytest.fixture
async def make_hub(
    redis: aioredis.Redis, keys: Keys, observer: Observer
) -> AsyncIterator[HubFactory]:
    hubs: list[RelayHub] = []

    async def make(buffer_limit: int = 1000) -> RelayHub:
        hub = RelayHub(redis, keys, buffer_limit, observer)
        await hub.start()
        hubs.append(hub)
        return hub

    yield make
    for hub in hubs:
        await hub.stop()


@pytest.fixture
def session(redis: aioredis.Redis, keys: Keys) -> Session:
    return Session(redis, keys)


async def read(feed: Feed, count: int, timeout: float = 10) -> list[list[RelayEvent]]:
    """Batches until ``count`` events came (heartbeats, the empty ones, left out)."""
    batches: list[list[RelayEvent]] = []
    async with asyncio.timeout(timeout):
        while sum(map(len, batches)) < count:
            if batch := await feed.next_batch(timeout):
                batches.append(batch)
    return batches


async def told_events_lost_once_back(feed: Feed) -> None:
    """The hub's connection breaks and is back (what it tells each feed): the feed's next
    read says ``events_lost``."""
    feed.confirmed(False)
    feed.confirmed(True)
    with pytest.raises(EventsLost):
        await read(feed, 1)


def ids(batches: list[list[RelayEvent]]) -> list[str]:
    return [event.id for batch in batches for event in batch]


async def subscribed(feed: Feed, session: Session) -> None:
    """Returns once the hub's subscription is confirmed (a feed only reads once it is) and
    an event written after that came live: from here on every event reaches the hub."""
    first = await session.tokens(1)
    assert ids(await read(feed, 1)) == first
    second = await session.tokens(1, start=1)
    assert ids(await read(feed, 1)) == second
    observer = feed.hub.observer
    assert isinstance(observer, Observer)
    await until(lambda: any(event.id == second[0] for event in observer.events))


async def restarted_after(redis: aioredis.Redis, entry_id: str) -> None:
    """Returns once Redis's clock is past the millisecond of ``entry_id``. A Redis that lost
    events comes back later than that (a restart, a failover), so the ids it makes anew
    never repeat a lost one; a test that remade a stream within the same millisecond would
    make exactly such a repeat, which a reader cannot tell from the event it had."""
    lost_ms = wire.entry_id_key(entry_id)[0]
    async with asyncio.timeout(10):
        while True:
            seconds, micros = await redis.time()
            if seconds * 1000 + micros // 1000 > lost_ms:
                return
            await asyncio.sleep(0.001)


async def until_live_readers(redis: aioredis.Redis, channel: str, count: int) -> None:
    async with asyncio.timeout(10):
        while await live_readers(redis, channel) != count:
            await asyncio.sleep(0.005)


async def until(condition: Callable[[], bool], timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


async def test_a_feed_from_the_start_catches_up_then_delivers_live_in_order(
    make_hub: HubFactory, session: Session
) -> None:
    hub = await make_hub()
    before = await session.tokens(3)
    async with hub.open(SESSION, None) as feed:
        assert ids(await read(feed, 3)) == before
        live = await session.tokens(4, start=3)
        batches = await read(feed, 4)
        assert ids(batches) == live
        events = [event for batch in batches for event in batch]
        assert [(e.type, e.generation_id) for e in events] == [("token", "g")] * 4
        assert [e.data for e in events] == [wire.encode(token(n)) for n in range(3, 7)]
        assert feed.last_id == live[-1]


async def test_a_feed_after_an_id_starts_right_after_it(
    make_hub: HubFactory, session: Session
) -> None:
    hub = await make_hub()
    written = await session.tokens(5)
    async with hub.open(SESSION, written[1]) as feed:
        assert ids(await read(feed, 3)) == written[2:]


async def test_a_live_only_feed_skips_what_was_written_before(
    make_hub: HubFactory, session: Session
) -> None:
    hub = await make_hub()
    await session.tokens(3)
    async with hub.open(SESSION, LIVE_ONLY) as feed:
        # The first batch resolves "$" to the last id written: nothing old comes.
        async with asyncio.timeout(10):
            while not feed.positioned:
                assert await feed.next_batch(10) == []
        new = await session.tokens(2, start=3)
        assert ids(await read(feed, 2)) == new


async def hub_subscribed(redis: aioredis.Redis, keys: Keys) -> None:
    channel = keys.live_channel(SESSION)
    async with asyncio.timeout(10):
        while await live_readers(redis, channel) == 0:
            await asyncio.sleep(0.005)


def stream_reads(hub: RelayHub, monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The ``after_id`` of every read of a session's stream the hub makes from now on."""
    reads: list[str | None] = []
    read_after = hub.read_after

    async def counted(session_id: str, after_id: str | None) -> list[RelayEvent]:
        reads.append(after_id)
        return await read_after(session_id, after_id)

    monkeypatch.setattr(hub, "read_after", counted)
    return reads


async def test_a_feed_opened_before_its_session_gets_every_event_live_and_reads_nothing(
    make_hub: HubFactory,
    session: Session,
    redis: aioredis.Redis,
    keys: Keys,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub = await make_hub()
    reads = stream_reads(hub, monkeypatch)
    async with hub.open(SESSION, NEW_SESSION) as feed:
        await hub_subscribed(redis, keys)
        written = [await session.emit(wire.Queued("g")), *await session.tokens(3)]
        assert ids(await read(feed, 4)) == written
    assert reads == []


async def test_an_engine_steps_events_of_a_session_come_in_one_message_each_in_order(
    make_hub: HubFactory,
    session: Session,
    redis: aioredis.Redis,
    keys: Keys,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EMIT_STEP writes a step's events of one session (its claim, a token, its end) and
    publishes them as one live message, one a line: the feed gets each live, in order."""
    hub = await make_hub()
    reads = stream_reads(hub, monkeypatch)
    emit = EmitStep(redis, keys)
    target = emit.target(SESSION, "g", epoch=0, maxlen=100, ttl_s=60)
    await redis.hset(keys.generation(SESSION, "g"), mapping={"state": "queued"})
    step = StepCall("w")
    step.add(target, 1, "started", wire.encode(wire.Started("g", "m", 1)))
    step.add(target, 2, "token", wire.encode(token(0)))
    step.add(target, 3, "done", wire.encode(wire.Done("g", "stop", Usage(1, 1))), "done")
    async with hub.open(SESSION, NEW_SESSION) as feed:
        await hub_subscribed(redis, keys)
        queued = await session.emit(wire.Queued("g"))
        assert ids(await read(feed, 1)) == [queued]
        before = await command_calls(redis, "publish")
        written = await emit.send(step)
        assert await command_calls(redis, "publish") - before == 1
        events = [event for batch in await read(feed, 3) for event in batch]
    assert [event.id for event in events] == written
    assert [event.type for event in events] == ["started", "token", "done"]
    assert events[1].data == wire.encode(token(0))
    assert reads == []  # every event came live


async def test_a_feed_opened_too_late_for_its_sessions_first_event_reads_what_it_missed(
    make_hub: HubFactory, session: Session, redis: aioredis.Redis, keys: Keys
) -> None:
    hub = await make_hub()
    before = [await session.emit(wire.Queued("g")), *await session.tokens(2)]
    async with hub.open(SESSION, NEW_SESSION) as feed:
        await hub_subscribed(redis, keys)
        after = await session.tokens(2, start=2)
        assert ids(await read(feed, 4)) == before + after


async def test_a_slow_reader_gets_what_piled_up_in_one_batch(
    make_hub: HubFactory, session: Session, observer: Observer
) -> None:
    hub = await make_hub(buffer_limit=100)
    async with hub.open(SESSION, None) as feed:
        await subscribed(feed, session)
        piled = await session.tokens(5, start=2)
        await until(lambda: observer.events[-1].id == piled[-1])  # all in the feed's buffer
        assert ids([await feed.next_batch(10)]) == piled
        assert observer.fell == 0


async def test_a_reader_that_falls_behind_re_reads_redis_without_gap_or_repeat(
    make_hub: HubFactory, session: Session, observer: Observer
) -> None:
    hub = await make_hub(buffer_limit=2)
    async with hub.open(SESSION, None) as feed:
        await subscribed(feed, session)
        piled = await session.tokens(10, start=2)
        await until(lambda: observer.events[-1].id == piled[-1])
        assert observer.fell == 1  # the buffer overflowed once, then stopped filling
        batch = await feed.next_batch(10)  # one catch-up read from the stream
        assert [event.id for event in batch] == piled
        assert [event.data for event in batch] == [wire.encode(token(n)) for n in range(2, 12)]
        more = await session.tokens(2, start=12)
        assert ids(await read(feed, 2)) == more  # and live again


async def test_every_feed_of_a_session_gets_every_event(
    make_hub: HubFactory, session: Session, observer: Observer
) -> None:
    hub = await make_hub()
    async with hub.open(SESSION, None) as one, hub.open(SESSION, None) as two:
        assert hub.open_feeds == 2
        written = await session.tokens(3)
        assert ids(await read(one, 3)) == ids(await read(two, 3)) == written
        assert hub.watched_sessions() == [SESSION]
    assert hub.open_feeds == 0 and hub.watched_sessions() == []
    assert observer.unwatched_sessions == [SESSION]


async def test_a_feed_with_nothing_to_say_returns_an_empty_batch_at_the_heartbeat(
    make_hub: HubFactory,
) -> None:
    hub = await make_hub()
    loop = asyncio.get_running_loop()
    async with hub.open(SESSION, None) as feed:
        heartbeats = feed.events(heartbeat_s=0.05)
        for _ in range(3):
            started = loop.time()
            assert await anext(heartbeats) == []
            assert 0.05 <= loop.time() - started < 5
        await heartbeats.aclose()


async def test_an_event_wakes_a_waiting_feed_before_its_heartbeat(
    make_hub: HubFactory, session: Session
) -> None:
    hub = await make_hub()
    async with hub.open(SESSION, None) as feed:
        first = await session.tokens(1)
        assert ids(await read(feed, 1)) == first
        waiting = asyncio.create_task(feed.next_batch(60))
        written = await session.tokens(1, start=1)
        batch = await asyncio.wait_for(waiting, 10)  # long before the 60 s heartbeat
        assert [event.id for event in batch] == written


async def test_a_draining_hub_ends_waits_early(make_hub: HubFactory) -> None:
    hub = await make_hub()
    async with hub.open(SESSION, None) as feed:
        hub.begin_drain()
        assert await asyncio.wait_for(feed.next_batch(60), 10) == []


async def trimmed(session: Session) -> tuple[list[str], list[str]]:
    """Ten events in a stream trimmed to its last three: (gone, kept)."""
    written = await session.tokens(10)
    await session.redis.xtrim(session.keys.events(SESSION), maxlen=3, approximate=False)
    return written[:7], written[7:]


async def test_a_feed_after_a_trimmed_event_raises_events_expired(
    make_hub: HubFactory, session: Session
) -> None:
    hub = await make_hub()
    gone, kept = await trimmed(session)
    for after in (gone[0], gone[-1]):
        with pytest.raises(EventsExpired) as caught:
            await hub.check_resumable(SESSION, after)
        assert (caught.value.status, caught.value.ws_close_code) == (410, 4410)
        assert caught.value.code == "events_expired"
        async with hub.open(SESSION, after) as feed:
            with pytest.raises(EventsExpired):
                await read(feed, 1)
    # From the first kept event on nothing is missing.
    await hub.check_resumable(SESSION, kept[0])
    async with hub.open(SESSION, kept[0]) as feed:
        assert ids(await read(feed, 2)) == kept[1:]


async def test_an_old_id_of_a_stream_never_trimmed_is_fine(
    make_hub: HubFactory, session: Session
) -> None:
    hub = await make_hub()
    written = await session.tokens(2)
    await hub.check_resumable(SESSION, "0-1")
    await hub.check_resumable(SESSION, written[-1])  # the last event: nothing is missing
    await hub.check_resumable("no-such-session", "0-0")  # no stream: only 0-0 is not ahead
    async with hub.open(SESSION, "0-1") as feed:
        assert ids(await read(feed, 2)) == written


async def test_a_resume_point_ahead_of_the_stream_is_events_lost_not_a_silent_wait(
    make_hub: HubFactory, session: Session
) -> None:
    """An id past the last one the stream made (Redis lost the events after it, or it is
    from nowhere) would wait for ever: later events sort before it. It is said at once."""
    hub = await make_hub()
    written = await session.tokens(2)
    ms, _ = wire.entry_id_key(written[-1])
    for ahead in (f"{ms}-99", f"{ms + 60_000}-0", "99999999999999-0"):
        with pytest.raises(EventsLost) as caught:
            await hub.check_resumable(SESSION, ahead)
        lost = caught.value
        assert (lost.code, lost.field, lost.given, lost.status) == (
            "events_lost",
            "last_event_id",
            ahead,
            410,
        )
        assert written[-1] in lost.message and "start over from the beginning" in lost.message
        async with hub.open(SESSION, ahead) as feed:  # a feed finds it as it reads
            with pytest.raises(EventsLost):
                await read(feed, 1)
    with pytest.raises(EventsLost) as caught:
        await hub.check_resumable("no-such-session", written[0])
    assert "it has no event" in caught.value.message


async def test_a_feed_whose_stream_came_back_without_its_last_events_raises_events_lost(
    make_hub: HubFactory, session: Session, redis: aioredis.Redis
) -> None:
    """Redis came back from an older copy (a restart that lost its last writes, a failover
    to a replica behind): the feed's last id is ahead of the stream, so it says so instead
    of waiting for events that sort before its position."""
    hub = await make_hub()
    async with hub.open(SESSION, None) as feed:
        await subscribed(feed, session)
        key = session.keys.events(SESSION)
        first = (await redis.xrange(key, count=1))[0]
        await redis.delete(key)
        await redis.xadd(key, first[1], id=first[0])
        await told_events_lost_once_back(feed)


async def test_a_resume_point_redis_lost_is_events_lost_though_new_events_follow_it(
    make_hub: HubFactory, session: Session, redis: aioredis.Redis
) -> None:
    """Redis came back without the feed's last events, and wrote new ones before the feed
    read again (a turn it lost submitted again, the same reply from its start): the
    feed's last id is behind the stream's newest but no event of it. Read on from there,
    its reader would see that reply start over after the part it had; it is told instead,
    as is a client that resumes from there."""
    hub = await make_hub()
    async with hub.open(SESSION, None) as feed:
        await subscribed(feed, session)
        key = session.keys.events(SESSION)
        kept, lost = await redis.xrange(key)
        await redis.delete(key)
        await redis.xadd(key, kept[1], id=kept[0])
        await restarted_after(redis, wire.text(lost[0]))
        again = await session.tokens(1)  # after the restart: a new id, past the lost one
        assert wire.entry_id_key(again[0]) > wire.entry_id_key(wire.text(lost[0]))
        with pytest.raises(EventsLost) as caught:
            await hub.check_resumable(SESSION, wire.text(lost[0]))
        assert "is no event of this stream" in caught.value.message
        await hub.check_resumable(SESSION, wire.text(kept[0]))  # kept: nothing is missing
        await told_events_lost_once_back(feed)


async def test_a_stream_redis_lost_whole_then_made_anew_is_events_lost_for_a_feed_behind_it(
    make_hub: HubFactory, session: Session, redis: aioredis.Redis
) -> None:
    """Redis lost the whole stream (restarted without its data, or its last second), then a
    lost turn submitted again wrote a new one: every new event sorts after the feed's last
    id, none is it, and nothing was trimmed. Read on, the reader would see the reply start
    over after the part it had; it is told instead, as is a client that resumes there. An
    id from before the session (``0-1``) still reads it from its start."""
    await redis.hset(session.keys.meta(SESSION), "created", time.time())  # as sessions do
    hub = await make_hub()
    async with hub.open(SESSION, None) as feed:
        await subscribed(feed, session)
        key = session.keys.events(SESSION)
        [(seen, _)] = await redis.xrange(key, count=1)
        [(last, _)] = await redis.xrevrange(key, count=1)
        await redis.delete(key)
        await restarted_after(redis, wire.text(last))
        anew = await session.tokens(1)
        assert wire.entry_id_key(anew[0]) > wire.entry_id_key(wire.text(seen))
        with pytest.raises(EventsLost) as caught:
            await hub.check_resumable(SESSION, wire.text(seen))
        assert "is no event of this stream" in caught.value.message
        await hub.check_resumable(SESSION, "0-1")
        await told_events_lost_once_back(feed)


async def test_a_feed_whose_stream_redis_lost_while_its_session_stayed_raises_events_lost(
    make_hub: HubFactory, session: Session, redis: aioredis.Redis
) -> None:
    """A crash's last second took the session's stream (its first turn) but not the session:
    the feed had read events of it live. Back, it finds no stream: a turn submitted again
    would write a new one after its id, the reply from its start, read on as if it went
    on; it is told instead. (With the session gone too, its reader is told that.)"""
    await redis.hset(session.keys.meta(SESSION), "created", time.time())  # as sessions do
    hub = await make_hub()
    async with hub.open(SESSION, None) as feed:
        await subscribed(feed, session)
        await redis.delete(session.keys.events(SESSION))
        await told_events_lost_once_back(feed)


async def test_a_feed_opened_right_before_an_event_reads_from_it(
    make_hub: HubFactory, session: Session, redis: aioredis.Redis
) -> None:
    """A WebSocket turn reads its session from the id right before its ``queued`` event
    (``wire.just_before``): the session's first event, or one after others. Neither is an
    event of the stream, and neither is a loss."""
    await redis.hset(session.keys.meta(SESSION), "created", time.time())  # as sessions do
    hub = await make_hub()
    first = await session.tokens(1)
    async with hub.open(SESSION, wire.just_before(first[0])) as feed:
        assert ids(await read(feed, 1)) == first
    later = await session.tokens(2)
    async with hub.open(SESSION, wire.just_before(later[0])) as feed:
        assert ids(await read(feed, 2)) == later


@pytest.mark.parametrize(
    "given", ["yesterday", "1", "1-", "-1-1", "1-2-3", "18446744073709551616-0", " 1-0", "1-0\n"]
)
async def test_a_malformed_event_id_is_a_bad_request_saying_what_an_id_looks_like(
    make_hub: HubFactory, given: str
) -> None:
    hub = await make_hub()
    with pytest.raises(BadRequest) as caught:
        await hub.check_resumable(SESSION, given)
    assert (caught.value.code, caught.value.field) == ("bad_event_id", "last_event_id")
    assert "`<milliseconds>-<sequence>`" in caught.value.message


async def test_zero_is_the_resume_point_before_every_event(make_hub: HubFactory) -> None:
    """``0`` (Redis's spelling of the start) reads from the beginning, as no id does."""
    hub = await make_hub()
    await hub.check_resumable(SESSION, "0")


async def test_wait_final_returns_the_generations_final_event_or_none(
    make_hub: HubFactory, session: Session
) -> None:
    hub = await make_hub()
    assert await hub.wait_final(SESSION, "g", timeout=0.05) is None
    waiting = asyncio.create_task(hub.wait_final(SESSION, "g", timeout=30))
    await until(lambda: hub.open_feeds == 1)
    # Another generation's final event does not end the wait; this one's does. Emitted
    # until the waiting feed has subscribed (a final from before lands in the hash).
    done = wire.Done("g", "stop", Usage(2, 1))
    await session.emit(wire.Done("other", "stop", Usage(1, 1)))
    while not waiting.done():
        await session.emit(done)
        await asyncio.wait({waiting}, timeout=0.05)
    assert waiting.result() == done

    # A generation that ended before the wait began: its final event is in its hash.
    stored = wire.Cancelled("h", "user", Usage(2, 0))
    await session.redis.hset(session.keys.generation(SESSION, "h"), "final", wire.encode(stored))
    assert await hub.wait_final(SESSION, "h", timeout=10) == stored


async def test_the_hub_books_what_its_readers_wait_on_until_it_starts_or_nobody_reads(
    make_hub: HubFactory, session: Session
) -> None:
    """gateway/core/relay/waiting.py: a generation a reader saw ``queued`` (read from the stream or
    live) is booked, at the queued event's time, until an event of it says it started,
    or the session's last reader leaves. What this book holds is what the readers'
    deadline (gateway/recovery/reader_deadline.py ``ReaderDeadline``) may end."""
    hub = await make_hub()
    waiting = hub.waiting
    early = await session.emit(wire.Queued("g1"))
    async with hub.open(SESSION, None) as feed:
        await read(feed, 1)  # read from the stream
        queued_at_s = wire.entry_ms(early) / 1000
        assert waiting.queued_before(queued_at_s + 0.001) == [(SESSION, "g1")]
        assert waiting.queued_before(queued_at_s) == []
        await session.emit(wire.Queued("g2"))
        await read(feed, 1)  # live
        await until(lambda: len(waiting) == 2)
        await session.emit(wire.Started("g1", "m", 3))
        await read(feed, 1)
        await until(lambda: len(waiting) == 1)
        assert waiting.queued_before(float("inf")) == [(SESSION, "g2")]
        # Queued again once: the deadline still sees it, the requeue no more.
        assert waiting.queued_before(float("inf"), requeued=False) == [(SESSION, "g2")]
        waiting.requeued(SESSION, "g2")
        assert waiting.queued_before(float("inf"), requeued=False) == []
        assert waiting.queued_before(float("inf"), requeued=True) == [(SESSION, "g2")]
        await session.emit(wire.Queued("g2"))  # seen queued again: its entry stays as it was
        await read(feed, 1)
        assert waiting.queued_before(float("inf"), requeued=True) == [(SESSION, "g2")]
    assert len(waiting) == 0  # nobody here reads the session: nobody here waits on g2


async def test_a_session_nobody_reads_books_nothing(make_hub: HubFactory, session: Session) -> None:
    """A read that is not a reader's (a stored response's events) books nothing."""
    hub = await make_hub()
    await session.emit(wire.Queued("g1"))
    assert [event.type for event in await hub.read_after(SESSION, None)] == ["queued"]
    assert len(hub.waiting) == 0


async def test_a_new_session_feed_takes_a_spare_subscribed_ahead_and_sends_no_subscribe(
    make_hub: HubFactory, redis: aioredis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = await make_hub()
    assert hub.spares is not None
    await until(lambda: hub.spares is not None and hub.spares.ready == SPARE_BATCH)
    subscribes = await command_calls(redis, "subscribe")
    reads = stream_reads(hub, monkeypatch)
    async with hub.open_new_session() as feed:
        assert feed.state is FeedState.FIRST_EVENT  # confirmed before anything is written
        assert hub.spares.ready == SPARE_BATCH - 1
        channel = keys.live_channel(feed.session_id)
        assert await live_readers(redis, channel) == 1
        session = Session(redis, keys, feed.session_id)
        written = [await session.emit(wire.Queued("g")), *await session.tokens(3)]
        assert ids(await read(feed, 4)) == written
    assert reads == []
    assert await command_calls(redis, "subscribe") == subscribes
    await until_live_readers(redis, channel, 0)


async def test_spares_are_refilled_in_one_command_and_with_none_ready_a_session_subscribes_itself(
    make_hub: HubFactory, redis: aioredis.Redis, keys: Keys
) -> None:
    hub = await make_hub()
    await until(lambda: hub.spares is not None and hub.spares.ready == SPARE_BATCH)
    subscribes = await command_calls(redis, "subscribe")
    async with contextlib.AsyncExitStack() as held:
        # Entered in one pass of the event loop (a spare's feed awaits nothing): the refill
        # asked for at half a batch cannot have run, so the last one finds none ready.
        feeds = [
            await held.enter_async_context(hub.open_new_session()) for _ in range(SPARE_BATCH + 1)
        ]
        assert [feed.state for feed in feeds[:-1]] == [FeedState.FIRST_EVENT] * SPARE_BATCH
        assert len({feed.session_id for feed in feeds}) == SPARE_BATCH + 1
        for feed in feeds:
            session = Session(redis, keys, feed.session_id)
            written = [await session.emit(wire.Queued("g")), *await session.tokens(2)]
            assert ids(await read(feed, 3)) == written
        await until(lambda: hub.spares is not None and hub.spares.ready == SPARE_BATCH)
    # The refill's batch and the last session's own channel: asked in one pass, sent as
    # one command (or two, had the refill been sent on its own).
    assert subscribes < await command_calls(redis, "subscribe") <= subscribes + 2


async def test_spares_lost_with_the_pubsub_connection_are_ready_again_once_it_is_back(
    redis: aioredis.Redis, keys: Keys
) -> None:
    errors: list[str] = []

    class Counting(Observer):
        def redis_error(self, where: str) -> None:
            errors.append(where)

    hub = RelayHub(redis, keys, 1000, Counting())
    await hub.start()
    try:
        await until(lambda: hub.spares is not None and hub.spares.ready == SPARE_BATCH)
        await redis.client_kill_filter(_type="pubsub")
        await until(lambda: errors == ["relay"])
        await until(lambda: hub.spares is not None and hub.spares.ready == SPARE_BATCH)
        async with hub.open_new_session() as feed:
            assert feed.state is FeedState.FIRST_EVENT
            session = Session(redis, keys, feed.session_id)
            written = [await session.emit(wire.Queued("g")), *await session.tokens(2)]
            assert ids(await read(feed, 3)) == written
    finally:
        await hub.stop()


async def test_channels_nobody_watches_any_more_are_unsubscribed_together(
    make_hub: HubFactory,
    redis: aioredis.Redis,
    keys: Keys,
    observer: Observer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(live, "UNSUBSCRIBE_BATCH", 3)
    monkeypatch.setattr(live, "UNSUBSCRIBE_AFTER_S", 60.0)
    hub = await make_hub()
    unsubscribes = await command_calls(redis, "unsubscribe")
    channels = [keys.live_channel(f"s-left-{n}") for n in range(3)]
    dropped: list[str] = []
    for n, channel in enumerate(channels):
        async with hub.open(f"s-left-{n}"):
            await until_live_readers(redis, channel, 1)
        if n < 2:  # left subscribed until a batch is full; its messages are dropped
            dropped += await Session(redis, keys, f"s-left-{n}").tokens(1)
            assert await live_readers(redis, channel) == 1
    for channel in channels:
        await until_live_readers(redis, channel, 0)
    assert await command_calls(redis, "unsubscribe") == unsubscribes + 1
    assert not set(dropped) & {event.id for event in observer.events}


async def test_a_channel_left_is_unsubscribed_soon_and_one_watched_again_stays(
    make_hub: HubFactory, redis: aioredis.Redis, keys: Keys, session: Session
) -> None:
    hub = await make_hub()
    channel = keys.live_channel(SESSION)
    async with hub.open(SESSION) as feed:
        await subscribed(feed, session)
    async with hub.open(SESSION) as feed:  # before it was unsubscribed
        assert len(ids(await read(feed, 2))) == 2
        await asyncio.sleep(live.UNSUBSCRIBE_AFTER_S * 2)  # past the unsubscribe it had
        assert await live_readers(redis, channel) == 1
        written = await session.tokens(2, start=2)
        assert ids(await read(feed, 2)) == written  # live: nothing else reads the stream
    await until_live_readers(redis, channel, 0)
