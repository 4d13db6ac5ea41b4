"""gateway/models.py: the live view of the models, cached for ``CACHE_S``, against the
session's real Redis. The requests that find the cached view old together share one read
(a burst used to make one read per request in flight); a fresh read is always its own."""

from __future__ import annotations

import asyncio
import secrets

import pytest
import redis.asyncio as aioredis

from gateway.models import ModelDirectory
from gateway.settings import Settings
from wire import Keys

pytestmark = pytest.mark.timeout(30)


async def count_reads(redis: aioredis.Redis) -> int:
    """ZRANGEBYSCORE calls Redis has answered: one per read of the live workers."""
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_zrangebyscore", {}).get("calls", 0))


async def test_a_burst_that_finds_the_view_old_shares_one_read(redis: aioredis.Redis) -> None:
    directory = ModelDirectory(redis, Keys(f"md-{secrets.token_hex(3)}"), Settings())
    before = await count_reads(redis)
    burst = await asyncio.gather(*(directory.snapshot() for _ in range(50)))
    assert await count_reads(redis) - before == 1
    assert all(snapshot is burst[0] for snapshot in burst)

    await directory.snapshot()  # cached: no read
    assert await count_reads(redis) - before == 1
    fresh = await asyncio.gather(*(directory.snapshot(fresh=True) for _ in range(3)))
    assert await count_reads(redis) - before == 4  # each a read of its own
    assert fresh[0] is not burst[0]
