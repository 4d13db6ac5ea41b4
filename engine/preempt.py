"""Preemption (``python -m engine --preempt``): a full worker makes room at once for a
tenant that asks less than its share.

With every slot busy, a request waits for a slot to free, whatever order the fair queue
gives it: hundreds of milliseconds for a quiet key behind a noisy one's replies
(docs/tenants.md, "What the fairness bench shows"). So, while every slot is busy, the worker
waits on its queue's newcomer bell (rung when a tenant that had nothing waiting queues a
request), and while tenants wait in lists looks every ``RECHECK_MS`` between rings (a
request may become owed after it came); while none waits it looks only at a ring. It marks
its queue as preempted on (``RequestQueue.mark_preempting``): new requests then always wait
in lists, where it chooses from. It asks the queue's script (wire/lua/fair_preempt.lua)
whether the tenant running here that was served most lately was served more than its share,
and a waiting tenant (the least served first) less than half as much. If so the script
hands it that request, which starts at once, and that tenant's newest reply stops as a
drain's hand-over stops one
(engine/handover.py: its events in Redis, its generation at its next epoch, a stop never
counted against ``TOKENSPOUT_MAX_TAKEOVERS``). Its continuation is kept here and goes on at
this worker's next free slot, before anything is taken from the queue unless a tenant served
far less waits (the same script: engine/intake.py); its request stays pending under this
worker meanwhile, so a lost worker's stopped replies are taken over as its running ones
are. A reply's reader sees a ``resumed`` event, as after a takeover; an OpenAI stream goes
on without a sign.

One full worker acts per ring (BLPOP hands it to one); nothing is stopped while work
admitted before (a takeover, a request given back) waits in the queue's stream.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from engine.handover import HandOver
from engine.intake import Intake
from engine.job import Job, JobState
from engine.metrics import WorkerMetrics
from wire.keys import tenant_slot
from wire.queue import RequestQueue

log = logging.getLogger("tokenspout.preempt")

RECHECK_MS = 20
"""While every slot is busy, a look at the queue at least this often besides each ring: a
request whose tenant was not owed a slot when it came (what the running tenants were served
reaches the queue with the worker's next charge, once a second) may be owed one later."""
IDLE_WAIT_MS = 1_000
"""While no tenant waits, the longest wait for a newcomer's ring before the next."""
FILL_WAIT_S = 1.0
MARK_EVERY_S = 1.0
"""How often the worker renews its queue's mark that a worker there preempts."""
RETRY_S = 0.5


class Preemptor:
    """A worker's preemption: its intake's jobs and queue, stopped through its hand-over."""

    def __init__(self, intake: Intake, handover: HandOver) -> None:
        self.intake = intake
        self.handover = handover
        self.queue: RequestQueue = intake.queue
        self.metrics: WorkerMetrics = intake.metrics
        self.worker_id: str = intake.worker_id

    async def run_forever(self) -> None:
        marked_at = -MARK_EVERY_S
        while True:
            try:
                if time.monotonic() - marked_at >= MARK_EVERY_S:
                    await self.queue.mark_preempting()
                    marked_at = time.monotonic()
                await self._retry_failed()
                await self._look_when_due()
            except (RedisError, OSError) as exc:
                log.warning("preempting failed (%s); retrying", exc)
                self.metrics.redis_errors.labels("preempt").inc()
                await asyncio.sleep(RETRY_S)

    async def _look_when_due(self) -> None:
        """One look at the queue when one is due. While tenants wait in lists: at a
        newcomer's ring or every ``RECHECK_MS``. While none does (the last take or look
        found none), only at a ring, which a tenant's first waiting request makes: looks
        cost nothing then. A ring this worker owed nothing for is rung again for another
        full worker (once: a worker that looks every ``RECHECK_MS`` rings none)."""
        if not self.intake.full:
            await self.intake.until_full(FILL_WAIT_S)
            # Full again, it looks at once: a ring it took while a slot was free (and a
            # request that came meanwhile) would wait for the next recheck.
            if self.intake.full and self.queue.tenants_wait:
                await self.preempt_once()
            return
        if self.queue.tenants_wait:
            await self.queue.newcomer(RECHECK_MS)
            if self.intake.full:
                await self.preempt_once()
            return
        if not await self.queue.newcomer(IDLE_WAIT_MS):
            return
        if self.intake.full and not await self.preempt_once() and self.queue.tenants_wait:
            await self.queue.ring_newcomer()

    async def preempt_once(self) -> bool:
        """Stop one reply for a tenant served less, when the queue says one is due; True
        when a request was taken for it."""
        jobs = self.intake.jobs.values()
        running = [job.request.tenant for job in jobs if job.can_hand_over]
        others = [job.request.tenant for job in jobs if not job.can_hand_over]
        others += self.intake.kept_tenants
        found = await self.queue.preempt_for(self.worker_id, running, others)
        if found is None:
            return False
        stopped_tenant, (entry_id, fields) = found
        self.intake.take(entry_id, fields)  # over capacity until the stopped one leaves
        victim = self._newest_of(stopped_tenant)
        if victim is None:  # it ended meanwhile: its slot is free anyway
            return True
        await self._stop(victim)
        return True

    async def _stop(self, job: Job) -> None:
        """Stop ``job``'s run and keep its continuation for this worker's next free slot."""
        request = await self.handover.stop(job, preempted=True)
        if request is None:
            return
        self.intake.keep(job.entry_id, request)
        await self.handover.backend.abort(job.request.engine_request_id)
        self.metrics.preemptions.inc()
        log.info(
            "stopped %s for another tenant's request; it goes on at the next free slot",
            job.generation_id,
            extra={"generation_id": job.generation_id, "tenant": job.request.tenant},
        )

    def _newest_of(self, slot: str) -> Job | None:
        """The reply of tenant ``slot`` that streamed least: the least to recompute."""
        jobs = [
            job
            for job in self.intake.jobs.values()
            if job.can_hand_over and tenant_slot(job.request.tenant) == slot
        ]
        return min(jobs, key=lambda job: job.emitted_tokens, default=None)

    async def _retry_failed(self) -> None:
        """A stop whose hand-over raised (Redis away) froze its reply: hand it on again."""
        frozen = [j for j in self.intake.jobs.values() if j.state is JobState.HANDOVER_FAILED]
        for job in frozen if self.intake.accepting else []:
            await self._stop(job)
