"""A key's limits, enforced across replicas: one script on the key's slot admits a
request's generations or refuses them (wire/tenancy.py ``Admit``), and what it found
becomes OpenAI's ``x-ratelimit-*`` headers (``Quota``).

A key without limits costs nothing here: no round trip, no header.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.tenants.records import Tenant
from wire import Keys
from wire.limits import Counts, LimitName, Limits
from wire.tenancy import Admit, OldAdmissions, Release

LIMIT_NAMES: dict[LimitName, str] = {
    "concurrent": "concurrent",
    "requests": "requests_per_minute",
    "tokens": "tokens_per_minute",
    "tokens_day": "tokens_per_day",
}
"""ADMIT's names of the limits -> their names in a key's ``limits`` (and in errors)."""


def duration(ms: int) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` headers spell it (Go's): ``0s``,
    ``20ms``, ``1s``, ``1.5s``, ``6m0s``, ``1h0m0s``."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    seconds = ms / 1000
    if seconds < 60:
        return _seconds(seconds)
    minutes, rest = divmod(ms, 60_000)
    hours, minutes = divmod(minutes, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m" + _seconds(rest / 1000)


def _seconds(seconds: float) -> str:
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


@dataclass(frozen=True, slots=True)
class Quota:
    """A key's limits and its counts against them, as a response's headers say them."""

    limits: Limits
    counts: Counts

    def headers(self) -> list[tuple[str, str]]:
        """OpenAI's six for the limits per minute that are set, and the same for the day's
        tokens and the concurrent generations (``-concurrent``: no reset)."""
        limits, counts = self.limits, self.counts
        out: list[tuple[str, str]] = []
        for suffix, limit, used, reset_ms in (
            ("requests", limits.requests_per_minute, counts.requests, counts.requests_reset_ms),
            ("tokens", limits.tokens_per_minute, counts.tokens, counts.tokens_reset_ms),
            ("tokens-day", limits.tokens_per_day, counts.tokens_today, counts.day_reset_ms),
        ):
            if limit:
                out += [
                    (f"x-ratelimit-limit-{suffix}", str(limit)),
                    (f"x-ratelimit-remaining-{suffix}", str(max(limit - used, 0))),
                    (f"x-ratelimit-reset-{suffix}", duration(reset_ms)),
                ]
        if limits.concurrent:
            remaining = max(limits.concurrent - counts.running, 0)
            out += [
                ("x-ratelimit-limit-concurrent", str(limits.concurrent)),
                ("x-ratelimit-remaining-concurrent", str(remaining)),
            ]
        return out


class LimitReached(Exception):
    """A key at one of its limits: the request is refused (a 429 in every API's format)."""

    def __init__(self, tenant: Tenant, limit: LimitName, quota: Quota) -> None:
        self.tenant = tenant
        self.limit = LIMIT_NAMES[limit]
        self.value = tenant.limits.of(limit)
        self.retry_after_s = max(1, math.ceil(quota.counts.retry_after_ms / 1000))
        self.quota = quota
        again = "when one of its generations ends"
        if limit != "concurrent":
            again = f"in {duration(quota.counts.retry_after_ms)}"
        super().__init__(
            f"key {tenant.name!r} reached its {self.limit} limit ({self.value}); "
            f"it admits again {again} (Retry-After)"
        )


class TenantLimits:
    """A key's admission in a round trip of its own (``counts``), its undo (``release``),
    and what counts mean (``quota``)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._admit = Admit(redis, keys)
        self._release = Release(redis, keys)
        self._admitted = OldAdmissions(redis, keys)

    async def counts(
        self,
        tenant: Tenant,
        generation_ids: Sequence[str],
        *,
        session_id: str,
        count_request: bool = True,
    ) -> Counts:
        """Admit a request's generations, to be submitted to ``session_id``, against the
        key's limits, or refuse them (``count_request`` False: more choices of a request
        already counted)."""
        return await self._admit(
            tenant_id=tenant.id,
            generation_ids=generation_ids,
            count_request=count_request,
            limits=tenant.limits,
            session_id=session_id,
        )

    async def admitted(self, tenant: Tenant, after_s: float, most: int) -> list[tuple[str, str]]:
        """The (generation id, session id) ``counts`` admitted at least ``after_s`` ago
        that still count as running, oldest first."""
        return await self._admitted(tenant_id=tenant.id, after_s=after_s, most=most)

    @staticmethod
    def quota(tenant: Tenant, counts: Counts) -> Quota:
        """The key's quota after an admission (ADMIT's or SUBMIT's); ``LimitReached``
        when it refused."""
        quota = Quota(tenant.limits, counts)
        if counts.refused is not None:
            raise LimitReached(tenant, counts.refused, quota)
        return quota

    async def release(
        self, tenant: Tenant, generation_ids: Sequence[str], *, count_request: bool = True
    ) -> None:
        """Give back what an admission took for generations that were not queued after
        all."""
        await self._release(
            tenant_id=tenant.id, generation_ids=generation_ids, count_request=count_request
        )
