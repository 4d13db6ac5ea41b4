"""gateway/core/generations.py: the capacity check under a burst of requests, against the
session's real Redis. Checks that come while a read of the queue counts is on its way share
it (one read, not one each) and count each other's admissions, so the limit still holds."""

from __future__ import annotations

import asyncio
import secrets

import pytest
import redis.asyncio as aioredis

from gateway.core.errors import Overloaded
from gateway.core.generations import GenerationQueue
from gateway.core.models import ModelDirectory
from gateway.core.settings import Settings
from tests.support.redis_probes import command_calls
from wire import GenerationRequest, Keys, SamplingParams

pytestmark = pytest.mark.timeout(30)
MODEL = "burst-model"


def gateway_queue(redis: aioredis.Redis, **settings: int) -> GenerationQueue:
    keys = Keys(f"cap-{secrets.token_hex(3)}")
    config = Settings(default_model=MODEL, **settings)
    return GenerationQueue(redis, keys, config, ModelDirectory(redis, keys, config))


async def count_reads(redis: aioredis.Redis) -> int:
    """XINFO GROUPS calls Redis has answered: one per model per read of the counts."""
    return await command_calls(redis, "xinfo|groups")


async def check(queue: GenerationQueue) -> str:
    try:
        await queue.guard_capacity(MODEL)
    except Overloaded:
        return "refused"
    return "admitted"


async def burst(queue: GenerationQueue, size: int) -> list[str]:
    async with asyncio.TaskGroup() as group:
        checks = [group.create_task(check(queue)) for _ in range(size)]
    return [task.result() for task in checks]


async def test_a_burst_of_checks_shares_one_read_and_keeps_the_limit(
    redis: aioredis.Redis,
) -> None:
    queue = gateway_queue(redis, max_inflight=10)
    await queue.counts()  # the model list cached, as in a gateway that has served
    before = await count_reads(redis)
    outcomes = await burst(queue, 50)
    assert await count_reads(redis) - before == 1
    assert outcomes.count("admitted") == 10 and outcomes.count("refused") == 40

    per_model = gateway_queue(redis, max_inflight_per_model=3)
    await per_model.counts()
    assert (await burst(per_model, 8)).count("admitted") == 3


async def test_a_check_after_the_read_answered_reads_again(redis: aioredis.Redis) -> None:
    queue = gateway_queue(redis, max_inflight=1)
    before = await count_reads(redis)
    assert await check(queue) == "admitted"
    await queue.enqueue(MODEL, GenerationRequest("g-1", "s-1", SamplingParams(), prompt="hi"))
    assert await check(queue) == "refused"  # a new read, which sees the queued request
    assert await count_reads(redis) - before == 2
