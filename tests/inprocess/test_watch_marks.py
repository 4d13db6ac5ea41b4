"""gateway/core/store/watches.py against the real Redis: readers that resume together are
marked watched in one pipeline, each mark living four thirds of the abandon grace; the
refresh marks every session the process reads."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import pytest

from gateway.core.settings import Settings
from gateway.core.store.watches import WatchMarks
from gateway.server.app import Services
from stack.redis_server import EmbeddedRedis
from wire import Keys

pytestmark = [
    pytest.mark.timeout(60),
    # Building the whole app's services: as tests/inprocess/test_hot_routes.py says.
    pytest.mark.filterwarnings(
        "ignore::litestar.exceptions.base_exceptions.LitestarDeprecationWarning"
    ),
]


@pytest.fixture
async def services(redis_server: EmbeddedRedis) -> AsyncIterator[Services]:
    settings = Settings(
        redis_url=redis_server.url, key_prefix=f"t-{secrets.token_hex(4)}", abandon_grace_s=30
    )
    services = Services(settings)
    yield services
    await services.redis.aclose()


async def test_readers_that_come_together_are_marked_in_one_pipeline(services: Services) -> None:
    marks = services.service.watch_marks
    batches: list[list[str]] = []
    mark_watched = marks.sessions.mark_watched

    async def counted(session_ids: list[str]) -> None:
        batches.append(session_ids)
        await mark_watched(session_ids)

    marks.sessions.mark_watched = counted  # type: ignore[method-assign]
    sessions = [f"s_{n}" for n in range(100)]
    await asyncio.gather(*(marks.reader_came(s) for s in sessions))
    assert [sorted(batch) for batch in batches] == [sorted(sessions)]
    keys = Keys(services.settings.key_prefix)
    ttls = [await services.redis.ttl(keys.watch(s)) for s in sessions]
    assert all(35 <= ttl <= 40 for ttl in ttls), ttls  # 4/3 of the 30 s grace

    await marks.reader_came("s_later")  # after that pipeline: one of its own
    assert batches[-1] == ["s_later"]


async def test_the_refresh_marks_every_session_read_here(services: Services) -> None:
    read_here = ["s_a", "s_b"]
    marks = WatchMarks(services.service.sessions, lambda: read_here, interval_s=0.05)
    refresh = asyncio.create_task(marks.refresh_forever())
    keys = Keys(services.settings.key_prefix)
    try:
        async with asyncio.timeout(5):
            while not all([await services.redis.exists(keys.watch(s)) for s in read_here]):
                await asyncio.sleep(0.01)
            read_here.append("s_c")  # a reader came meanwhile: the next refresh marks it
            while not await services.redis.exists(keys.watch("s_c")):
                await asyncio.sleep(0.01)
    finally:
        refresh.cancel()
        with pytest.raises(asyncio.CancelledError):
            await refresh
