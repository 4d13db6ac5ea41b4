"""Recovery's repairs of session turns whose request never reached its queue.

A session turn is submitted in two round trips: the SUBMIT script writes the generation
(and notes the turn beside its model's queue, ``RequestQueue.note_submitting``), then the
request is queued, crossing the note off (gateway/core/store/submitter.py). Two things can leave a
turn ``queued`` with no request in any queue:

- its gateway died between the two (``queue_stranded``: the reaper queues the turns whose
  note is ``STRANDED_AFTER_S`` old, from the note itself); the same holds for a one-shot
  API request on a Redis Cluster, whose note carries its whole request;
- Redis lost the request (a cluster's failover drops what its primary acknowledged;
  gateway/core/relay/waiting.py): ``requeue_lost``, for the turns this process's readers wait on
  (``waiting_generations`` finds those of readers that resumed past the ``queued``).

A copy sent twice (its gateway only slow, or the request not lost after all) runs once:
a worker claims a generation only while it is queued.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal, cast

import msgspec

import wire
from gateway.core.store.queue import GenerationQueue
from gateway.core.store.sessions import Sessions
from wire import GenerationRequest, Usage
from wire.generations import CONTINUATION
from wire.handoff import continuation, streamed_so_far
from wire.outcomes import TakenOver
from wire.queue import RequestQueue

log = logging.getLogger("tokenspout.sessions")
_request_decoder = msgspec.json.Decoder(GenerationRequest)
_usage_decoder = msgspec.json.Decoder(Usage)

STRANDED_AFTER_S = 3.0
"""A session turn noted on its way to the queue this long ago and still not there: its
gateway died before queueing it, and the reaper does (``queue_stranded``). A gateway only
slow meanwhile (its Redis away) sends a second copy, which runs once."""
STRANDED_PAGE = 100
UNSUBMITTED_GRACE_S = 60.0
"""A note whose generation does not exist yet is kept this long after its request was
made: its gateway's SUBMIT may still be on its way (a slow link, scripts loaded again after
a restart: seconds). Crossed off before, a gateway that then made the generation and died
before queueing the request left it ``queued`` with nothing to repair it. Past it, the
submit was refused or its gateway died before it."""


def _whole(request: GenerationRequest) -> bool:
    """A one-shot request's note carries its conversation (its session keeps none); a
    session turn's is read from the session's history."""
    return bool(request.messages or request.prompt is not None or request.token_ids)


@dataclass(frozen=True)
class NothingKept:
    """A generation whose request Redis lost, with nothing kept to queue it again (a
    one-shot request's: its session keeps no conversation)."""

    streamed: Usage | None
    """What it streamed before it waited again (its takeover's count), if it had begun."""


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
        ``generate`` has no such key). A turn still ``queued`` gets its request; one whose
        generation does not exist yet is looked at again ``older_than_s`` later, for
        ``UNSUBMITTED_GRACE_S``; any other note (the submit was refused, or its request
        came another way) is crossed off. A copy sent twice (its gateway only slow) runs
        once. Returns how many were queued."""
        queued = 0
        for note in await queue.submitting_since(time.time() - older_than_s, STRANDED_PAGE):
            try:
                request = _request_decoder.decode(note)
            except msgspec.DecodeError as exc:
                log.error("unreadable note in %s: %r", queue.submitting_key, exc)
                await queue.cross_off(note)
                continue
            state = await self.sessions.generation_state(request.session_id, request.generation_id)
            if state == "queued":
                stranded = request if _whole(request) else await self.sessions.with_turn(request)
                await self.queue.enqueue(queue.model, stranded, note)
                queued += 1
            elif state is None and time.time() - request.enqueued_at < UNSUBMITTED_GRACE_S:
                await queue.look_again_later(note)
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

    async def requeue_lost(
        self, session_id: str, generation_id: str
    ) -> Literal["requeued"] | NothingKept | None:
        """Repair a generation still ``queued`` whose request seems lost: none waits in its
        queue (none after its consumer group's last delivered one, nor in the tenants'
        lists) and no note of it is on its way there (the reaper queues a noted one). A
        session turn is queued again from the note the submit kept with the generation; a
        reply taken over, as the continuation its taker kept beside it
        (``Generations.keep_continuation``: at the takeover's epoch, from what it streamed;
        queued again as its first request every worker would refuse it, its epoch past), or,
        where the taker kept none, one made here the same way from the note.
        A copy that was not lost after all (taken by a worker stopped before its claim)
        runs once. A one-shot request has nothing kept to queue again: unless a worker
        holds it taken, ``NothingKept`` (its reader's gateway ends it). None: not lost, or
        not queued (any more)."""
        key = self.keys.generation(session_id, generation_id)
        fields = ["state", "note", "queue", "takeovers", CONTINUATION, "usage", "from"]
        state, note, model, takeovers, resumed, usage, taken_from = await self.redis.hmget(
            key, fields
        )
        if state is None or wire.text(state) != "queued" or not model:
            return None
        queue = self.queue.of(wire.text(model))
        # One look at the whole queue: looks in turns could miss a request as it moves.
        where = await queue.locate(generation_id)
        if where in ("noted", "waiting"):
            return None  # on its way, or it may be among those waiting (the deadline decides)
        epoch = int(takeovers or 0)
        if resumed and epoch > 0:
            await queue.add({"r": cast(bytes, resumed)})  # as its taker queued it
            return "requeued"
        if note:
            request = await self.sessions.with_turn(_request_decoder.decode(note))
            if epoch > 0:  # its taker kept no continuation (refused, say, by a full Redis)
                streamed = await streamed_so_far(self.redis, self.keys, session_id, generation_id)
                if streamed is None:
                    return NothingKept(_usage_decoder.decode(usage) if usage else None)
                taken = TakenOver(epoch, wire.text(taken_from or b""))
                request = continuation(request, taken, streamed)
                await queue.add({"r": wire.encode(request)})
                return "requeued"
            await self.queue.enqueue(queue.model, request)
            return "requeued"
        if where == "taken":
            return None
        return NothingKept(_usage_decoder.decode(usage) if usage else None)

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
