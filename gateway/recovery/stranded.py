"""Recovery's repairs of session turns whose request never reached its queue.

A session turn is submitted in two round trips: the SUBMIT script writes the generation
(and notes the turn beside its model's queue, ``RequestQueue.note_submitting``), then the
request is queued, crossing the note off (gateway/core/store/submitter.py). Two things can leave a
turn ``queued`` with no request in any queue:

- its gateway died between the two (``queue_stranded``: the reaper queues the turns whose
  note is ``STRANDED_AFTER_S`` old, from the note itself);
- Redis lost the request (a cluster's failover drops what its primary acknowledged;
  gateway/core/relay/waiting.py): ``requeue_lost``, for the turns this process's readers wait on
  (``waiting_generations`` finds those of readers that resumed past the ``queued``).

A copy sent twice (its gateway only slow, or the request not lost after all) runs once:
a worker claims a generation only while it is queued.
"""

from __future__ import annotations

import logging
import time

import msgspec

import wire
from gateway.core.store.queue import GenerationQueue
from gateway.core.store.sessions import Sessions
from wire import GenerationRequest
from wire.queue import RequestQueue

log = logging.getLogger("tokenspout.sessions")
_request_decoder = msgspec.json.Decoder(GenerationRequest)

STRANDED_AFTER_S = 3.0
"""A session turn noted on its way to the queue this long ago and still not there: its
gateway died before queueing it, and the reaper does (``queue_stranded``). A gateway only
slow meanwhile (its Redis away) sends a second copy, which runs once."""
STRANDED_PAGE = 100


class StrandedTurns:
    """The session turns left ``queued`` with no request in their queue, queued again."""

    def __init__(self, sessions: Sessions, queue: GenerationQueue) -> None:
        self.sessions = sessions
        """Where a turn's state and its conversation are read (the submit path's own)."""
        self.queue = queue
        self.redis, self.keys = sessions.redis, sessions.keys

    async def queue_stranded(self, queue: RequestQueue, older_than_s: float) -> int:
        """Queue the session turns noted on their way to ``queue`` over ``older_than_s``
        ago and never queued: their gateway died between the submit's two round trips (a
        client that sends again with its Idempotency-Key repairs it sooner; a WebSocket's
        ``generate`` has no such key). A turn still ``queued`` gets its request; any other
        note (the submit was refused, or its request came another way) is crossed off. A
        copy sent twice (its gateway only slow) runs once. Returns how many were queued."""
        queued = 0
        for note in await queue.submitting_since(time.time() - older_than_s, STRANDED_PAGE):
            try:
                request = _request_decoder.decode(note)
            except msgspec.DecodeError as exc:
                log.error("unreadable note in %s: %r", queue.submitting_key, exc)
                await queue.cross_off(note)
                continue
            if await self.sessions.still_queued(request.session_id, request.generation_id):
                stranded = await self.sessions.with_turn(request)
                await self.queue.enqueue(queue.model, stranded, note)
                queued += 1
            else:
                await queue.cross_off(note)
        if queued:
            log.warning(
                "queued %d session turns whose request was not in the queue %g s after their"
                " submit (their gateway died, or waits for Redis: then a copy runs once)",
                queued,
                older_than_s,
            )
        return queued

    async def requeue_lost(self, session_id: str, generation_id: str) -> bool:
        """Queue again a session turn still ``queued`` whose request seems lost: no request
        waits in its queue (none after its consumer group's last delivered one, or the
        queue is gone), so none of them is its. Its request comes from the note the submit
        kept with the generation (none for a one-shot API request: then False). A copy
        that was not lost after all (taken by a worker stopped before its claim) runs once.
        Returns whether it queued."""
        key = self.keys.generation(session_id, generation_id)
        state, note, model = await self.redis.hmget(key, ["state", "note", "queue"])
        if state is None or wire.text(state) != "queued" or not note or not model:
            return False
        queue = self.queue.of(wire.text(model))
        after = await queue.waiting_after()  # its group's lag is nil after a deletion: read
        if (after is not None and await queue.read_after(after, 1)) or await queue.fair_waiting():
            return False  # requests wait there: it may be one of them (the deadline decides)
        request = await self.sessions.with_turn(_request_decoder.decode(note))
        await self.queue.enqueue(queue.model, request)
        return True

    async def waiting_generations(self, session_ids: list[str]) -> list[tuple[str, str, float]]:
        """(session, generation, when submitted) of the sessions' running generations that
        no worker has started: two round trips, whatever the number of sessions."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id in session_ids:
                pipe.get(self.keys.active(session_id))
            actives = await pipe.execute()
        running = [
            (session_id, wire.text(active))
            for session_id, active in zip(session_ids, actives, strict=True)
            if active is not None
        ]
        if not running:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id, generation_id in running:
                pipe.hmget(self.keys.generation(session_id, generation_id), ["state", "created"])
            states = await pipe.execute()
        return [
            (session_id, generation_id, float(created))
            for (session_id, generation_id), (state, created) in zip(running, states, strict=True)
            if state is not None and wire.text(state) == "queued" and created is not None
        ]
