"""Preemption (``python -m engine --preempt``): a full worker makes room at once for a
tenant served less than one it runs.

With every slot busy, a request waits for a slot to free, whatever order the fair queue
gives it: hundreds of milliseconds for a quiet key behind a noisy one's replies
(docs/tenants.md, "What the fairness bench shows"). So, while every slot is busy, the worker
waits on its queue's newcomer bell (rung when a tenant that had nothing waiting queues a
request) and asks the queue's script (wire/lua/fair_preempt.lua) whether a waiting tenant
(the least served first) would, with one more slot, still hold fewer here per unit of
weight than a running tenant does. If so the script hands it that request, which starts at
once, and the newest reply of the tenant holding the most goes
back to the queue as a drain hands a reply on (engine/handover.py): it goes on from where
it stopped at the next free slot, before any other request (a takeover that never counts
against ``TOKENSPOUT_MAX_TAKEOVERS``). A reply's reader sees a ``resumed`` event, as after
a takeover; an OpenAI stream goes on without a sign.

One full worker acts per ring (BLPOP hands it to one), and nothing is stopped while a
stopped reply still waits for its next slot. Between rings a full worker looks again every
``RECHECK_MS``: a request may become the least served after it came.
"""

from __future__ import annotations

import asyncio
import logging

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
request that was not the least served when it came (its tenant had just been charged for
a reply), or came while a stopped reply still waited for its slot, may be owed one later."""
FILL_WAIT_S = 1.0
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
        while True:
            try:
                await self._retry_failed()
                if not self.intake.full:
                    await self.intake.until_full(FILL_WAIT_S)
                    continue
                await self.queue.newcomer(RECHECK_MS)
                if self.intake.full:
                    await self.preempt_once()
            except (RedisError, OSError) as exc:
                log.warning("preempting failed (%s); retrying", exc)
                self.metrics.redis_errors.labels("preempt").inc()
                await asyncio.sleep(RETRY_S)

    async def preempt_once(self) -> bool:
        """Stop one reply for a tenant served less, when the queue says one is due; True
        when a request was taken for it."""
        running = [job.request.tenant for job in self.intake.jobs.values() if job.can_hand_over]
        found = await self.queue.preempt_for(self.worker_id, running)
        if found is None:
            return False
        stopped_tenant, (entry_id, fields) = found
        self.intake.take(entry_id, fields)  # over capacity until the stopped one leaves
        victim = self._newest_of(stopped_tenant)
        if victim is None:  # it ended meanwhile: its slot is free anyway
            return True
        if await self.handover.hand_over(victim, preempted=True):
            self.metrics.preemptions.inc()
            log.info(
                "stopped %s for another tenant's request",
                victim.generation_id,
                extra={"generation_id": victim.generation_id, "tenant": stopped_tenant},
            )
        return True

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
            if await self.handover.hand_over(job, preempted=True):
                self.metrics.preemptions.inc()
