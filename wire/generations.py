"""The one owner of a generation's transitions in Redis, for everyone who makes one.

A generation moves by Lua scripts (wire/lua/): SUBMIT makes it ``queued``, a worker's claim
(``started`` or ``resumed``) makes it ``running`` in an engine step (EMIT_STEP), CANCEL
ends it queued or flags it for its worker, TAKEOVER hands a running one to the next epoch,
END_QUEUED ends one no worker started, and any final event ends it. ``Generations`` makes
each of them, and each one counts the generation's usage itself where the topology needs a
count after the final event (``wire.tenancy.UsageCounter``), so no caller remembers to.
The differences between one Redis and a cluster are ``wire.topology``'s, asked here.

The gateway holds one (submit, cancel), the gateways' recovery one (take over, end, end
queued, count), each engine worker one (its steps, hand-over, acknowledgements):

    generations = Generations(redis, keys, events_maxlen=20_000, ttl_s=86_400)
    reply = await generations.cancel(session_id, generation_id, "user")
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Literal

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError, ResponseError

from wire.emit_step import EmitStep, EmitTarget, StepCall
from wire.handoff import Streamed, continuation, streamed_so_far
from wire.keys import SHARED_KEY_TTL_S, Keys
from wire.library import lost_scripts
from wire.messages import (
    Cancelled,
    CancelReason,
    CancelSignal,
    Error,
    FinalEvent,
    GenerationRequest,
    Usage,
    encode,
)
from wire.outcomes import (
    Accepted,
    AlreadyFinal,
    CancelAsked,
    CancelledQueued,
    CancelReply,
    Exhausted,
    NotStarted,
    SubmitReply,
    TakenOver,
    TakeoverReply,
)
from wire.queue import HELD_TTL_S, RequestQueue
from wire.replies import text
from wire.scripts import (
    AdmitInSubmit,
    Cancel,
    Emit,
    EndQueued,
    NewSession,
    Submit,
    Takeover,
    WaitingRequest,
)
from wire.tenancy import UsageCounter
from wire.topology import Fill, Proceed, Topology, topology_of

GoneOn = Literal["taken_over", "cancelled", "worker_lost"]
"""What became of a reply handed on from its events (``Generations.go_on_from_events``)."""

CONTINUATION = "continuation"
"""The generation's field that keeps the request continuing it (``keep_continuation``)."""
CANCELS_MAXLEN = 10_000
"""The cancels stream's cap: every worker reads every signal from its newest on."""
HOLD_WAIT_S = 0.5
"""On a cluster, the longest a step waits for the prefixes its replies left to be held (on
the queue's node): a reply's end is never held up longer for its next turn's affinity."""

log = logging.getLogger("tokenspout.generations")


