"""gateway/core/relay/feed.py: one ``Feed`` against a fake hub (a stream held in a list), driven
through its public interface the way the hub drives it: ``confirmed``, ``push``. No Redis:
each state change is made on purpose, not raced for (tests/inprocess/test_relay_feed.py
runs feeds against a real server)."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.core.errors import SessionLost
from gateway.core.relay.feed import (
    CATCH_UP_PAGE,
    DRAIN_POLL_S,
    LIVE_ONLY,
    NEW_SESSION,
    Feed,
    FeedState,
    RelayEvent,
)
from wire import entry_id_key

pytestmark = pytest.mark.timeout(10)

SESSION = "s1"


class FakeHub:
    """A session's stream in a list; counts what feeds ask of it."""

    def __init__(self, buffer_limit: int = 100) -> None:
        self.stream: list[RelayEvent] = []
        self.buffer_limit = buffer_limit
        self.draining = False
        self.exists = True
        self.reads: list[str | None] = []
        self.fell = 0
        self.errors: list[str] = []
        self.fail_reads = 0
        self.quiet: list[str] = []

    def append(self, event_type: str = "token") -> RelayEvent:
        event = RelayEvent(f"{len(self.stream) + 1}-0", event_type, "g", b"{}")
        self.stream.append(event)
        return event

    async def read_after(self, session_id: str, after_id: str | None) -> list[RelayEvent]:
        self.reads.append(after_id)
        if self.fail_reads:
            self.fail_reads -= 1
            raise RedisConnectionError("connection lost")
        after = entry_id_key(after_id) if after_id else (0, 0)
        return [e for e in self.stream if entry_id_key(e.id) > after][:CATCH_UP_PAGE]

    async def last_event_id(self, session_id: str) -> str | None:
        return self.stream[-1].id if self.stream else None

    async def session_exists(self, session_id: str) -> bool:
        return self.exists

    def fell_behind(self) -> None:
        self.fell += 1

    def redis_error(self, where: str) -> None:
        self.errors.append(where)

    def went_quiet(self, session_id: str) -> None:
        self.quiet.append(session_id)


def ids(events: list[RelayEvent]) -> list[str]:
    return [event.id for event in events]


async def test_a_feed_waits_for_its_subscription_then_reads_the_stream_then_goes_live() -> None:
    hub = FakeHub()
    feed = Feed(hub, SESSION, None)
    before = [hub.append(), hub.append()]
    feed.push(hub.append())  # not subscribed yet: dropped, the read finds it
    assert feed.state is FeedState.SUBSCRIBING
    assert await feed.next_batch(0.01) == [] and hub.reads == []
    feed.confirmed(True)
    assert ids(await feed.next_batch(1)) == ids([*before, hub.stream[2]])
    assert feed.state is FeedState.LIVE
    live = hub.append()
    feed.push(live)
    assert await feed.next_batch(1) == [live]
    assert hub.reads == [None] and feed.last_id == live.id


async def test_a_wait_that_times_out_tells_the_hub_the_session_went_quiet() -> None:
    """Only a whole timeout with nothing (a heartbeat): the readers' deadline then asks Redis
    whether the session's generation waits (gateway/core/relay/waiting.py)."""
    hub = FakeHub()
    feed = Feed(hub, SESSION, None)
    feed.confirmed(True)
    hub.append()
    assert len(await feed.next_batch(1)) == 1
    assert hub.quiet == []
    assert await feed.next_batch(0.01) == []
    assert hub.quiet == [SESSION]


async def test_live_events_that_the_read_already_delivered_are_not_repeated() -> None:
    hub = FakeHub()
    feed = Feed(hub, SESSION, None)
    feed.confirmed(True)
    first = hub.append()
    assert await feed.next_batch(1) == [first]
    feed.push(first)  # published before the read, delivered after it
    second = hub.append()
    feed.push(second)
    assert await feed.next_batch(1) == [second]


async def test_a_feed_whose_buffer_overflows_falls_behind_and_re_reads_without_gap() -> None:
    hub = FakeHub(buffer_limit=2)
    feed = Feed(hub, SESSION, None)
    feed.confirmed(True)
    assert await feed.next_batch(0.01) == []
    piled = [hub.append() for _ in range(5)]
    for event in piled:
        feed.push(event)
    assert hub.fell == 1 and feed.state is FeedState.BEHIND
    assert await feed.next_batch(1) == piled
    assert hub.reads == [None, None]


