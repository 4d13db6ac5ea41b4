"""wire/queue.py and wire/lua/fair_*.lua: a model's queue shared between tenants by the
tokens each is served (the Virtual Token Counter, docs/tenants.md), against the session's
real Redis. A "worker" here is a consumer name that takes through ``RequestQueue.take``."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter

import msgspec
import pytest
import redis.asyncio as aioredis

import wire
from wire import GenerationRequest, Keys, SamplingParams
from wire.queue import RequestQueue, ServedTokens, count_all
from wire.scripts import WaitingRequest

pytestmark = pytest.mark.timeout(60)


async def fresh_queue(redis: aioredis.Redis) -> RequestQueue:
    queue = RequestQueue(redis, Keys(f"fair-{secrets.token_hex(3)}"), "m")
    await queue.ensure_group()
    return queue


def request(tenant: str, number: int, enqueued_at: float | None = None) -> bytes:
    return wire.encode(
        GenerationRequest(
            f"g-{tenant}-{number}",
            f"s-{tenant}-{number}",
            SamplingParams(),
            enqueued_at=time.time() if enqueued_at is None else enqueued_at,
            tenant=tenant,
        )
    )


ESTIMATE = 20
"""What each test request's prompt is guessed at (``wire.queue.estimated_tokens``)."""


def waiting(queue: RequestQueue, raw: bytes, tenant: str, weight: float = 1.0) -> WaitingRequest:
    return queue.waiting(raw, estimate=ESTIMATE, tenant=tenant, weight=weight)


async def submit(queue: RequestQueue, tenant: str, count: int, weight: float = 1.0) -> None:
    for number in range(count):
        await queue.submit(waiting(queue, request(tenant, number), tenant, weight))


def tenant_of(entry: tuple[bytes, dict[bytes, bytes]]) -> str:
    return msgspec.json.decode(entry[1][b"r"], type=GenerationRequest).tenant


async def take(queue: RequestQueue, count: int, served: ServedTokens | None = None) -> list[str]:
    taken = await queue.take("w", count, 10, served or ServedTokens())
    return [tenant_of(entry) for entry in taken]


async def test_a_take_serves_the_stream_first_then_the_tenant_served_least(
    redis: aioredis.Redis,
) -> None:
    queue = await fresh_queue(redis)
    await submit(queue, "noisy", 5)
    await queue.add({"r": request("continued", 0)})  # a reply taken over: admitted before
    first = await take(queue, 2)
    assert first == ["continued", "noisy"]
    await submit(queue, "quiet", 1)  # arrives behind four of noisy's: lifted, not last
    served = ServedTokens()
    served.add("noisy", 100)  # noisy was served 100 tokens since
    assert await take(queue, 1, served) == ["quiet"]
    assert await take(queue, 10) == ["noisy"] * 4
    assert await queue.fair_waiting() == 0
    queued, running = (await counts(redis, queue))[0]
    assert (queued, running) == (0, 7)  # all taken, none acknowledged


async def counts(redis: aioredis.Redis, queue: RequestQueue) -> list[tuple[int, int]]:
    return await count_all(redis, [queue])


async def test_waiting_requests_count_as_queued_and_a_taken_one_is_pending_in_the_group(
    redis: aioredis.Redis,
) -> None:
    queue = await fresh_queue(redis)
    await submit(queue, "a", 3)
    await submit(queue, "b", 2)
    assert await counts(redis, queue) == [(5, 0)]
    taken = await queue.take("w", 2, 10, ServedTokens())
    assert await counts(redis, queue) == [(3, 2)]
    pending = await redis.xpending(queue.key, wire.CONSUMER_GROUP)
    assert pending["pending"] == 2 and pending["consumers"][0]["name"] == b"w"
    await queue.ack(*(entry_id for entry_id, _ in taken))
    assert await counts(redis, queue) == [(3, 0)]


