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


async def refused_until(ctx: Context, answered_at_s: float, limited: bool) -> tuple[Record, float]:
    """A request refused (by the key's limits, or 503) until ``answered_at_s`` of the run."""
    made = record()

    async def attempt(url: str) -> str:
        if ctx.clock() < answered_at_s:
            if limited:
                rate_limited(made, "429")
            raise Retry(0.02)
        return url

    began = time.monotonic()
    await with_retries(ctx, random.Random(1), made, attempt)
    return made, time.monotonic() - began


@pytest.fixture
def short_bound(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(clients, "REFUSED_FOR_S", 0.3)
    return 0.3


async def test_refusals_by_the_keys_own_limits_are_waited_out(short_bound: float) -> None:
    started = time.monotonic()
    ctx = Context(["http://a", "http://b"], lambda: time.monotonic() - started)
    made, took_s = await refused_until(ctx, 1.0, limited=True)
    assert took_s >= 1.0 - short_bound and made.rate_limited > 10


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
        redis_away_s=lambda from_s, to_s: max(0.0, min(to_s, 0.9) - from_s),  # away until 0.9 s
    )
    made, _ = await refused_until(ctx, 1.0, limited=False)
    assert made.retries > 10