async def test_a_new_sessions_feed_takes_everything_live_when_it_subscribed_in_time() -> None:
    hub = FakeHub()
    feed = Feed(hub, SESSION, NEW_SESSION)
    feed.confirmed(True)
    assert feed.state is FeedState.FIRST_EVENT
    events = [hub.append("queued"), hub.append(), hub.append()]
    for event in events:
        feed.push(event)
    assert await feed.next_batch(1) == events
    assert hub.reads == []


async def test_a_new_sessions_feed_that_subscribed_too_late_reads_from_the_start() -> None:
    hub = FakeHub()
    feed = Feed(hub, SESSION, NEW_SESSION)
    feed.confirmed(True)
    missed = hub.append("queued")
    late = hub.append()
    feed.push(late)  # not the session's first event: some came before the subscription
    assert feed.state is FeedState.BEHIND
    assert await feed.next_batch(1) == [missed, late]
    assert hub.reads == [None]


@pytest.mark.parametrize("confirmed_first", [False, True])
async def test_a_new_sessions_feed_that_lost_its_subscription_reads_from_the_start(
    confirmed_first: bool,
) -> None:
    """A loss before the session's first event: what came meanwhile is read from the
    stream once the subscription is back (a new session's whole reply can end in that
    time: waiting for a first live event hung a request in the chaos soak), and a read
    that finds nothing yet is no lost session (the request may not have made it yet)."""
    hub = FakeHub()
    hub.exists = False  # asked, it would raise SessionLost
    feed = Feed(hub, SESSION, NEW_SESSION)
    if confirmed_first:
        feed.confirmed(True)
    feed.confirmed(False)
    feed.confirmed(True)
    assert await feed.next_batch(0.01) == []  # nothing yet, and not judged lost
    hub.exists = True
    whole = [hub.append("queued"), hub.append(), hub.append("done")]  # while unsubscribed
    feed.confirmed(False)
    feed.confirmed(True)
    assert await feed.next_batch(1) == whole
    assert hub.reads == [None, None]


async def test_a_live_only_feed_starts_after_the_last_event_once_subscribed() -> None:
    hub = FakeHub()
    hub.append()
    feed = Feed(hub, SESSION, LIVE_ONLY)
    hub.append()  # before the subscription holds: not delivered either
    assert not feed.positioned
    feed.confirmed(False)  # a loss before it is positioned keeps it live-only
    feed.confirmed(True)
    assert await feed.next_batch(1) == []
    assert feed.positioned and feed.last_id == "2-0" and hub.reads == []
    new = hub.append()
    feed.push(new)
    assert await feed.next_batch(1) == [new]


async def test_after_a_lost_subscription_the_feed_re_reads_from_its_last_event() -> None:
    hub = FakeHub()
    feed = Feed(hub, SESSION, None)
    feed.confirmed(True)
    first = hub.append()
    assert await feed.next_batch(1) == [first]
    feed.confirmed(False)
    assert feed.state is FeedState.LOST
    during = hub.append()
    feed.push(during)  # not subscribed: dropped, read after the subscription is back
    feed.confirmed(True)
    assert await feed.next_batch(1) == [during]
    assert hub.reads == [None, first.id]


async def test_a_session_redis_lost_while_the_subscription_was_down_raises_session_lost() -> None:
    hub = FakeHub()
    feed = Feed(hub, SESSION, None)
    feed.confirmed(True)
    first = hub.append()
    assert await feed.next_batch(1) == [first]
    feed.confirmed(False)
    hub.stream.clear()
    hub.exists = False
    feed.confirmed(True)
    with pytest.raises(SessionLost):
        await feed.next_batch(1)


async def test_an_empty_read_without_a_loss_does_not_ask_whether_the_session_exists() -> None:
    hub = FakeHub()
    hub.exists = False  # asked, it would raise SessionLost
    feed = Feed(hub, SESSION, None)
    feed.confirmed(True)
    assert await feed.next_batch(0.01) == []


async def test_a_failed_read_is_reported_and_tried_again() -> None:
    hub = FakeHub()
    feed = Feed(hub, SESSION, None)
    event = hub.append()
    feed.confirmed(False)
    feed.confirmed(True)
    hub.fail_reads = 1
    assert await feed.next_batch(0.01) == []
    assert hub.errors == ["catch_up"] and feed.state is FeedState.BEHIND_AFTER_LOSS
    assert await feed.next_batch(1) == [event]
    assert hub.reads == [None, None]


async def test_while_the_hub_drains_a_wait_returns_within_the_drain_poll() -> None:
    hub = FakeHub()
    feed = Feed(hub, SESSION, None)
    feed.confirmed(True)
    assert await feed.next_batch(0.01) == []
    hub.draining = True
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await feed.next_batch(60) == []
    assert loop.time() - started < DRAIN_POLL_S * 4
    feed.close()
