"""Admissions never submitted, given back.

A key with a concurrent limit counts a generation from its admission (ADMIT, on the key's
Redis slot) to its final event. A session turn, a stored response and any request on a
Redis Cluster are admitted in a round trip of their own, before the SUBMIT that writes
the generation; a gateway lost in between (SIGKILL, the OOM killer), or one whose give-back
failed, left an admission whose generation never exists: it counted against the key for
the hour a running entry lasts (``RUNNING_HOLD_S``), a key limited to 3 left with 1 (the
chaos run, seed 13 on a cluster). ADMIT records such an admission's session; the reaper
looks at each limited key's admissions older than ``SUBMITTED_WITHIN_S``, every
``LOOK_EVERY_S``: one whose generation does not exist is given back (RELEASE), one whose
generation ended is counted (a Redis Cluster's count, once: its writer was lost before
it counted; the count drops it from the running ones), one still queued or running stays.
"""

from __future__ import annotations

import logging
import time

from gateway.core.store.admission import Admission
from gateway.tenants.records import Tenant
from wire.generations import Generations

log = logging.getLogger("tokenspout.reaper")

SUBMITTED_WITHIN_S = 10.0
"""A SUBMIT follows its admission within a round trip. A gateway that took longer (stopped
that long, or waiting out Redis) writes a generation the reaper has given back: it runs
without counting against the limit, one over while it runs."""
LOOK_EVERY_S = 2.0
MOST_PER_KEY = 200
"""Admissions looked at per key and look (the oldest first)."""


class UnsubmittedAdmissions:
    def __init__(self, generations: Generations, admission: Admission) -> None:
        self.generations = generations
        self.redis, self.keys = generations.redis, generations.keys
        self.admission = admission
        self._next_s = 0.0

    def due(self) -> bool:
        """A look is due (every ``LOOK_EVERY_S``; the reaper passes every 0.1 s)."""
        now = time.monotonic()
        if now < self._next_s:
            return False
        self._next_s = now + LOOK_EVERY_S
        return True

    async def look(self) -> int:
        """Give back or count what each limited key's old admissions left; returns how many."""
        settled = 0
        for tenant in self.admission.with_concurrency_limit():
            settled += await self._look_at(tenant)
        return settled

    async def _look_at(self, tenant: Tenant) -> int:
        limits = self.admission.limits
        admitted = await limits.admitted(tenant, SUBMITTED_WITHIN_S, MOST_PER_KEY)
        if not admitted:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for gid, sid in admitted:
                pipe.hmget(self.keys.generation(sid, gid), ["state", "final"])
            states = await pipe.execute()
        settled = 0
        for (gid, sid), (state, final) in zip(admitted, states, strict=True):
            if state is None:
                log.warning(
                    "generation %s of key %s was admitted %g s ago and never submitted (its"
                    " gateway was lost, or its give-back failed): given back",
                    gid,
                    tenant.id,
                    SUBMITTED_WITHIN_S,
                )
                await limits.release(tenant, [gid], count_request=False)
                settled += 1
            elif final is not None and await self.generations.count_usage(sid, gid):
                log.warning("generation %s of key %s ended uncounted: counted", gid, tenant.id)
                settled += 1
        return settled
