"""A burst of requests taken at once (engine/worker.py ``PrepareTurns``): slow prepares go
one per turn of the event loop, so the first ones' claims and tokens reach Redis while the
rest are still being prepared. A real worker (synthetic engine, whose prepare spends CPU as
vLLM's chat template and tokenizer do) on a real Redis."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, cast

import pytest
import redis.asyncio as aioredis

import wire
from engine.backends.synthetic import SyntheticBackend
from engine.worker import Worker
from wire import GenerationRequest, Keys, SamplingParams

pytestmark = pytest.mark.timeout(60)

BURST = 100
PREPARE_CPU_S = 0.005
"""Half a second of prepares: the first token's write is under way after a few turns of the
loop, and its round trip to Redis would have to take the rest for the test to fail."""


async def test_a_bursts_first_token_is_in_redis_before_its_last_request_is_prepared(
    redis: aioredis.Redis,
) -> None:
    """Before: every request of a read prepared in one turn of the loop, and the first
    token went out after the last prepare (all 100 prepared when it was seen)."""
    keys = Keys(f"t-{secrets.token_hex(4)}")
    backend = SyntheticBackend(tokens_per_s=50, prepare_cpu_s=PREPARE_CPU_S)
    worker = Worker(redis, backend, keys=keys, worker_id="w-burst")
    queue = worker.requests_key
    await redis.xgroup_create(queue, wire.CONSUMER_GROUP, id="0", mkstream=True)
    sessions = [f"s_{secrets.token_hex(4)}" for _ in range(BURST)]
    for index, sid in enumerate(sessions):
        key = keys.generation(sid, f"g{index}")
        await redis.hset(key, mapping={"state": "queued"})
        await redis.expire(key, 600)
        request = GenerationRequest(f"g{index}", sid, SamplingParams(max_tokens=2), prompt="hi")
        await redis.xadd(queue, cast(dict[Any, Any], {b"r": wire.encode(request)}))
    [(_, entries)] = await redis.xreadgroup(wire.CONSUMER_GROUP, "w-burst", {queue: ">"})
    assert len(entries) == BURST
    publishing = asyncio.create_task(worker.publisher.run_forever())
    try:
        for entry_id, fields in entries:  # one read's requests, taken as the job table does
            worker.jobs.add(entry_id, fields)
        first = keys.events(sessions[0])
        async with asyncio.timeout(10):
            while b"token" not in [f[b"t"] for _, f in wire.entries_of(await redis.xrange(first))]:
                await asyncio.sleep(0)
        prepared = sum(1 for job in worker.jobs.jobs() if job.prepare_s > 0)
        assert prepared < BURST, f"{prepared} of {BURST} prepared before the first token"
    finally:
        async with asyncio.timeout(10):  # the runs end before their publisher does
            while worker.jobs.busy:
                await asyncio.sleep(0.01)
        publishing.cancel()
        await asyncio.gather(publishing, return_exceptions=True)
        await backend.stop()
