"""The reaper claims a lost worker's requests under a consumer name of its own and drops that
name from the group once done (wire/queue.py ``forget_consumer``), against a real Redis. Not
while it still holds a request: deleting a consumer deletes what it holds, and a request the
reaper claimed but could not hand on yet (Redis refused its TAKEOVER: a full Redis, a
failover) was then pending under no one, its reply left running for ever (Sentinel soak,
seed 2: the reaper handed on the next request of the same dead worker and forgot its name,
with the first still held)."""

from __future__ import annotations

import secrets

import redis.asyncio as aioredis

from wire import Keys
from wire.keys import CONSUMER_GROUP
from wire.queue import RequestQueue

REAPER = "reaper-1"


async def test_a_consumer_that_still_holds_a_request_is_not_forgotten(
    redis: aioredis.Redis,
) -> None:
    queue = RequestQueue(redis, Keys(f"forget-{secrets.token_hex(3)}"), "m")
    await queue.ensure_group()
    for name in ("first", "second"):
        await queue.add({"r": name.encode()})
    taken = await redis.xreadgroup(CONSUMER_GROUP, REAPER, {queue.key: ">"}, count=2)
    first, second = [entry_id for entry_id, _ in taken[0][1]]
    await queue.ack(second)  # handed on; the first is not yet (its TAKEOVER refused)
    assert not await queue.forget_consumer(REAPER)
    assert [entry for entry, _ in await queue.pending_of(REAPER)] == [first.decode()]
    await queue.ack(first)
    assert await queue.forget_consumer(REAPER)
    assert await redis.xinfo_consumers(queue.key, CONSUMER_GROUP) == []
