"""gateway/core/store/models.py: the live view of the models, cached for ``CACHE_S``, against the
session's real Redis. The requests that find the cached view old together share one read
(a burst used to make one read per request in flight); a fresh read is always its own; kept
fresh in the background, the view is never old when a request comes."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

import pytest
import redis.asyncio as aioredis

import wire
from gateway.core.errors import NotFound, Unavailable
from gateway.core.settings import Settings
from gateway.core.store.models import CACHE_S, ModelDirectory
from tests.support.redis_probes import command_calls
from wire import Keys, WorkerInfo

pytestmark = pytest.mark.timeout(30)


async def count_reads(redis: aioredis.Redis) -> int:
    """ZRANGEBYSCORE calls Redis has answered: one per read of the live workers."""
    return await command_calls(redis, "zrangebyscore")


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


async def test_kept_fresh_the_view_is_there_before_a_request_asks(
    redis: aioredis.Redis,
) -> None:
    """A request after a pause longer than ``CACHE_S`` (a chat's next turn) finds a view
    read before it came: no read on its way. Without the refresher it reads one."""
    directory = ModelDirectory(redis, Keys(f"md-{secrets.token_hex(3)}"), Settings())
    refresher = asyncio.create_task(directory.refresh_forever())
    try:
        await asyncio.sleep(CACHE_S * 2.5)
        for _ in range(3):
            asked_at = time.monotonic()
            snapshot = await directory.snapshot()
            assert snapshot.taken_at < asked_at, "the request waited for a read"
            assert asked_at - snapshot.taken_at < CACHE_S
            await asyncio.sleep(CACHE_S * 0.7)
    finally:
        refresher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await refresher

    await asyncio.sleep(CACHE_S * 1.2)  # not refreshed now: the view has aged
    asked_at = time.monotonic()
    assert (await directory.snapshot()).taken_at >= asked_at


async def test_a_name_redis_forgot_is_unavailable_not_unknown(redis: aioredis.Redis) -> None:
    """A model whose name Redis lost (wiped: its only worker, stopped, has not registered
    again) is still one this gateway knows: 503 ``model_unavailable``, to retry, not 404
    ``model_not_found``. A name never registered stays unknown. Found by the chaos minute
    (seed 11): a worker stopped while Redis was wiped, and new sessions for its model were
    refused as a wrong name."""
    keys = Keys(f"md-{secrets.token_hex(3)}")
    directory = ModelDirectory(redis, keys, Settings())
    await redis.hset(keys.models, mapping={"beta": "beta", "alpha": "alpha"})
    with pytest.raises(Unavailable) as unavailable:
        await directory.resolve("beta")
    assert unavailable.value.code == "model_unavailable"
    await redis.delete(keys.models)  # Redis lost it; alpha's worker registered again
    await redis.hset(keys.models, mapping={"alpha": "alpha"})
    with pytest.raises(Unavailable) as still:
        await directory.resolve("beta")
    assert still.value.code == "model_unavailable"
    with pytest.raises(NotFound) as unknown:
        await directory.resolve("gamma")
    assert unknown.value.code == "model_not_found"


async def register(redis: aioredis.Redis, keys: Keys, model: str, started_at: float) -> None:
    """What a worker of ``model``'s heartbeat writes (engine/lease.py), the names' start
    only where none is."""
    info = WorkerInfo(f"w-{model}", "synthetic", model, 4, 0, started_at)
    await redis.set(keys.worker(info.worker_id), wire.encode(info))
    await redis.zadd(keys.workers, {info.worker_id: time.time()})
    await redis.hset(keys.models, model, model)
    await redis.set(keys.models_since, int(time.time() * 1000), nx=True)


async def test_a_gateway_new_since_redis_lost_the_names_waits_for_their_workers(
    redis: aioredis.Redis,
) -> None:
    """A gateway started after Redis lost its data has seen no name: while the names are
    younger than a live worker (written again one heartbeat each) and than the worker
    timeout, a name it cannot find is 503 ``model_unavailable`` with the time left, not
    404 (the chaos minute, seed 11: a gateway restarted after a wipe refused new sessions
    for a model whose worker had not written its name yet). On a first start, and once the
    names are that old, a wrong name is 404."""
    keys = Keys(f"md-{secrets.token_hex(3)}")
    await register(redis, keys, "alpha", started_at=time.time() - 60)  # wiped since it began
    directory = ModelDirectory(redis, keys, Settings(worker_timeout_s=5))
    assert await directory.resolve("alpha") == "alpha"
    with pytest.raises(Unavailable) as refilling:
        await directory.resolve("beta")
    assert refilling.value.code == "model_unavailable"
    assert 1 <= int(refilling.value.headers()["Retry-After"]) <= 5
    await redis.set(keys.models_since, int((time.time() - 6) * 1000))
    with pytest.raises(NotFound):
        await directory.resolve("beta")

    first_start = Keys(f"md-{secrets.token_hex(3)}")
    await register(redis, first_start, "alpha", started_at=time.time() - 0.5)
    with pytest.raises(NotFound):
        await ModelDirectory(redis, first_start, Settings()).resolve("beta")
