"""The worker's job table: every generation this worker holds, and every move of one.

``JobTable`` alone holds the jobs (``engine/job.py``: one request, what it streamed, where
its run stands) and makes their transitions; the worker runs each job's engine stream
(``Worker.run_job``) and asks the table to move it:

- **add**: a request taken from the queue starts a job (never more than the backend's
  capacity), or is held as a second copy, or dropped; ``take_forever`` fills free slots,
  asking its ``TakePolicy`` which requests (engine/policies.py);
- **start**: its claim (``started``, or ``resumed`` for a takeover) goes out while the
  engine starts; Redis refusing it stops the run;
- **finish and acknowledge**: its final event acknowledges its request in the same write
  (``Generations.emit_step``); a run that ends with no final event of its own has its
  request acknowledged (retried with each heartbeat when that fails);
- **keep and continue**: a reply stopped for another tenant keeps its continuation here,
  and it goes on at the next free slot, before anything is taken from the queue, unless a
  tenant served far less waits;
- **stop for hand-over or preemption**: TAKEOVER moves the generation to its next epoch
  (so a reaper that thinks this worker lost cannot hand it on again), and its continuation
  (``wire.handoff``) goes back on the queue (SIGTERM with another worker serving: a
  hand-over, which counts against ``TOKENSPOUT_MAX_TAKEOVERS``) or is kept here (a
  preemption, which never does). Here the worker knows what it streamed, so nothing is
  read back: it stops emitting, waits until its last event is in Redis, and hands on that.
  Whether a reply gives way is the ``PreemptPolicy``'s to say, asked in one place
  (``_owed``).

A request queued twice (the second copy): the gateway's submit of a stored response sends
its session's SUBMIT and the queue's request in one pipeline; after a Redis restart the
script is missing (NOSCRIPT, or no library) but the request goes in, naming a generation
that does not exist yet (its claim is refused), and the gateway sends both again. Dropped
as a duplicate while the first copy's claim is on its way, it would leave the generation
never run once that claim is refused, so the second copy is held until the claim is
answered: dropped if the claim holds, run if it was refused.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import msgspec
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError

import wire
from engine.backends.base import Backend
from engine.ends import RecentEnds
from engine.job import Job, JobState, epoch_of
from engine.lease import Lease
from engine.metrics import WorkerMetrics
from engine.policies import PreemptPolicy, TakePolicy
from engine.publisher import Publisher
from engine.tracing import WorkerTracing, exemplar, follow
from wire import CancelReason, ChatMessage, Error, GenerationRequest, Resumed, Started
from wire.handoff import Streamed, continuation
from wire.keys import tenant_slot
from wire.outcomes import CancelAsked, Exhausted, TakenOver
from wire.queue import RequestQueue
from wire.replies import StreamEntry

log = logging.getLogger("tokenspout.worker")
_request_decoder = msgspec.json.Decoder(GenerationRequest)

RunJob = Callable[[Job], Coroutine[Any, Any, None]]
"""Runs one job's engine stream to its end (``Worker.run_job``), then ``JobTable.run_over``."""
FILL_WAIT_S = 1.0
RETRY_S = 0.5


