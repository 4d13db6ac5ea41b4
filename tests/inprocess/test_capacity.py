"""gateway/core/store/admission.py: the capacity check under a burst of requests, against the
session's real Redis. Checks that come while a read of the queue counts is on its way share
it (one read, not one each) and count each other's admissions, so the limit still holds."""

from __future__ import annotations

import asyncio
import secrets

import pytest
import redis.asyncio as aioredis

from gateway.core.errors import Overloaded
from gateway.core.settings import Settings
from gateway.core.store.admission import Admission
from gateway.core.store.models import ModelDirectory
from gateway.core.store.queue import GenerationQueue
from gateway.tenants.directory import TenantDirectory
from tests.support.redis_probes import command_calls
from wire import GenerationRequest, Keys, SamplingParams

pytestmark = pytest.mark.timeout(30)
MODEL = "burst-model"


class Gate:
    """A gateway's queue and its admission, over a fresh key prefix."""

    def __init__(self, redis: aioredis.Redis, **settings: int) -> None:
        keys = Keys(f"cap-{secrets.token_hex(3)}")
        config = Settings(default_model=MODEL, **settings)
        directory = TenantDirectory(redis, keys, frozenset(), required=False)
        models = ModelDirectory(redis, keys, config)
        self.queue = GenerationQueue(redis, keys, config, models, directory.weight_of)
        self.admission = Admission(redis, keys, config, directory, self.queue, one_node=True)

    async def counts(self) -> None:
        await self.queue.counts()


async def count_reads(redis: aioredis.Redis) -> int:
    """XINFO GROUPS calls Redis has answered: one per model per read of the counts."""
    return await command_calls(redis, "xinfo|groups")


async def check(gate: Gate) -> str:
    try:
        await gate.admission.guard_capacity(MODEL)
    except Overloaded:
        return "refused"
    return "admitted"


async def burst(gate: Gate, size: int) -> list[str]:
    async with asyncio.TaskGroup() as group:
        checks = [group.create_task(check(gate)) for _ in range(size)]
    return [task.result() for task in checks]


async def test_a_burst_of_checks_shares_one_read_and_keeps_the_limit(
    redis: aioredis.Redis,
) -> None:
    gate = Gate(redis, max_inflight=10)
    await gate.counts()  # the model list cached, as in a gateway that has served
    before = await count_reads(redis)
    outcomes = await burst(gate, 50)
    assert await count_reads(redis) - before == 1
    assert outcomes.count("admitted") == 10 and outcomes.count("refused") == 40

    per_model = Gate(redis, max_inflight_per_model=3)
    await per_model.counts()
    assert (await burst(per_model, 8)).count("admitted") == 3


async def test_a_check_after_the_read_answered_reads_again(redis: aioredis.Redis) -> None:
    gate = Gate(redis, max_inflight=1)
    before = await count_reads(redis)
    assert await check(gate) == "admitted"
    request = GenerationRequest("g-1", "s-1", SamplingParams(), prompt="hi")
    await gate.queue.enqueue(MODEL, request)
    assert await check(gate) == "refused"  # a new read, which sees the queued request
    assert await count_reads(redis) - before == 2