async def test_weights_share_the_tokens_served_in_their_ratio(redis: aioredis.Redis) -> None:
    """Always backlogged, weights 1:2:4, each request served 100 tokens: the tokens each
    tenant is served follow its weight (within one request's worth)."""
    queue = await fresh_queue(redis)
    weights = {"one": 1.0, "two": 2.0, "four": 4.0}
    for tenant, weight in weights.items():
        await submit(queue, tenant, 200, weight)
    served, tokens = ServedTokens(), Counter[str]()
    for _ in range(140):
        (entry,) = await queue.take("w", 1, 10, served)
        tenant = tenant_of(entry)
        # The take charged its prompt's estimate; the worker corrects it, then serves.
        assert int(entry[1][b"e"]) == ESTIMATE
        served.add(tenant, 100 - ESTIMATE)
        tokens[tenant] += 100
    total = sum(tokens.values())
    for tenant, weight in weights.items():
        assert tokens[tenant] / total == pytest.approx(weight / 7, abs=100 / total)


async def test_a_tenant_back_from_idle_is_lifted_and_banks_no_credit(
    redis: aioredis.Redis,
) -> None:
    queue = await fresh_queue(redis)
    await submit(queue, "busy", 30)
    served = ServedTokens()
    for _ in range(20):  # busy alone is served 20 x 1,000 tokens
        assert await take(queue, 1, served) == ["busy"]
        served.add("busy", 1_000)
    await submit(queue, "back", 10)  # lifted to busy's counter, not 0
    order = [*(await take(queue, 1, served))]
    for _ in range(9):
        (tenant,) = await take(queue, 1, served)
        order.append(tenant)
        served.add(tenant, 1_000)
    # Alternating from the lift: "back" does not get its ten in a row.
    assert order.count("back") <= 6 and order.count("busy") >= 4, order


async def test_an_idle_worker_waits_on_the_bell_and_a_submit_wakes_it_at_once(
    redis: aioredis.Redis,
) -> None:
    queue = await fresh_queue(redis)
    began = time.monotonic()
    assert await queue.take("w", 4, 200, ServedTokens()) == []
    assert time.monotonic() - began < 0.19  # a first take looks at once
    began = time.monotonic()
    assert await queue.take("w", 4, 200, ServedTokens()) == []
    assert time.monotonic() - began >= 0.19  # found nothing before: waited 200 ms for the bell
    waiter = asyncio.create_task(queue.take("w", 4, 5_000, ServedTokens()))
    await asyncio.sleep(0.1)
    sent = time.monotonic()
    await submit(queue, "a", 1)
    taken = await asyncio.wait_for(waiter, 2)
    assert [tenant_of(entry) for entry in taken] == ["a"]
    assert time.monotonic() - sent < 1.0  # woken by the submit, not by the 5 s timeout


async def test_requests_past_the_deadline_are_taken_out_of_the_lists(
    redis: aioredis.Redis,
) -> None:
    queue = await fresh_queue(redis)
    old = time.time() - 60
    for number in range(3):
        await queue.submit(waiting(queue, request("a", number, old), "a"))
    await queue.submit(waiting(queue, request("a", 9), "a"))
    await queue.submit(waiting(queue, request("b", 0, old), "b"))
    expired = await queue.expire_waiting(time.time() - 30, most=10)
    assert sorted(
        msgspec.json.decode(raw, type=GenerationRequest).generation_id for raw in expired
    ) == [
        "g-a-0",
        "g-a-1",
        "g-a-2",
        "g-b-0",
    ]
    assert await queue.fair_waiting() == 1
    assert await take(queue, 5) == ["a"]


async def served_lately(queue: RequestQueue, **tokens: int) -> None:
    """Charge each tenant ``tokens`` (a worker's charge: what it served lately)."""
    served = ServedTokens()
    for tenant, count in tokens.items():
        served.add(tenant, count)
    await queue.charge(served)


