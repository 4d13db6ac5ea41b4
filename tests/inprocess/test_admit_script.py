"""wire/lua/admit_core.lua, a key's admission (``wire.tenancy.Admit``, ``Release``,
``OldAdmissions``), against
the session's real Redis: what each limit counts, when it admits again, and what a refusal
leaves. The keys' counts are set the way the scripts that count usage set them
(usage_core.lua: per-second token buckets, the day's counter), on Redis's own clock."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
import redis.asyncio as aioredis

from wire import Keys
from wire.limits import RUNNING_HOLD_S, Counts, Limits
from wire.messages import Usage
from wire.tenancy import Admit, CountUsage, OldAdmissions, Release

pytestmark = pytest.mark.timeout(60)


class Key:
    """One tenant's keys, under a fresh prefix."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.keys = Keys(f"admit-{secrets.token_hex(3)}")
        self.id = "k_" + secrets.token_hex(4)
        self._admit = Admit(redis, self.keys)
        self.release = Release(redis, self.keys)
        self.admitted = OldAdmissions(redis, self.keys)

    async def admit(self, session_id: str = "s_1", **given: Any) -> Counts:
        return await self._admit(session_id=session_id, **given)

    def key(self, name: str) -> str:
        return self.keys.tenant(self.id, name)

    async def now_s(self) -> int:
        seconds, _ = await self.redis.time()
        return int(seconds)


async def test_requests_per_minute_count_requests_not_choices_and_release_gives_back(
    redis: aioredis.Redis,
) -> None:
    key, limits = Key(redis), Limits(requests_per_minute=2)
    first = await key.admit(
        tenant_id=key.id, generation_ids=["a0", "a1"], count_request=True, limits=limits
    )
    assert first.refused is None and first.requests == 1 and first.requests_reset_ms == 60_000
    # Another choice of a request counted already: not a request.
    more = await key.admit(
        tenant_id=key.id, generation_ids=["a2"], count_request=False, limits=limits
    )
    assert more.refused is None and more.requests == 1
    second = await key.admit(
        tenant_id=key.id, generation_ids=["b0"], count_request=True, limits=limits
    )
    assert second.requests == 2
    refused = await key.admit(
        tenant_id=key.id, generation_ids=["c0"], count_request=True, limits=limits
    )
    assert refused.refused == "requests" and 59_000 < refused.retry_after_ms <= 60_000
    assert await redis.zcard(key.key("requests")) == 2  # a refusal is not logged
    await key.release(tenant_id=key.id, generation_ids=["b0"], count_request=True)
    again = await key.admit(
        tenant_id=key.id, generation_ids=["d0"], count_request=True, limits=limits
    )
    assert again.refused is None and again.requests == 2
    assert 0 < await redis.pttl(key.key("requests")) <= 61_000


async def test_a_minute_that_passed_admits_again_when_its_oldest_request_left(
    redis: aioredis.Redis,
) -> None:
    key, limits = Key(redis), Limits(requests_per_minute=2)
    # Redis's clock in whole seconds (up to one behind); "old" 5 s inside the minute, so
    # that a busy machine's pause before the admit does not carry it out of the minute.
    now_ms = await key.now_s() * 1000
    await redis.zadd(key.key("requests"), {"old": now_ms - 55_000, "newer": now_ms - 30_000})
    refused = await key.admit(
        tenant_id=key.id, generation_ids=["x"], count_request=True, limits=limits
    )
    assert refused.refused == "requests"
    assert 0 < refused.retry_after_ms <= 5_000 + 1_000  # "old" leaves within about 5 s
    assert 29_000 <= refused.requests_reset_ms <= 31_000  # when "newer" leaves
    await redis.zadd(key.key("requests"), {"old": now_ms - 61_000})  # it left
    assert (
        await key.admit(tenant_id=key.id, generation_ids=["y"], count_request=True, limits=limits)
    ).refused is None


