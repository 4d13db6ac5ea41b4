"""SIGTERM with other workers serving: a running reply moves to one of them at once.

Its own module because it is its own transition, not part of running a generation: the
one the gateways' reaper makes for a lost worker (wire/handoff.py, gateway/recovery/takeover.py).
The worker's lease says whether another worker serves; the TAKEOVER script takes the
generation from this worker atomically (so a reaper that thinks this worker lost cannot
hand it on a second time), then its ``continuation`` goes back on the queue, and the next
worker goes on from there. Here the worker knows exactly what it streamed, so nothing is
read back: it stops emitting, waits until its last event is in Redis, and hands on that.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from redis.exceptions import RedisError

import wire
from engine.backends.base import Backend
from engine.job import Job, JobState
from engine.lease import Lease
from engine.metrics import WorkerMetrics
from engine.publisher import Publisher
from wire import GenerationRequest
from wire.handoff import Streamed, continuation
from wire.outcomes import TakenOver
from wire.queue import RequestQueue
from wire.scripts import Takeover

log = logging.getLogger("tokenspout.handover")


class HandOver:
    """Hands a draining worker's running generations to the other workers."""

    def __init__(
        self,
        *,
        takeover: Takeover,
        lease: Lease,
        publisher: Publisher,
        queue: RequestQueue,
        backend: Backend,
        metrics: WorkerMetrics,
        worker_id: str,
        max_takeovers: int,
    ) -> None:
        self.takeover = takeover
        self.lease = lease
        self.publisher = publisher
        self.queue = queue
        self.backend = backend
        self.metrics = metrics
        self.worker_id = worker_id
        self.max_takeovers = max_takeovers
        """How often one generation may be handed on (TOKENSPOUT_MAX_TAKEOVERS)."""

    async def hand_over_running(self, running: Iterable[Job]) -> None:
        """Hand every started generation of ``running`` to the others, when one serves
        (the last worker standing keeps them: they drain)."""
        jobs = [job for job in running if job.can_hand_over]
        if not jobs:
            return
        try:
            if not await self.lease.others_serving():
                return
        except (RedisError, OSError) as exc:
            log.warning("looking for workers to hand over to failed (%s)", exc)
            return
        failing = {job.generation_id for job in jobs if job.state is JobState.HANDOVER_FAILED}
        results = await asyncio.gather(*map(self.hand_over, jobs), return_exceptions=True)
        for job, result in zip(jobs, results, strict=True):
            if isinstance(result, BaseException) and job.generation_id not in failing:
                # Tried again by the drain (and, once this worker is gone, by the reaper):
                # said once, not at every try.
                log.warning(
                    "handing %s over failed: %s %s",
                    job.generation_id,
                    type(result).__name__,
                    result,
                )

    async def hand_over(self, job: Job) -> bool:
        """Put ``job`` back on the queue for another worker; True when it was handed on.

        A generation already taken over ``max_takeovers`` times stays here and drains.
        """
        request = await self.stop(job)
        if request is None:
            return False
        await self.queue.requeue([(job.entry_id, {"r": wire.encode(request)})])
        await self.backend.abort(job.request.engine_request_id)
        self.metrics.handovers.inc()
        log.info(
            "generation handed over",
            extra={"generation_id": job.generation_id, "completion_tokens": job.emitted_tokens},
        )
        return True

    async def stop(self, job: Job, *, preempted: bool = False) -> GenerationRequest | None:
        """Take ``job``'s generation to its next epoch and return its continuation (None:
        declined, and it runs on here), for the caller to queue; the engine's run is the
        caller's to abort. ``preempted``: stopped for another tenant's request
        (engine/preempt.py), which never counts against ``max_takeovers``."""
        gid, sid = job.generation_id, job.session_id
        if not job.begin_hand_over():
            return None
        try:
            await self.publisher.written()  # every event emitted is in Redis, in order
            outcome = await self.takeover(
                session_id=sid,
                generation_id=gid,
                worker=self.worker_id,
                max_takeovers=self.max_takeovers,
                usage=job.usage(),
                preempted=preempted,
            )
        except BaseException:
            # Tokens made since are not emitted here, so this generation must move on or
            # end elsewhere: the drain tries again, and the reaper after this worker.
            job.hand_over_failed()
            raise
        if not isinstance(outcome, TakenOver):
            log.info("not handing %s over: %s", gid, outcome.__struct_config__.tag)
            job.hand_over_declined()
            return None
        streamed = Streamed(
            prompt_tokens=job.prompt_tokens,
            completion_tokens=job.emitted_tokens,
            text="".join(job.text),
            token_ids=list(job.token_ids),
        )
        job.handed_over()
        if job.trace is not None:
            job.trace.event("preempted" if preempted else "handed_over")
        return continuation(job.request, outcome, streamed)