class JobTable:
    def __init__(
        self,
        *,
        publisher: Publisher,
        queue: RequestQueue,
        backend: Backend,
        lease: Lease,
        metrics: WorkerMetrics,
        worker_id: str,
        max_takeovers: int,
        run: RunJob,
        tracing: WorkerTracing | None = None,
        before_taking: Callable[[], Coroutine[Any, Any, None]],
        take: TakePolicy,
        preempt: PreemptPolicy | None = None,
    ) -> None:
        self.publisher = publisher
        self.generations = publisher.generations
        self.ends = RecentEnds(publisher)
        """Final events written lately: written again after a Redis loss (engine/ends.py)."""
        self.queue = queue
        self.backend = backend
        self.lease = lease
        self.metrics = metrics
        self.worker_id = worker_id
        self.max_takeovers = max_takeovers
        """How often one generation may be handed on (TOKENSPOUT_MAX_TAKEOVERS)."""
        self.run = run
        """Runs a job's engine stream (the worker's)."""
        self.tracing = tracing
        """Each job's trace goes on here (None: tracing is off; engine/tracing.py)."""
        self.before_taking = before_taking
        """Called before each take: the worker makes sure the others see it alive first."""
        self.take = take
        """Which queued requests it takes (engine/policies.py)."""
        self.preempt = preempt
        """Whether a reply gives way to a waiting request (None: never)."""
        self.accepting = True
        self._jobs: dict[str, Job] = {}
        self._kept: collections.deque[tuple[bytes, GenerationRequest]] = collections.deque()
        self.unacked: dict[bytes, tuple[str, str]] = {}
        """Requests (entry id -> session, generation) whose acknowledgement failed: retried
        with each heartbeat (one left pending under a live worker counts as in flight)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._slot_freed = asyncio.Event()
        self._filled = asyncio.Event()

    # --- what it holds ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._jobs)

    def get(self, generation_id: str) -> Job | None:
        return self._jobs.get(generation_id)

    def jobs(self) -> list[Job]:
        return list(self._jobs.values())

    @property
    def full(self) -> bool:
        """Every slot runs a job (or more: a preemption's newcomer, for a moment)."""
        return len(self._jobs) >= self.backend.capacity

    @property
    def busy(self) -> bool:
        """A task of this table still runs (a job, an acknowledgement)."""
        return bool(self._tasks)

    async def until_full(self, timeout_s: float) -> None:
        """Until every slot is busy, or ``timeout_s`` has passed."""
        if self.full:
            return
        self._filled.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._filled.wait(), timeout_s)

    # --- add ------------------------------------------------------------------------------------

    async def take_forever(self) -> None:
        """Fill free slots: the replies kept here first (or a tenant owed a slot more),
        then what the take policy gives."""
        while True:
            free = self.backend.capacity - len(self._jobs)
            if free <= 0 or not self.accepting:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            if self._kept:
                await self._continue_kept()
                continue
            entries = await self._taken(free)
            if entries and not self.accepting:
                # Read while the drain began (a hand-over may be among them): give them back.
                await self.queue.requeue(entries)
                log.info("gave %d requests back to the queue: draining", len(entries))
                continue
            for entry_id, fields in entries:
                self.add(entry_id, fields)

    async def _taken(self, free: int) -> list[StreamEntry]:
        try:
            await self.before_taking()
            return await self.take.take(free)
        except OutOfMemoryError as exc:  # refused at its maxmemory: waited out, as away
            await self._take_failed(exc)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("the consumer group is gone (Redis lost its data?); recreating it")
            with contextlib.suppress(RedisError, OSError):
                await self.queue.ensure_group()
        except (RedisError, OSError) as exc:
            await self._take_failed(exc)
        return []

    async def _take_failed(self, exc: Exception) -> None:
        log.warning("reading requests failed (%s); retrying", exc)
        self.metrics.redis_errors.labels("requests").inc()
        await asyncio.sleep(RETRY_S)

    def add(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        """A request read from the queue: started (or held, or dropped as a copy)."""
        try:
            request = _request_decoder.decode(fields[b"r"])
        except (KeyError, msgspec.DecodeError) as exc:
            log.error("dropping an unreadable request %s: %s", entry_id, exc)
            self._spawn(self._acknowledge(entry_id))
            return
        self._start(entry_id, request, estimated_tokens=int(fields.get(b"e", 0)))

    def _start(self, entry_id: bytes, request: GenerationRequest, estimated_tokens: int) -> None:
        """Start ``request`` (its queue entry ``entry_id``), or hold it, or drop it as a
        copy; ``estimated_tokens``: what its queue charged its tenant for its prompt."""
        target = self.generations.target(
            request.session_id,
            request.generation_id,
            epoch=epoch_of(request),
            ttl_s=request.session_ttl_s,
            maxlen=request.events_maxlen,
        )
        job = Job(request, entry_id, target, estimated_tokens=estimated_tokens)
        running = self._jobs.get(request.generation_id)
        if running is not None and running.epoch >= job.epoch and not running.claim_held:
            running.hold_second_copy(job)  # settled once its claim is answered
            return
        if running is not None and running.epoch >= job.epoch:
            log.info("dropping a second copy of %s", request.generation_id)
            self._spawn(self._acknowledge(entry_id))
            return
        if running is not None:  # this worker was taken for lost; it continues it
            self.drop(running)
        self._run(job)

    def _run(self, job: Job) -> None:
        self._jobs[job.generation_id] = job
        if self.full:
            self._filled.set()
        context = contextvars.copy_context()
        if job.request.traceparent:  # the gateway traces it: so does its run, from its take
            job.trace = context.run(follow, job.request, job.started_at, self.tracing)
        self._spawn(self.run(job), name=job.generation_id, context=context)

    def _settle_second_copy(self, job: Job, claimed: bool) -> None:
        """``job``'s claim is answered (``claimed``: it holds, or the first copy ended the
        generation otherwise): drop the copy held meanwhile, or run it in ``job``'s place."""
        second = job.take_second_copy()
        if second is None:
            return
        if claimed:
            log.info("dropping a second copy of %s", job.generation_id)
            self._spawn(self._acknowledge(second.entry_id))
        else:
            log.info("the first copy of %s was refused: running the second", job.generation_id)
            self._run(second)

    # --- start ------------------------------------------------------------------------------

    def claim(self, job: Job, claim: Started | Resumed | None = None) -> asyncio.Future[str | None]:
        """Send ``job``'s claim (None: ``started``, or ``resumed`` for a takeover); the run
        goes on while it is on its way. Redis takes no event of this run unless the claim
        holds (EMIT's owner check): a refused claim stops the run."""
        if claim is None:
            claim = job.claim_event(self.backend.model, self.worker_id)
        job.events += 1
        answer = self.publisher.emit_waited(job.target, claim, job.events)
        answer.add_done_callback(lambda done: self._claim_answered(job, claim, done))
        return answer

    def _claim_answered(
        self, job: Job, claim: Started | Resumed, answer: asyncio.Future[str | None]
    ) -> None:
        if answer.cancelled() or answer.result() is None:
            log.info("skipping %s: it ended, or another worker has it", job.generation_id)
            job.claim_answered(held=False)
            self.drop(job)
            return
        job.claim_answered(held=True)
        self._settle_second_copy(job, claimed=True)
        if isinstance(claim, Resumed):
            self.metrics.takeovers.inc()
        request = job.request
        if request.task == "generate":
            waited_s = time.time() - request.enqueued_at
            self.metrics.started(waited_s, self.backend.model, request.tenant, exemplar(job.trace))
        if job.trace is not None:
            job.trace.event("claimed")
        log.debug(  # at INFO a generation is one line, at its end
            "generation started",
            extra={
                "session_id": job.session_id,
                "generation_id": job.generation_id,
                "prompt_tokens": job.prompt_tokens,
            },
        )

    # --- finish and acknowledge ----------------------------------------------------------------

    async def run_over(
        self,
        job: Job,
        end: wire.FinalEvent | None,
        failure: Exception | None,
        *,
        engine_lost: bool,
    ) -> None:
        """``job``'s run in the engine is over: its final event ``end`` written (None: it
        has none of its own, it was stopped or dropped), or, its run having raised
        ``failure``, the reply handed on (the engine failed under it: ``engine_lost``) or
        ended with an ``engine_error``; then the job ends (``ended``)."""
        try:
            if failure is not None:
                end = await self._after_failure(job, failure, engine_lost=engine_lost)
            if end is not None:
                await self.finish(job, end)
        except Exception:
            log.exception("generation %s: writing its end failed", job.generation_id)
        finally:
            await self.ended(job)

    async def _after_failure(
        self, job: Job, failure: Exception, *, engine_lost: bool
    ) -> wire.FinalEvent | None:
        """What a run that raised ``failure`` ends with: nothing once it is handed on (to
        another worker while one serves, when the engine failed under it; or to the reaper,
        a hand-over begun that Redis failed left pending), else an ``engine_error``."""
        gid = job.generation_id
        if engine_lost:
            try:
                handed = job.can_hand_over and await self.lease.others_serving()
                if handed and await self._hand_over(job):
                    log.warning(
                        "the engine failed under %s (%s: %s); handed it to another worker",
                        gid,
                        type(failure).__name__,
                        failure,
                    )
            except (RedisError, OSError) as exc:
                log.warning("handing %s over failed (%s)", gid, exc)
        if job.handed_on:
            return None
        log.error("generation %s failed", gid, exc_info=failure)
        return Error(gid, "engine_error", f"{type(failure).__name__}: {failure}", job.usage())

    async def finish(self, job: Job, event: wire.FinalEvent) -> None:
        """Write ``job``'s final event (once), acknowledging its request with it."""
        if not job.end():
            return
        request, assistant = job.request, None
        # Only a chat turn's first choice joins the history (a message with n > 1); a
        # continued reply's message is the one it extends, made longer.
        if not isinstance(event, Error) and request.prompt is None and not request.choice:
            assistant = ChatMessage("assistant", request.continued + "".join(job.text))
        held: Sequence[str] = ()
        if not isinstance(event, Error) and request.task == "generate":
            held = self.take.held(request, "".join(job.text))
        job.events += 1
        written = await self.publisher.emit_waited(
            job.target,
            event,
            job.events,
            final=True,
            assistant=assistant,
            ack=job.entry_id,
            held=held,
        )
        state = wire.final_state(event)
        if written is None:  # it ended elsewhere, or is not this worker's: not counted here
            job.final_refused()
            try:
                standing = await self.generations.standing(job.session_id, job.generation_id)
            except (RedisError, OSError) as exc:
                standing = f"unread: {exc}"
            log.info("%s: its %s event was refused (%s)", job.generation_id, state, standing)
            return
        self.ends.add(job, event, job.events, assistant)
        self.metrics.child(self.metrics.generations, state).inc()
        if request.task == "generate":  # what its final event billed (usage_core.lua)
            prompt = job.prompt_tokens if request.choice == 0 else 0
            self.metrics.billed(request.tenant, prompt, job.emitted_tokens)
        reason = wire.final_reason(event)
        if job.trace is not None:
            job.trace.ended(state, reason, job.prompt_tokens, job.emitted_tokens)
        log.info("generation ended", extra=job.end_line(self.backend.model, state, reason))

    async def ended(self, job: Job) -> None:
        """``job``'s run is over: a second copy held meanwhile settled, a stopped run's
        ``cancelled`` written, its slot freed, and its request acknowledged if nothing
        else did (it may have been ended by another writer: a queued cancel,
        ``events_lost``)."""
        # Only now, the engine's run over, may a second copy run (the same engine
        # request id); one that ended before its claim was answered drops it.
        self._settle_second_copy(job, claimed=job.claim_held is not False)
        if job.state is JobState.STOPPING and job.stop_reason is not None:
            await self.finish(job, wire.Cancelled(job.generation_id, job.stop_reason, job.usage()))
        if self._jobs.get(job.generation_id) is job:
            del self._jobs[job.generation_id]
        self._slot_freed.set()
        if job.trace is not None:
            job.trace.end(job.state.value)
        if job.state is JobState.HANDOVER_FAILED:
            # Its tokens stopped at the hand-over: the request stays pending, so the
            # reaper takes the reply over once this worker is gone.
            log.warning(
                "%s: its hand-over did not go through; left to the reaper", job.generation_id
            )
        elif job.needs_ack:
            if await self._hand_on_if_left_here(job):
                return
            log.info(
                "%s: acknowledging its request with no final event of this run (%s)",
                job.generation_id,
                job.state.value,
            )
            await self._acknowledge(job.entry_id, job.session_id, job.generation_id)

    async def _hand_on_if_left_here(self, job: Job) -> bool:
        """True when ``job``'s request is not this worker's to acknowledge. Redis says its
        generation is past the job's epoch and not here: another took it over (the reaper,
        taking this worker for lost), and its request is the taker's: acknowledged once its
        continuation is queued, or left pending for the next pass to do it again should the
        queueing fail. Redis says it runs here at an epoch before the job's: a crash or
        failover lost a takeover this worker made (a stop for another tenant, a hand-over)
        and the claim after it. No reaper hands on a live worker's reply, so this worker
        does, as the reaper does a lost one's: taken to its next epoch and continued from
        what its events hold, its request requeued (True); or ended (cancelled,
        worker_lost), its request then acknowledged as any dropped one."""
        sid, gid = job.session_id, job.generation_id
        try:
            owner = await self.generations.placed(sid, gid)
            if owner is not None and owner[1] > job.epoch and owner[0] != self.worker_id:
                log.info("%s was taken over past this run: its request is the taker's", gid)
                return True
            if owner is None or owner[0] != self.worker_id or owner[1] >= job.epoch:
                return False
            log.warning(
                "%s runs here at epoch %d in Redis, this run was at %d: Redis lost its "
                "hand-over; handing it on from its events",
                gid,
                owner[1],
                job.epoch,
            )
            taken = await self.generations.take_over(
                sid, gid, worker=self.worker_id, max_takeovers=self.max_takeovers, lost=True
            )
            if not isinstance(taken, TakenOver | CancelAsked | Exhausted):
                return False

            async def requeue(resumed: GenerationRequest) -> None:
                await self.queue.requeue([(job.entry_id, {"r": wire.encode(resumed)})])

            gone_on, _ = await self.generations.go_on_from_events(
                self.queue,
                job.request,
                taken,
                requeue,
                max_takeovers=self.max_takeovers,
            )
        except (RedisError, OSError) as exc:
            log.warning("handing %s on failed (%s); acknowledged as dropped", gid, exc)
            self.metrics.redis_errors.labels("handover").inc()
            return False
        log.info("%s: handed on from its events (%s)", gid, gone_on)
        return gone_on == "taken_over"

    async def _acknowledge(
        self, entry_id: bytes, session_id: str = "", generation_id: str = ""
    ) -> None:
        """Acknowledge a request (``Generations.acknowledge``); one that fails is tried
        again with each heartbeat (``retry_acks``)."""
        try:
            await self.generations.acknowledge(self.queue, [(entry_id, session_id, generation_id)])
        except (RedisError, OSError) as exc:
            log.warning(
                "acknowledging request %s failed (%s); retrying with the next heartbeat",
                entry_id.decode(),
                exc,
            )
            self.metrics.redis_errors.labels("ack").inc()
            self.unacked[entry_id] = (session_id, generation_id)

    async def retry_acks(self) -> None:
        """The acknowledgements that failed before."""
        if not self.unacked:
            return
        ended = [(entry_id, sid, gid) for entry_id, (sid, gid) in self.unacked.items()]
        await self.generations.acknowledge(self.queue, ended)
        for entry_id, _, _ in ended:
            del self.unacked[entry_id]
        log.info("acknowledged %d requests on a retry", len(ended))

    # --- cancel and drop ---------------------------------------------------------------------

    async def cancel(self, generation_id: str, reason: CancelReason) -> bool:
        """End a job: its final event now, the engine's abort right after."""
        job = self._jobs.get(generation_id)
        if job is None or not job.stop(reason):
            return False
        # Counted as decided: the engine's run may end (and its running gauge drop) while
        # the abort below still waits on the engine.
        self.metrics.cancels.labels(reason).inc()
        if job.trace is not None:
            job.trace.event("cancel", {"tokenspout.reason": reason})
        began = time.monotonic()
        await self.finish(job, wire.Cancelled(generation_id, reason, job.usage()))
        self.metrics.cancel_to_final.observe(time.monotonic() - began)
        await self.backend.abort(job.request.engine_request_id)
        return True

    def drop(self, job: Job) -> None:
        """Stop a run whose events Redis no longer takes, aborting it in the engine (a
        tokenizer task has no engine run); no final event (not its own)."""
        if job.drop() and job.request.task == "generate":
            self._spawn(self.backend.abort(job.request.engine_request_id))

    def rejected(self, generation_id: str, epoch: int) -> None:
        """Redis refused an event of ``generation_id`` at ``epoch``: it was ended elsewhere
        (or expired), or taken over by another worker (this one was thought lost)."""
        job = self._jobs.get(generation_id)
        if job is not None and job.epoch == epoch and not job.handed_on:
            self.drop(job)

    # --- keep and continue ------------------------------------------------------------------

    async def _continue_kept(self) -> None:
        """A free slot, and replies stopped for other tenants kept: a waiting tenant served
        far less lately than theirs goes first, by the rule that stopped them; else the
        oldest continuation, whose prompt was charged by its first run."""
        kept_tenants = [request.tenant for _, request in self._kept]
        try:
            owed = await self._owed(kept_tenants, [job.request.tenant for job in self.jobs()])
        except (RedisError, OSError) as exc:
            log.warning("asking the queue for a tenant owed a slot failed (%s)", exc)
            self.metrics.redis_errors.labels("preempt").inc()
            owed = None
        if owed is None:
            self._start(*self._kept.popleft(), estimated_tokens=0)
        else:
            self.add(*owed[1])

    async def _owed(self, yielding: list[str], others: list[str]) -> tuple[str, StreamEntry] | None:
        """Whether a reply of ``yielding`` gives way to a waiting request: the one place the
        preemption policy is asked (none: nobody is ever owed)."""
        if self.preempt is None:
            return None
        return await self.preempt.owed(yielding, others)

    # --- stop for hand-over or preemption -----------------------------------------------------

    async def preempt_forever(self) -> None:
        """While every slot is busy, stop a reply for a waiting tenant owed a slot, each
        time the policy says it is worth asking (``PreemptPolicy.due``)."""
        if self.preempt is None:
            return
        while True:
            try:
                for job in self.jobs() if self.accepting else []:
                    if job.state is JobState.HANDOVER_FAILED:  # its stop raised: again
                        await self._preempt(job)
                if self.full:
                    worth_asking = await self.preempt.due()
                else:
                    # Full again, it looks at once while anyone waits: a ring it took while
                    # a slot was free (and a request that came meanwhile) would wait for
                    # the next recheck.
                    await self.until_full(FILL_WAIT_S)
                    worth_asking = self.preempt.anyone_waits
                if self.full and worth_asking:
                    await self.preempt_once()
            except (RedisError, OSError) as exc:
                log.warning("preempting failed (%s); retrying", exc)
                self.metrics.redis_errors.labels("preempt").inc()
                await asyncio.sleep(RETRY_S)

    async def preempt_once(self) -> bool:
        """Stop one reply for a tenant served less, when the policy says one is due; True
        when a request was taken for it."""
        jobs = self.jobs()
        yielding = [job.request.tenant for job in jobs if job.can_hand_over]
        others = [job.request.tenant for job in jobs if not job.can_hand_over]
        others += [request.tenant for _, request in self._kept]
        found = await self._owed(yielding, others)
        if found is None:
            return False
        stopped_tenant, (entry_id, fields) = found
        self.add(entry_id, fields)  # over capacity until the stopped one leaves
        candidates = [
            job
            for job in self.jobs()
            if job.can_hand_over and tenant_slot(job.request.tenant) == stopped_tenant
        ]
        # Its reply that streamed least: the least to recompute (none: it ended meanwhile).
        victim = min(candidates, key=lambda job: job.emitted_tokens, default=None)
        if victim is not None:
            await self._preempt(victim)
        return True

    async def _preempt(self, job: Job) -> None:
        """Stop ``job``'s run and keep its continuation for this worker's next free slot;
        its request stays pending under this worker meanwhile, so a lost worker's stopped
        replies are taken over as its running ones are."""
        request = await self._stop(job, preempted=True)
        if request is None:
            return
        self._kept.append((job.entry_id, request))
        self._slot_freed.set()
        await self.backend.abort(job.request.engine_request_id)
        self.metrics.preemptions.inc()
        log.info(
            "stopped %s for another tenant's request; it goes on at the next free slot",
            job.generation_id,
            extra={"generation_id": job.generation_id, "tenant": job.request.tenant},
        )

    async def hand_over_running(self) -> None:
        """Hand every started job to the other workers, when one serves (the last worker
        standing keeps them: they drain)."""
        jobs = [job for job in self.jobs() if job.can_hand_over]
        if not jobs:
            return
        try:
            if not await self.lease.others_serving():
                return
        except (RedisError, OSError) as exc:
            log.warning("looking for workers to hand over to failed (%s)", exc)
            return
        failing = {job.generation_id for job in jobs if job.state is JobState.HANDOVER_FAILED}
        results = await asyncio.gather(*map(self._hand_over, jobs), return_exceptions=True)
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

    async def _hand_over(self, job: Job) -> bool:
        """Put ``job`` back on the queue for another worker; True when it was handed on (a
        generation taken over ``max_takeovers`` times already stays here and drains)."""
        request = await self._stop(job)
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

    async def _stop(self, job: Job, *, preempted: bool = False) -> GenerationRequest | None:
        """Take ``job``'s generation to its next epoch and return its continuation (None:
        declined, and it runs on here); the engine's run is the caller's to abort."""
        if not job.begin_hand_over():
            return None
        try:
            await self.publisher.written()  # every event emitted is in Redis, in order
            outcome = await self.generations.take_over(
                job.session_id,
                job.generation_id,
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
            log.info("not handing %s over: %s", job.generation_id, outcome.__struct_config__.tag)
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
        resumed = continuation(job.request, outcome, streamed)
        await self.generations.keep_continuation(self.queue, resumed)
        return resumed

    # --- the drain -----------------------------------------------------------------------------

    def stop_accepting(self) -> None:
        """Take no new request (the worker drains)."""
        self.accepting = False
        self._slot_freed.set()

    async def give_back_kept(self) -> None:
        """The drain: the stopped replies still kept go back to the queue for the others."""
        if self._kept:
            kept = [(entry_id, {b"r": wire.encode(request)}) for entry_id, request in self._kept]
            await self.queue.requeue(kept)
            self._kept.clear()

    def _spawn(
        self,
        work: Coroutine[Any, Any, None],
        name: str | None = None,
        context: contextvars.Context | None = None,
    ) -> asyncio.Task[None]:
        """Run ``work`` in a task the drain waits for (in ``context``: a copy of this one)."""
        task = asyncio.create_task(work, name=name, context=context)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