class Generations:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        events_maxlen: int = 20_000,
        ttl_s: int = 86_400,
        topology: Topology | None = None,
    ) -> None:
        """``events_maxlen``, ``ttl_s``: a session's events stream cap and its keys' TTL,
        for the events written here outside a worker's step (a cancel, an end)."""
        self.redis = redis
        self.keys = keys
        self.events_maxlen = events_maxlen
        self.ttl_s = ttl_s
        self.topology = topology or topology_of(redis)
        topo = self.topology
        self._submit = Submit(redis, keys, topo)
        self._cancel = Cancel(redis, keys, topo)
        self._emit = Emit(redis, keys, topo)
        self._step = EmitStep(redis, keys, topo)
        self._takeover = Takeover(redis, keys, topo)
        self._end_queued = EndQueued(redis, keys, topo)
        self._usage = UsageCounter(redis, keys, topo)

    # --- submit (the gateway) ------------------------------------------------------------

    async def submit_noted(self, queue: RequestQueue, note: bytes, **submit: object) -> SubmitReply:
        """SUBMIT a session turn (``submit``: its arguments, ``wire.scripts.Submit``),
        after a note that its request is on its way to ``queue``
        (``RequestQueue.note_submitting``): should its gateway die before queueing it, the
        reaper does. The note lands first (``Topology.in_order``); it is kept with the
        generation too, to queue it again should Redis lose the request."""
        submit = {**submit, "note": note, "queue": queue.model}
        fills: list[Fill] = [
            lambda pipe: queue.note_submitting_in(pipe, note),
            lambda pipe: self._submit.submit_in(pipe, **submit),
        ]
        replies = await self._in_order(fills, self._submit.load)
        return Submit.replied(replies[-1])

    async def create_admitted(self, new: NewSession, admission: AdmitInSubmit) -> SubmitReply:
        """Admit a one-shot request (or answer ``OverCapacity`` or ``Limited``), make its
        session ``new`` and queue the request after its generation, in one call: only
        where one node holds every key (``Topology.one_node``)."""
        return await self._submit.create_admitted(new, admission)

    async def create_queued(
        self,
        new: NewSession,
        queue: RequestQueue,
        waiting: WaitingRequest,
        keep: Fill | None = None,
    ) -> SubmitReply:
        """Make a one-shot session ``new`` admitted before (its meta kept past its request
        by ``keep``), then queue its request (``waiting``) in ``queue``: after the
        generation exists, so no worker takes a request whose generation is not there (one
        pipeline on one Redis, where a fresh session cannot refuse it; after the reply on a
        cluster, and only if it was accepted). A request with a note (``waiting.note``: on a
        cluster, where it is queued a round trip after its session is made) is noted beside
        its queue first, whole, so that the reaper queues it should this process die
        between the two (gateway/recovery/stranded.py). Sent twice after a restarted Redis
        lost its scripts (``lost_scripts``): the first copy, with no generation to claim,
        is skipped by the worker that takes it."""
        if waiting.note:
            await queue.note_submitting(waiting.note)

        def create(pipe: Pipeline) -> None:
            self._submit.create_in(pipe, new)
            if keep is not None:
                keep(pipe)

        fills: list[Fill] = [create, lambda pipe: queue.submit_in(pipe, waiting)]

        async def load() -> None:
            await self._submit.load()
            await queue.load_scripts()

        def accepted(replies: list[object]) -> bool:
            return isinstance(Submit.replied(replies[0]), Accepted)

        replies = await self._in_order(fills, load, accepted)
        return Submit.replied(replies[0])

    async def _in_order(
        self,
        fills: Sequence[Fill],
        load: Callable[[], Awaitable[None]],
        proceed: Proceed | None = None,
    ) -> list[object]:
        """``Topology.in_order``, sent again once after the scripts are loaded (``load``)
        when Redis lost them (a restart): what the first try's other commands did, they do
        again, so they must not mind."""
        try:
            return await self.topology.in_order(fills, proceed)
        except ResponseError as exc:
            if not lost_scripts(exc):
                raise
        await load()
        return await self.topology.in_order(fills, proceed)

    # --- cancel ---------------------------------------------------------------------------

    async def cancel(
        self, session_id: str, generation_id: str, reason: CancelReason
    ) -> CancelReply:
        """End a queued generation here (``CancelledQueued``), or flag a running one for
        its worker (``SignalWorker``: then ``signal_cancel``)."""
        reply = await self._cancel(
            session_id=session_id,
            generation_id=generation_id,
            reason=reason,
            maxlen=self.events_maxlen,
            ttl_s=self.ttl_s,
        )
        if isinstance(reply, CancelledQueued):
            await self._usage.after_final(session_id, generation_id)
        return reply

    async def signal_cancel(self, signal: CancelSignal) -> None:
        """Tell every worker (the one running it aborts), renewing the stream's TTL."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(self.keys.cancels, {"c": encode(signal)}, maxlen=CANCELS_MAXLEN)
            pipe.expire(self.keys.cancels, SHARED_KEY_TTL_S)
            await pipe.execute()

    # --- a worker's steps -------------------------------------------------------------------

    def target(
        self, session_id: str, generation_id: str, *, epoch: int, maxlen: int, ttl_s: int
    ) -> EmitTarget:
        """Where a generation's events go: worked out once per run."""
        return self._step.target(session_id, generation_id, epoch=epoch, maxlen=maxlen, ttl_s=ttl_s)

    async def emit_step(
        self,
        calls: list[StepCall],
        acked: Sequence[tuple[EmitTarget, bytes]],
        queue: RequestQueue,
        held: Collection[str] = (),
    ) -> list[list[str | None]]:
        """Write an engine step's events (their calls grouped by ``Topology.group_of``),
        claims, tokens and final events alike, and acknowledge in ``queue`` the requests
        of ``acked`` (a final event's target, its request's entry id) once their final
        events are written; the writer holds the prefixes ``held`` (those its ended
        replies left in its engine's cache: docs/affinity.md) by the time they are. One
        node: the last call acknowledges and holds them itself. A cluster runs a
        pipeline's nodes at once, so the prefixes are held in a call of their own before
        (its failure, or a wait past ``HOLD_WAIT_S``, costs the next turns their
        affinity, never the step), and the acknowledgements follow in one after, once
        each acknowledged generation's usage is counted (a worker lost before that
        leaves its request pending, and the reaper that takes it counts it). Each
        event's stream id, or None where Redis refused it; sent again on a failure, each
        event is written once (its seq)."""
        acks = [entry_id for _, entry_id in acked]
        if self.topology.one_node:
            calls[-1].acknowledge(queue.key.encode(), acks)
            calls[-1].hold(queue.fair.base.encode(), held, HELD_TTL_S)
            if len(calls) == 1:
                return [await self._step.send(calls[0])]
        elif held:
            await self._hold_first(queue, calls[0].writer, held)
        async with self.redis.pipeline(transaction=False) as pipe:
            for call in calls:
                self._step.queue_in(pipe, call)
            replies = [EmitStep.replies(reply) for reply in await pipe.execute()]
        if acked and not self.topology.one_node:
            await self._counted([(t.session_id, t.generation_id) for t, _ in acked])
            await queue.ack(*acks)
        return replies

    @staticmethod
    async def _hold_first(queue: RequestQueue, writer: str, held: Collection[str]) -> None:
        try:
            await asyncio.wait_for(queue.hold(writer, sorted(held)), HOLD_WAIT_S)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("could not say which prefixes %s holds (%r)", writer, exc)

    async def load_step(self) -> None:
        """Load EMIT_STEP (a restarted Redis, or a promoted replica, has no scripts)."""
        await self._step.load()

    async def acknowledge(
        self, queue: RequestQueue, ended: Sequence[tuple[bytes, str, str]]
    ) -> None:
        """Acknowledge requests in ``queue`` whose runs ended with no final event of their
        own (``ended``: entry id, session id, generation id; "" for an unreadable entry):
        another writer may have ended them (a queued cancel, ``events_lost``), so their
        usage is counted first where the topology needs it, once."""
        if not ended:
            return
        await self._counted([(sid, gid) for _, sid, gid in ended if gid])
        await queue.ack(*(entry_id for entry_id, _, _ in ended))

    async def take_over(
        self,
        session_id: str,
        generation_id: str,
        *,
        worker: str,
        max_takeovers: int,
        usage: Usage | None = None,
        preempted: bool = False,
        lost: bool = False,
    ) -> TakeoverReply:
        """TAKEOVER: a running generation from ``worker`` (lost or stopping) to its next
        epoch (``wire.scripts.Takeover``). One found ended is counted: its writer may
        have been lost between its final event and the count after it."""
        reply = await self._takeover(
            session_id=session_id,
            generation_id=generation_id,
            worker=worker,
            max_takeovers=max_takeovers,
            usage=usage,
            preempted=preempted,
            lost=lost,
        )
        if isinstance(reply, AlreadyFinal):
            await self._usage.after_final(session_id, generation_id)
        if isinstance(reply, NotStarted) and reply.takeovers and reply.from_worker == worker:
            # This very TAKEOVER, run again: the client sends a command again when the
            # connection drops before its reply. The first run took it from ``worker``;
            # answered "queued", a worker stopping its own reply would drop it and queue
            # nothing, the reply left queued for ever (chaos soak, cluster, seed 3).
            return TakenOver(reply.takeovers, reply.from_worker)
        return reply

    async def keep_continuation(self, queue: RequestQueue, request: GenerationRequest) -> None:
        """Keep the request that continues a reply taken over (``request``, at its new
        epoch, for ``queue``) beside its generation, in its ``continuation`` and ``queue``
        fields: should Redis lose it from the queue (a Cluster failover drops what the
        queue's primary acknowledged, while the generation, on another slot, stays
        ``queued``), a reader's gateway queues it again from there
        (gateway/recovery/stranded.py). A takeover is rare: one more write then costs
        nothing on the way of a request."""
        key = self.keys.generation(request.session_id, request.generation_id)
        await self.redis.hset(key, mapping={CONTINUATION: encode(request), "queue": queue.model})

    async def go_on_from_events(
        self,
        queue: RequestQueue,
        request: GenerationRequest,
        taken: TakenOver | NotStarted | CancelAsked | Exhausted,
        queue_it: Callable[[GenerationRequest], Awaitable[None]],
        *,
        max_takeovers: int,
    ) -> tuple[GoneOn, Streamed | None]:
        """After TAKEOVER took a reply whose writer cannot say what it streamed (a lost
        worker; a worker whose own hand-over Redis lost), it goes on from what its events
        hold: ``continuation`` kept beside it and queued by ``queue_it``; or it ends,
        ``cancelled`` (a cancel was asked) or ``worker_lost`` (taken over too often, or its
        events trimmed), billed what it streamed. From the TAKEOVER on nobody writes its
        events, so that read is exact."""
        sid, gid = request.session_id, request.generation_id
        streamed = await streamed_so_far(self.redis, self.keys, sid, gid)
        if isinstance(taken, CancelAsked):
            usage = streamed.usage() if streamed is not None else Usage(0, 0)
            await self.end(request, Cancelled(gid, taken.reason, usage))
            return "cancelled", streamed
        if isinstance(taken, Exhausted) or streamed is None:
            why = (
                f"it was taken over {max_takeovers} times already"
                if isinstance(taken, Exhausted)
                else "its events were trimmed, so it cannot be continued"
            )
            message = f"the engine worker running this generation stopped ({why})"
            billed = streamed.usage() if streamed is not None else None
            await self.end(request, Error(gid, "worker_lost", message, billed))
            return "worker_lost", streamed
        resumed = continuation(request, taken, streamed)
        key = self.keys.generation(sid, gid)
        await self.redis.hset(key, "usage", encode(streamed.usage()))
        await self.keep_continuation(queue, resumed)
        await queue_it(resumed)
        return "taken_over", streamed

    # --- ends (the gateways' recovery) -------------------------------------------------------

    async def end(self, request: GenerationRequest, event: FinalEvent) -> str | None:
        """Write ``event``, ending a generation whatever its state (no writer checked):
        its entry id, or None when it had ended."""
        written = await self._emit(
            session_id=request.session_id,
            event=event,
            maxlen=self.events_maxlen,
            ttl_s=self.ttl_s,
            final=True,
        )
        await self._usage.after_final(request.session_id, request.generation_id)
        return written

    async def end_queued(self, ends: Sequence[tuple[str, FinalEvent]]) -> list[bool]:
        """End the generations no worker has started (``ends``: session id, final event),
        in one round trip; whether each one ended here (not: it started or ended
        meanwhile). A worker that takes its request later finds it final and skips it."""
        if not ends:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id, event in ends:
                await self._end_queued(
                    session_id=session_id,
                    event=event,
                    maxlen=self.events_maxlen,
                    ttl_s=self.ttl_s,
                    pipe=pipe,
                )
            try:
                replies: list[object] = await pipe.execute()
            except ResponseError as exc:  # lost_scripts: a shard new since (a failover)
                if lost_scripts(exc):  # the next try sends it
                    await self._end_queued.load()
                raise
        ended = [EndQueued.reply(reply) is not None for reply in replies]
        await self._counted(
            [
                (sid, event.generation_id)
                for (sid, event), done in zip(ends, ended, strict=True)
                if done
            ]
        )
        return ended

    async def placed(self, session_id: str, generation_id: str) -> tuple[str, int] | None:
        """The worker a generation runs on ("" while it does not run) and its epoch (its
        takeovers), as its hash says (None: gone)."""
        key = self.keys.generation(session_id, generation_id)
        state, worker, takeovers = await self.redis.hmget(key, ("state", "worker", "takeovers"))
        if state is None:
            return None
        running = state == b"running" and worker
        return text(worker) if running else "", int(takeovers or 0)

    async def standing(self, session_id: str, generation_id: str) -> str:
        """Where a generation stands, as its hash says (state, owner, epoch, a cancel asked,
        ended): what a writer whose event was refused logs. "gone" when Redis holds no
        such generation."""
        fields = ("state", "worker", "takeovers", "cancel", "final_id")
        values = await self.redis.hmget(self.keys.generation(session_id, generation_id), fields)
        if values[0] is None:
            return "gone"
        return " ".join(
            f"{field}={text(value)}"
            for field, value in zip(fields, values, strict=True)
            if value  # none, or emptied (a takeover's worker)
        )

    async def count_usage(self, session_id: str, generation_id: str) -> bool:
        """Count an ended generation's usage where no writer did (its writer was lost
        before the count after its final event); False when counted before, or counted by
        the script that wrote it (one Redis)."""
        return await self._usage.after_final(session_id, generation_id)

    async def _counted(self, ended: Sequence[tuple[str, str]]) -> None:
        if not self.topology.counts_in_script:
            await asyncio.gather(*(self._usage.after_final(sid, gid) for sid, gid in ended))
