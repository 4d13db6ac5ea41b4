"""A tenant's limits and usage in Redis: the scripts that run on its slot, and their answers.

- ``Admit`` (wire/lua/admit.lua): admit a request's generations against the tenant's
  limits, or refuse them at the first limit reached, in one step (exact across gateways);
  ``Release`` gives back what it took when the submit was refused after all, and
  ``OldAdmissions`` lists what it took a while ago, for the reaper to give back what was never
  submitted (its gateway lost in between).
- Usage is counted where a generation's final event is written (wire/lua/usage_core.lua,
  inside every script that writes one); on a Redis Cluster the tenant's keys are on another
  slot, so the writer counts it right after, once per generation: ``UsageCounter``.
- ``read_usage``: the counts per UTC hour or day, for the admin API.

Key names: ``wire.keys.Keys.tenant``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import redis.asyncio as aioredis

from wire.keys import Keys
from wire.limits import RUNNING_HOLD_S, USAGE_COUNTS_ALL, Counts, Limits
from wire.messages import Usage, decode_final
from wire.replies import text
from wire.scripts import (
    ADMIT_CORE,
    USAGE_CORE,
    Bill,
    Script,
    counts_of,
    limits_args,
)
from wire.topology import Topology, topology_of

HOUR_S, DAY_S = 3_600, 86_400
USAGE_KEPT_S = {"hour": 45 * DAY_S, "day": 400 * DAY_S}
"""How long the usage of an hour and of a day is kept (usage_core.lua's HOUR_TTL, DAY_TTL)."""
Granularity = Literal["hour", "day"]


def _tenant_keys(keys: Keys, tenant_id: str) -> list[str]:
    """The keys every tenant script is given: ``requests`` first (the scripts name the
    others from it), all in the tenant's slot."""
    return [keys.tenant(tenant_id, name) for name in ("requests", "running", "tpm")]


class Admit(Script):
    """Admit generations against a tenant's limits (wire/lua/admit.lua)."""

    name = "admit"
    cores = (ADMIT_CORE,)

    async def __call__(
        self,
        *,
        tenant_id: str,
        generation_ids: Sequence[str],
        count_request: bool,
        limits: Limits,
        session_id: str,
    ) -> Counts:
        """``generation_ids``: the request's (the first one names it); ``count_request``:
        False for another choice of a request counted already; ``session_id``: where they
        are submitted next (a gateway lost before that leaves an admission whose
        generations never exist: ``OldAdmissions`` finds it)."""
        reply = await self._run(
            _tenant_keys(self.keys, tenant_id),
            [" ".join(generation_ids), *limits_args(limits, count_request), session_id],
            None,
        )
        if not isinstance(reply, list):
            raise TypeError(f"ADMIT answered {reply!r}")
        return counts_of([text(item) for item in reply])


class Release(Script):
    """Give back what ``Admit`` took for generations never queued (wire/lua/release.lua)."""

    name = "release"

    async def __call__(
        self, *, tenant_id: str, generation_ids: Sequence[str], count_request: bool
    ) -> None:
        await self._run(
            _tenant_keys(self.keys, tenant_id)[:2],
            [" ".join(generation_ids), "1" if count_request else "0"],
            None,
        )


class OldAdmissions(Script):
    """The generations ``Admit`` admitted at least ``after_s`` ago that still count as
    running, with their sessions (wire/lua/admitted.lua), oldest first."""

    name = "admitted"

    async def __call__(self, *, tenant_id: str, after_s: float, most: int) -> list[tuple[str, str]]:
        """(generation id, session id) pairs."""
        reply = await self._run(
            _tenant_keys(self.keys, tenant_id)[1:2],
            [RUNNING_HOLD_S * 1000, int(after_s * 1000), most],
            None,
        )
        if not isinstance(reply, list):
            raise TypeError(f"ADMITTED answered {reply!r}")
        found = [text(item) for item in reply]
        return list(zip(found[::2], found[1::2], strict=True))


class CountUsage(Script):
    """Count a generation's usage to its tenant, once (wire/lua/count_usage.lua)."""

    name = "count_usage"
    cores = (USAGE_CORE,)

    async def __call__(
        self,
        *,
        tenant_id: str,
        generation_id: str,
        bill: Bill,
        usage: Usage | None,
        counts: str = USAGE_COUNTS_ALL,
    ) -> bool:
        """True when it counted; False when the generation had been counted before.
        ``counts``: what its key's limits keep besides (``wire.scripts.usage_counts``)."""
        usage_json = msgspec.json.encode(usage) if usage is not None else b""
        reply = await self._run(
            _tenant_keys(self.keys, tenant_id)[:1],
            [generation_id, bill, usage_json, counts],
            None,
        )
        return reply == 1


_BILLS: frozenset[str] = frozenset({"all", "completion", "none"})
_usage_decoder = msgspec.json.Decoder(Usage)


class UsageCounter:
    """The count a topology that does not count in the script that writes a final event
    needs right after it (a Redis Cluster: ``wire.topology``); on one Redis
    ``after_final`` does nothing.

    The owner of a generation's transitions (wire/generations.py) calls ``after_final``
    once a script that writes or may write a final event answered, whether it wrote it or
    was refused (an ``events_lost`` end is written by the script that refuses the write):
    it reads the generation's final event and tenant, and counts the usage once per
    generation id, however many writers call it."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, topology: Topology | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.topology = topology or topology_of(redis)
        self._count = CountUsage(redis, keys, self.topology)

    async def after_final(self, session_id: str, generation_id: str) -> bool:
        """Whether this call counted it (False on one Redis, where the script did)."""
        if self.topology.counts_in_script:
            return False
        tenant, bill, recorded, final, counts = await self.redis.hmget(
            self.keys.generation(session_id, generation_id),
            ["tenant", "bill", "usage", "final", "counts"],
        )
        if not tenant or final is None:
            return False  # nobody to bill, or it has not ended
        usage = getattr(decode_final(final), "usage", None)
        if usage is None and recorded:
            usage = _usage_decoder.decode(recorded)
        billed = text(bill) if bill is not None else "all"
        return await self._count(
            tenant_id=text(tenant),
            generation_id=generation_id,
            bill=billed if billed in _BILLS else "all",  # type: ignore[arg-type]
            usage=usage,
            counts=text(counts) if counts is not None else USAGE_COUNTS_ALL,
        )


class UsagePeriod(msgspec.Struct, frozen=True):
    """A tenant's usage in one UTC hour or day (``start``: its first unix second)."""

    start: int
    prompt_tokens: int
    completion_tokens: int
    generations: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


async def read_usage(
    redis: aioredis.Redis,
    keys: Keys,
    tenant_id: str,
    granularity: Granularity,
    start_s: int,
    end_s: int,
) -> list[UsagePeriod]:
    """Every ``granularity`` period that overlaps [``start_s``, ``end_s``), with usage or
    not, in one round trip (a pipeline of one read per period, on the tenant's slot)."""
    length = HOUR_S if granularity == "hour" else DAY_S
    periods = range(start_s // length, -(-end_s // length))
    async with redis.pipeline(transaction=False) as pipe:
        for period in periods:
            pipe.hmget(
                keys.tenant(tenant_id, f"usage:{granularity}:{period}"),
                ["prompt_tokens", "completion_tokens", "generations"],
            )
        replies = await pipe.execute()
    return [
        UsagePeriod(period * length, *(int(value or 0) for value in reply))
        for period, reply in zip(periods, replies, strict=True)
    ]
