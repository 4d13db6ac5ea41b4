"""``ReaderDeadline``: every gateway process looks after the generations its readers saw
queued and never saw start, whose request may be in no queue the reaper reads
(gateway/core/relay/waiting.py says how that happens): ``REQUEUE_AFTER_S`` on, one whose
queue has no request waiting is queued again (a session turn from its note, a reply taken
over from its continuation), or ended ``events_lost`` when nothing of it is kept (a one-shot
request's); ``READER_GRACE_S`` after the queue deadline, what still waits is ended (the
reaper's own deadline, gateway/recovery/reaper.py, comes first for what it can see).
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from gateway.core.relay.hub import RelayHub
from gateway.recovery.reaper import queue_timeout
from gateway.recovery.stranded import NothingKept, StrandedTurns
from wire import Error, Usage
from wire.generations import Generations

log = logging.getLogger("tokenspout.watchdog")

READER_GRACE_S = 2.0
"""The readers' deadline comes this long after the reaper's: a request the reaper can see
in its queue is ended (and counted) there first."""
READER_CHECK_S = 1.0
REQUEUE_AFTER_S = 5.0
"""A session turn still queued this long with no request waiting in its queue lost its
request: queued again. After the stranded-turn repair's ``STRANDED_AFTER_S``, which
queues the turns of a gateway that died mid-submit from the notes beside the queue."""


def request_lost(generation_id: str, streamed: Usage | None) -> Error:
    """The final event of a generation whose request Redis lost with no copy kept to queue
    it again (a one-shot request's): billed what it ``streamed``, if it had begun."""
    return Error(
        generation_id,
        "events_lost",
        "Redis lost this generation's request (a failover or a crash lost its last writes);"
        " send it again",
        streamed,
    )


class ReaderDeadline:
    """Looks after the generations this process's readers wait on that never started
    (gateway/core/relay/waiting.py): queues a session turn again ``REQUEUE_AFTER_S`` on when nothing
    waits in its queue (``StrandedTurns.requeue_lost``), and ends with ``queue_timeout``
    what still waits ``READER_GRACE_S`` past the queue deadline, through the reaper's
    script: it ends only a generation still queued, and a worker that finds its request
    later skips it."""

    def __init__(
        self,
        generations: Generations,
        hub: RelayHub,
        stranded: StrandedTurns,
        queue_timeout_s: float,
    ) -> None:
        self.generations = generations
        self.waiting = hub.waiting
        self.stranded = stranded
        self.queue_timeout_s = queue_timeout_s

    async def run_forever(self, interval_s: float = READER_CHECK_S) -> None:
        while True:
            await asyncio.sleep(interval_s)
            for what, duty in (
                ("looking at quiet sessions for", self.book_quiet),
                ("requeueing", self.requeue_lost),
                ("ending", self.end_overdue),
            ):
                try:
                    await duty()
                except (RedisError, OSError) as exc:
                    log.warning("readers' deadline: %s a generation failed: %s", what, exc)
                except Exception:
                    log.exception("readers' deadline: %s failed; the next check tries again", what)

    async def book_quiet(self) -> int:
        """Book the waiting generations of the sessions whose readers heard nothing for a
        heartbeat (a reader that resumed after a ``queued`` event never saw it); returns
        how many it found."""
        quiet = self.waiting.take_quiet()
        found = await self.stranded.waiting_generations(quiet) if quiet else []
        for session_id, generation_id, submitted_s in found:
            self.waiting.book(session_id, generation_id, submitted_s)
        return len(found)

    async def requeue_lost(self) -> int:
        """Queue again the generations waiting ``REQUEUE_AFTER_S`` whose request is in no
        queue, and end those with nothing kept to queue again; each is looked at once (once
        Redis answered about it).
        Returns how many were queued again or ended."""
        repaired = 0
        since = time.time() - REQUEUE_AFTER_S
        for session_id, generation_id in self.waiting.queued_before(since, requeued=False):
            # Marked once looked at, not before: one Redis could not be asked about (a
            # failover with no primary yet) is looked at again at the next check, or its
            # continuation, lost with the old primary, would wait in no queue for ever.
            repair = await self.stranded.requeue_lost(session_id, generation_id)
            self.waiting.requeued(session_id, generation_id)
            if repair == "requeued":
                repaired += 1
                log.warning(
                    "generation %s of session %s was still queued %g s on with no request"
                    " waiting in its queue (Redis lost it): queued again",
                    generation_id,
                    session_id,
                    REQUEUE_AFTER_S,
                )
            elif isinstance(repair, NothingKept):
                event = request_lost(generation_id, repair.streamed)
                [ended] = await self.generations.end_queued([(session_id, event)])
                self.waiting.settled(session_id, generation_id)
                repaired += ended
                log.warning(
                    "generation %s of session %s was still queued %g s on with its request"
                    " in no queue (Redis lost it) and no copy kept: ended with events_lost",
                    generation_id,
                    session_id,
                    REQUEUE_AFTER_S,
                )
        return repaired

    async def end_overdue(self) -> int:
        """End the overdue ones; returns how many were still queued (the others started
        or ended meanwhile). One that fails stays, for the next check."""
        overdue = self.waiting.queued_before(time.time() - self.queue_timeout_s - READER_GRACE_S)
        ended = 0
        for session_id, generation_id in overdue:
            event = queue_timeout(generation_id, self.queue_timeout_s)
            [done] = await self.generations.end_queued([(session_id, event)])
            self.waiting.settled(session_id, generation_id)
            if done:
                ended += 1
                log.warning(
                    "generation %s of session %s was still queued %g s after its queue"
                    " deadline, with its request in no queue (lost by Redis): ended with"
                    " queue_timeout",
                    generation_id,
                    session_id,
                    READER_GRACE_S,
                )
        return ended