async def test_tokens_per_minute_admit_again_when_enough_tokens_left_the_minute(
    redis: aioredis.Redis,
) -> None:
    key, limits = Key(redis), Limits(tokens_per_minute=15)
    now = await key.now_s()
    # 10 tokens 50 s ago, 10 tokens 10 s ago, and a bucket past the minute.
    await redis.hset(key.key("tpm"), mapping={now - 50: 10, now - 10: 10, now - 70: 99})
    refused = await key.admit(
        tenant_id=key.id, generation_ids=["t"], count_request=True, limits=limits
    )
    assert refused.refused == "tokens" and refused.tokens == 20
    assert 9_000 <= refused.retry_after_ms <= 11_000  # the older 10 leave: 10 < 15
    assert 49_000 <= refused.tokens_reset_ms <= 51_000  # all of them left
    assert await redis.hexists(key.key("tpm"), str(now - 70)) == 0  # pruned
    await redis.hdel(key.key("tpm"), str(now - 50))
    admitted = await key.admit(
        tenant_id=key.id, generation_ids=["u"], count_request=True, limits=limits
    )
    assert admitted.refused is None and admitted.tokens == 10


async def test_a_day_and_concurrency_refuse_and_the_longest_wait_is_named(
    redis: aioredis.Redis,
) -> None:
    key = Key(redis)
    day = await key.now_s() // 86_400
    for today in (day, day + 1):  # the script may run in the next UTC day
        # The day's usage, as every generation's end counts it: 60 + 40 tokens.
        used = {"prompt_tokens": 60, "completion_tokens": 40, "generations": 1}
        await redis.hset(key.key(f"usage:day:{today}"), mapping=used)
    limits = Limits(tokens_per_day=100, concurrent=1)
    await redis.zadd(key.key("running"), {"running": 10**15})
    refused = await key.admit(
        tenant_id=key.id, generation_ids=["v"], count_request=True, limits=limits
    )
    # Both reached: the day waits longer than a generation's end (a 1 s hint).
    assert refused.refused == "tokens_day" and refused.tokens_today == 100
    assert refused.retry_after_ms == refused.day_reset_ms > 0
    only_running = Limits(concurrent=1)
    busy = await key.admit(
        tenant_id=key.id, generation_ids=["w"], count_request=True, limits=only_running
    )
    assert busy.refused == "concurrent" and busy.retry_after_ms == 1_000 and busy.running == 1
    # A generation past its hold (its final event never came) counts no more.
    await redis.zadd(key.key("running"), {"running": 1})
    freed = await key.admit(
        tenant_id=key.id, generation_ids=["w"], count_request=True, limits=only_running
    )
    assert freed.refused is None and freed.running == 1
    assert await redis.zrange(key.key("running"), 0, -1) == [b"w"]


async def test_an_admission_keeps_its_session_until_its_generation_ends_or_is_given_back(
    redis: aioredis.Redis,
) -> None:
    """ADMIT notes the session each admitted generation goes to (its SUBMIT comes a round
    trip later); ADMITTED answers those admitted at least a while ago that still count;
    RELEASE and the usage count drop them with their running entry."""
    key, limits = Key(redis), Limits(concurrent=5)
    await key.admit(
        session_id="s_a",
        tenant_id=key.id,
        generation_ids=["g1", "g2"],
        count_request=True,
        limits=limits,
    )
    assert await redis.hgetall(key.key("sessions")) == {b"g1": b"s_a", b"g2": b"s_a"}
    assert 0 < await redis.pttl(key.key("sessions")) <= RUNNING_HOLD_S * 1000
    assert await key.admitted(tenant_id=key.id, after_s=60, most=10) == []  # just now
    assert await key.admitted(tenant_id=key.id, after_s=0, most=10) == [
        ("g1", "s_a"),
        ("g2", "s_a"),
    ]
    await redis.zadd(key.key("running"), {"unnoted": 10**15})  # SUBMIT's own admission
    await key.release(tenant_id=key.id, generation_ids=["g1"], count_request=False)
    assert await key.admitted(tenant_id=key.id, after_s=0, most=10) == [("g2", "s_a")]
    counted = CountUsage(redis, key.keys)
    assert await counted(tenant_id=key.id, generation_id="g2", bill="all", usage=Usage(2, 3))
    assert await key.admitted(tenant_id=key.id, after_s=0, most=10) == []
    assert await redis.hgetall(key.key("sessions")) == {}
    assert await redis.zrange(key.key("running"), 0, -1) == [b"unnoted"]