@pytest.mark.parametrize(
    ("charged", "waiting_tenant", "yielding", "gives_way"),
    [
        # A light tenant waits behind a heavy one: the heavy one gives way.
        ({"heavy": 400, "light": 20}, "light", ["heavy", "heavy", "light-b"], "heavy"),
        # A tenant never served: the same, whatever it runs.
        ({"heavy": 400}, "new", ["heavy"], "heavy"),
        # A free slot with a heavy tenant's stopped reply kept: the light one goes first.
        ({"heavy": 400, "light": 20}, "light", ["heavy"], "heavy"),
        # Light tenants, one holding three slots for a moment: served less than the level
        # (the heavy one waits, so it counts there), none of its replies stops, though
        # the other was served a quarter as much.
        ({"heavy": 400, "light-a": 40, "light-b": 10}, "light-b", ["light-a"] * 3, None),
        # Two heavy tenants, one served less but more than half as much: no stop by turns.
        ({"heavy": 200, "b": 200}, "b", ["heavy"] * 4, None),
        # Nothing served lately by anyone: nobody is owed.
        ({}, "b", ["a"] * 4, None),
        # A request with no tenant (anonymous, or fifo's one list) is owed no share.
        ({"heavy": 400}, "", ["heavy"], None),
    ],
    ids=[
        "heavy-gives-way",
        "new-tenant",
        "kept-reply",
        "light-alike",
        "heavy-alike",
        "idle",
        "anonymous",
    ],
)
async def test_the_tenant_served_most_lately_gives_way_to_one_served_far_less(
    redis: aioredis.Redis,
    charged: dict[str, int],
    waiting_tenant: str,
    yielding: list[str],
    gives_way: str | None,
) -> None:
    queue = await fresh_queue(redis)
    await submit(queue, "heavy", 4)  # backlogged: one waits after these three
    await take(queue, 3)
    await served_lately(queue, **charged)
    await submit(queue, waiting_tenant, 1)
    found = await queue.preempt_for("w", yielding)
    if gives_way is None:
        assert found is None
        return
    assert found is not None
    assert found[0] == gives_way
    assert tenant_of(found[1]) == waiting_tenant
    pending = await redis.xpending(queue.key, wire.CONSUMER_GROUP)
    assert pending["pending"] == 4  # the three taken and this one, all under "w"


async def test_served_lately_is_per_unit_of_weight_and_halves_every_five_seconds(
    redis: aioredis.Redis,
) -> None:
    """Weight 4 and 400 tokens is 100 a unit: not twice a light tenant's 60; 400 tokens
    served 20 s ago count 25, not twice 20."""
    queue = await fresh_queue(redis)
    await submit(queue, "heavy", 1, weight=4.0)
    await take(queue, 1)
    await served_lately(queue, heavy=400 - ESTIMATE, light=60)
    await submit(queue, "light", 1)
    assert await queue.preempt_for("w", ["heavy"]) is None
    await served_lately(queue, heavy=800)  # 300 a unit now: the light one is owed
    found = await queue.preempt_for("w", ["heavy"])
    assert found is not None and found[0] == "heavy"

    older = await fresh_queue(redis)
    await submit(older, "heavy", 1)
    await take(older, 1)
    twenty_s_ago = int(time.time() * 1000) - 20_000
    await redis.hset(older.fair.recent, "heavy", f"400 {twenty_s_ago}")
    await served_lately(older, light=20)
    await submit(older, "light", 1)
    assert await older.preempt_for("w", ["heavy"]) is None


async def test_while_no_tenant_waits_what_was_served_goes_with_the_charge_not_a_take(
    redis: aioredis.Redis,
) -> None:
    """Counters order only tenants that wait: with none waiting a take carries no charge
    (one script's work less per take), and the worker's heartbeat charges it; once a
    tenant waits again, takes carry it."""
    queue = await fresh_queue(redis)
    await submit(queue, "a", 1)
    served = ServedTokens()
    assert await take(queue, 1, served) == ["a"]  # the last waiting: none waits now
    served.add("a", 100)
    assert await take(queue, 1, served) == []
    assert float(await redis.hget(queue.fair.vtc, "a") or 0) == ESTIMATE  # not charged yet
    await queue.charge(served)
    assert float(await redis.hget(queue.fair.vtc, "a") or 0) == ESTIMATE + 100
    await submit(queue, "a", 2)
    assert await take(queue, 1, served) == ["a"]  # one left waiting
    served.add("a", 50)
    await take(queue, 1, served)
    assert float(await redis.hget(queue.fair.vtc, "a") or 0) == 3 * ESTIMATE + 150
