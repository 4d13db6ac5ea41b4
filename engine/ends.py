"""The final events a worker wrote lately, written again when Redis was away.

Redis acknowledges a write once it holds it in memory: a Redis whose host crashed comes
back from an AOF that lacks what its last fsync did not cover (``appendfsync everysec``: up
to a second), and a replica promoted in a failover lacks what it had not received. A reply
that ended in that window lost its end (and maybe its last tokens) while its worker moved
on: nobody would ever end it, and its readers would wait for ever. So when its lease
finds Redis was away (a heartbeat failed, or its connection is a new one), the worker
writes the final events of the last ``RECENT_S`` again, each with its number in its
generation (the EMIT script's rule, wire/lua/emit_event.lua): an end Redis kept is
skipped; an end lost alone is written again (the reply ends whole); an end lost with
events before it ends the generation ``events_lost`` instead of leaving a gap. Its
request is acknowledged (and, on a cluster, its usage counted) with it again, as the
first write did (``Generations.emit_step``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import NamedTuple

from engine.job import Job
from engine.publisher import Publisher
from wire import ChatMessage, FinalEvent
from wire.emit_step import EmitTarget

log = logging.getLogger("tokenspout.worker")

RECENT_S = 10.0
"""Longer than what a crash or a failover loses, and than the outage before it is seen."""


class _End(NamedTuple):  # a tuple: made for every reply (a frozen dataclass costs 3x)
    at: float
    target: EmitTarget
    entry_id: bytes
    """Its request's queue entry (the write acknowledges it again)."""
    event: FinalEvent
    seq: int
    assistant: ChatMessage | None


class RecentEnds:
    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self._ends: collections.deque[_End] = collections.deque()
        self._restating: asyncio.Task[int] | None = None

    def restate_soon(self) -> None:
        """``restate`` in a task of its own (its writes wait for Redis as long as it takes,
        and the heartbeat that asks must not), unless one runs already."""
        if self._restating is None or self._restating.done():
            self._restating = asyncio.create_task(self.restate(), name="restate ends")
            self._restating.add_done_callback(_log_failure)

    def add(
        self,
        job: Job,
        event: FinalEvent,
        seq: int,
        assistant: ChatMessage | None,
    ) -> None:
        """A final event written (``seq``: its number in its generation). Not the job:
        ``RECENT_S`` of them are kept, and a job holds its request and every token."""
        now = time.monotonic()
        self._ends.append(_End(now, job.target, job.entry_id, event, seq, assistant))
        while self._ends and now - self._ends[0].at > RECENT_S:
            self._ends.popleft()

    async def restate(self) -> int:
        """Write the recent final events again (see the module's doc); how many."""
        now = time.monotonic()
        ends = [end for end in self._ends if now - end.at <= RECENT_S]
        written = [
            self.publisher.emit_waited(
                end.target,
                end.event,
                end.seq,
                final=True,
                assistant=end.assistant,
                ack=end.entry_id,
            )
            for end in ends
        ]
        await asyncio.gather(*written)  # in one write
        if ends:
            log.info("wrote the last %d final events again: Redis was away", len(ends))
        return len(ends)


def _log_failure(task: asyncio.Task[int]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("writing the last final events again failed (%s)", exc)
