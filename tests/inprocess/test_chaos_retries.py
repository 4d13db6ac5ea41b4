"""The chaos run's clients send a refused request again (bench/chaos/clients.py
``with_retries``) and give up after ``REFUSED_FOR_S`` of refusals, an anomaly; refusals
while Redis took no writes, and the waits after refusals by the key's own limits, are not
held against the product."""

from __future__ import annotations

import random
import time

import pytest

from bench.chaos import clients
from bench.chaos.clients import Context, Record, Retry, rate_limited, with_retries
from bench.chaos.tenants import ApiKey

LIMITED = ApiKey("limited", "k1", "secret", 1.0, {"concurrent": 1})


def record() -> Record:
    return Record("openai", "c1", "m", "hi", 4, 0.0, LIMITED)


async def refused_until(ctx: Context, refused_for_s: float, limited: bool) -> tuple[Record, float]:
    """A request refused (by the key's limits, or 503) for ``refused_for_s`` from its first
    try, on the run's clock; returns the record and how long it was refused."""
    made = record()
    first_s: list[float] = []

    async def attempt(url: str) -> str:
        first_s.append(first_s[0] if first_s else ctx.clock())
        if ctx.clock() - first_s[0] < refused_for_s:
            if limited:
                rate_limited(made, "429")
            raise Retry(0.02)
        return url

    await with_retries(ctx, random.Random(1), made, attempt)
    return made, ctx.clock() - first_s[0]


@pytest.fixture
def short_bound(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(clients, "REFUSED_FOR_S", 0.3)
    return 0.3


async def test_refusals_by_the_keys_own_limits_are_waited_out(short_bound: float) -> None:
    started = time.monotonic()
    ctx = Context(["http://a", "http://b"], lambda: time.monotonic() - started)
    made, refused_s = await refused_until(ctx, 1.0, limited=True)
    assert refused_s >= 1.0 > short_bound and made.rate_limited > 10


async def test_other_refusals_give_up_after_the_bound(short_bound: float) -> None:
    started = time.monotonic()
    ctx = Context(["http://a", "http://b"], lambda: time.monotonic() - started)
    with pytest.raises(TimeoutError, match="refused for"):
        await refused_until(ctx, 1.0, limited=False)


async def test_refusals_while_redis_took_no_writes_are_not_counted(short_bound: float) -> None:
    started = time.monotonic()
    ctx = Context(
        ["http://a", "http://b"],
        lambda: time.monotonic() - started,
        redis_away_s=lambda from_s, to_s: to_s - from_s,  # away all along
    )
    made, refused_s = await refused_until(ctx, 1.0, limited=False)
    assert refused_s >= 1.0 > short_bound and made.retries > 10
