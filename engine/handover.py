"""SIGTERM with other workers serving: a running reply moves to one of them at once.

The same path as a takeover by the gateways' reaper (gateway/takeover.py): the TAKEOVER
script (``wire.scripts.Takeover``) takes the generation from this worker atomically (so a
reaper that thinks this worker lost cannot hand it on a second time), then the request goes
back on the queue with what was streamed, and the next worker goes on from there. Here the
worker knows exactly what it streamed, so nothing is read back: it stops emitting, waits
until its last event is in Redis, and hands on that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec
from redis.exceptions import RedisError

import wire
from wire import Resume

if TYPE_CHECKING:
    from engine.job import Job
    from engine.worker import Worker

log = logging.getLogger("tokenspout.handover")


async def hand_over_running(worker: Worker) -> None:
    """Hand every generation the draining ``worker`` has started to the others, when one
    serves (the last worker standing keeps them: they drain)."""
    jobs = [j for j in worker.jobs.values() if j.claimed and not (j.ended or j.handing_over)]
    if not jobs:
        return
    try:
        if not await worker.lease.others_serving():
            return
    except (RedisError, OSError) as exc:
        log.warning("looking for workers to hand over to failed (%s)", exc)
        return
    results = await asyncio.gather(
        *(hand_over(worker, job) for job in jobs), return_exceptions=True
    )
    for job, result in zip(jobs, results, strict=True):
        if isinstance(result, BaseException):
            # Left to the drain (and, once this worker is gone, to the reaper).
            log.warning("handing %s over failed: %r", job.generation_id, result)


async def give_back(worker: Worker, entries: list[wire.StreamEntry]) -> None:
    """Requests a draining worker read after all: back on the queue for the others."""
    await worker.queue.requeue(entries)
    log.info("gave %d requests back to the queue: draining", len(entries))


async def hand_over(worker: Worker, job: Job) -> bool:
    """Put ``job`` back on the queue for another worker; True when it was handed on.

    A generation already taken over ``max_takeovers`` times stays here and drains.
    """
    gid, sid = job.generation_id, job.session_id
    job.handing_over = True
    await worker.publisher.written()  # every event emitted is in Redis (written in order)
    outcome = await worker.takeover_script(
        session_id=sid,
        generation_id=gid,
        worker=worker.worker_id,
        max_takeovers=worker.max_takeovers,
        usage=job.usage(),
    )
    if outcome[0] != "takeover":
        log.info("not handing %s over: %s", gid, outcome[0])
        job.handing_over = False
        return False
    request = msgspec.structs.replace(
        job.request,
        enqueued_at=time.time(),
        resume=Resume(
            takeover=int(outcome[1]),
            from_worker=worker.worker_id,
            prompt_tokens=job.prompt_tokens,
            completion_tokens=job.emitted_tokens,
            text="".join(job.text),
            token_ids=list(job.token_ids),
        ),
    )
    job.ended = job.acked = True
    await worker.queue.requeue([(job.entry_id, {"r": wire.encode(request)})])
    await worker.backend.abort(job.request.engine_request_id)
    worker.metrics.handovers.inc()
    log.info(
        "generation handed over",
        extra={"generation_id": gid, "completion_tokens": job.emitted_tokens},
    )
    return True
