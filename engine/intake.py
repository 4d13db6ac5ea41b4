"""The worker's intake: which requests run here, and the tasks that run them.

``Intake`` owns what the worker holds of its model's queue: the jobs running now (never
more than the backend's capacity), the tasks that run them or acknowledge requests, the
acknowledgements that failed and are retried with each heartbeat, and a request's second
copy held while the first one's claim is on its way. The worker's loop runs
``consume_forever``; ``Worker.run_job`` runs one generation and hands it back here when it
ends.

A request queued twice (the second copy): the gateway's submit of a stored response (a
session kept past its request) sends the session's SUBMIT script and the queue's XADD in
one pipeline (a one-shot request's script queues its request itself). When Redis has lost its
scripts (a restart), the script fails with NOSCRIPT but the XADD goes in: that first copy
names a generation that does not exist yet, and its claim is refused. The gateway loads
the script and sends both again, so a second copy follows. Dropped as a duplicate while the
first copy's claim is on its way, it would leave the generation never run once that claim
is refused (its stream would wait forever). So the second copy is held until the claim is
answered: dropped if the claim holds, run if it was refused (``settle_second_copy``).

A burst: one read of the queue can bring a thousand requests, and a request's prepare (the
chat template and tokenizer, vLLM's ``prepare``) is CPU on the worker's event loop. Started
all at once, every task would prepare in the same turn of the loop, so no claim, engine step
or first token would go out until the last request was prepared (1,024 requests at 0.25 ms
each: a quarter of a second of the loop's time, several times that on a shared core). So
requests prepare one per turn of the loop, in the order taken (``turn_to_prepare``): what
the others need (the claims and first tokens of the requests prepared so far, the engine's
steps) goes out in between, as vLLM's own server admits a burst.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from redis.exceptions import RedisError, ResponseError

import wire
from engine.backends.base import Backend
from engine.job import Job, epoch_of
from engine.metrics import WorkerMetrics
from engine.publisher import Publisher
from wire import GenerationRequest
from wire.queue import RequestQueue, ServedTokens

log = logging.getLogger("tokenspout.worker")
_request_decoder = msgspec.json.Decoder(GenerationRequest)

RunJob = Callable[[Job], Coroutine[Any, Any, None]]
"""Runs one generation to its end (``Worker.run_job``), then calls ``Intake.finished``."""


class Intake:
    def __init__(
        self,
        *,
        queue: RequestQueue,
        publisher: Publisher,
        backend: Backend,
        metrics: WorkerMetrics,
        worker_id: str,
        run_job: RunJob,
        before_taking: Callable[[], Coroutine[Any, Any, None]],
        served: ServedTokens,
    ) -> None:
        self.queue = queue
        self.publisher = publisher
        self.backend = backend
        self.metrics = metrics
        self.worker_id = worker_id
        self.run_job = run_job
        self.before_taking = before_taking
        """Called before each read of the queue: the worker makes sure the others see it
        alive before it takes work (engine/worker.py, ``announce_if_silent``)."""
        self.served = served
        """The tokens this worker served since it last told its queue (with each take)."""
        self.jobs: dict[str, Job] = {}
        """The generations running here, by id."""
        self.accepting = True
        self.unacked: dict[bytes, tuple[str, str]] = {}
        """Requests (entry id -> their session and generation) whose acknowledgement
        failed; retried with each heartbeat (a request left pending under a live worker
        would count as in flight forever)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._slot_freed = asyncio.Event()
        self._filled = asyncio.Event()
        self._kept: collections.deque[tuple[bytes, GenerationRequest]] = collections.deque()
        self._turn_taken = False
        """A request prepares in this turn of the event loop: the others wait for theirs."""
        self._waiting_turns: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def full(self) -> bool:
        """Every slot runs a generation (or more: a preemption's newcomer, for a moment)."""
        return len(self.jobs) >= self.backend.capacity

    async def until_full(self, timeout_s: float) -> None:
        """Until every slot is busy, or ``timeout_s`` has passed."""
        if self.full:
            return
        self._filled.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._filled.wait(), timeout_s)

    @property
    def busy(self) -> bool:
        """A task of this intake still runs (a generation, an ack, an abort)."""
        return bool(self._tasks)

    def stop_accepting(self) -> None:
        """Take no new request (the worker drains)."""
        self.accepting = False
        self._slot_freed.set()

    def keep(self, entry_id: bytes, request: GenerationRequest) -> None:
        """A reply this worker stopped for another tenant's request (engine/preempt.py),
        its continuation: it goes on here at the next free slot, before anything is taken
        from the queue. Its request stays pending under this worker until then, so if the
        worker is lost the reaper takes it over as it would a running one."""
        self._kept.append((entry_id, request))
        self._slot_freed.set()

    @property
    def kept_tenants(self) -> list[str]:
        """The tenant of each stopped reply kept here."""
        return [request.tenant for _, request in self._kept]

    async def give_back_kept(self) -> None:
        """The drain: the stopped replies still kept go back to the queue for the others."""
        if self._kept:
            kept = [(entry_id, {b"r": wire.encode(request)}) for entry_id, request in self._kept]
            await self.queue.requeue(kept)
            self._kept.clear()

    async def consume_forever(self) -> None:
        while True:
            free = self.backend.capacity - len(self.jobs)
            if free <= 0 or not self.accepting:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            if self._kept:
                await self._start_owed_or_kept()
                continue
            try:
                await self.before_taking()
                entries = await self.queue.take(self.worker_id, free, 1000, self.served)
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("the consumer group is gone (Redis lost its data?); recreating it")
                with contextlib.suppress(RedisError, OSError):
                    await self.queue.ensure_group()
                continue
            except (RedisError, OSError) as exc:
                log.warning("reading requests failed (%s); retrying", exc)
                self.metrics.redis_errors.labels("requests").inc()
                await asyncio.sleep(0.5)
                continue
            if entries and not self.accepting:
                # Read while the drain began (a hand-over may be among them): give them back.
                await self.queue.requeue(entries)
                log.info("gave %d requests back to the queue: draining", len(entries))
                continue
            for entry_id, fields in entries:
                self.take(entry_id, fields)

    async def _start_owed_or_kept(self) -> None:
        """A free slot, and replies stopped for other tenants kept: a waiting tenant served
        far less lately than theirs goes first, by the rule that stopped them
        (wire/lua/fair_preempt.lua); else the oldest continuation, whose prompt was charged
        by its first run."""
        running = [job.request.tenant for job in self.jobs.values()]
        try:
            owed = await self.queue.preempt_for(self.worker_id, self.kept_tenants, running)
        except (RedisError, OSError) as exc:
            log.warning("asking the queue for a tenant owed a slot failed (%s)", exc)
            self.metrics.redis_errors.labels("preempt").inc()
            owed = None
        if owed is None:
            self.start(*self._kept.popleft(), estimated_tokens=0)
        else:
            self.take(*owed[1])

    def take(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        """Start the request read from the queue (or hold it, or drop it as a copy)."""
        try:
            request = _request_decoder.decode(fields[b"r"])
        except (KeyError, msgspec.DecodeError) as exc:
            log.error("dropping an unreadable request %s: %s", entry_id, exc)
            self.spawn(self.ack_or_retry_later(entry_id))
            return
        self.start(entry_id, request, estimated_tokens=int(fields.get(b"e", 0)))

    def start(self, entry_id: bytes, request: GenerationRequest, estimated_tokens: int) -> None:
        """Start ``request`` (its queue entry ``entry_id``), or hold it, or drop it as a
        copy; ``estimated_tokens``: what its queue charged its tenant for its prompt."""
        target = self.publisher.target(
            request.session_id,
            request.generation_id,
            epoch=epoch_of(request),
            ttl_s=request.session_ttl_s,
            maxlen=request.events_maxlen,
        )
        job = Job(request, entry_id, target, estimated_tokens=estimated_tokens)
        running = self.jobs.get(request.generation_id)
        if running is not None and running.epoch >= job.epoch and not running.claim_held:
            running.hold_second_copy(job)  # settled once its claim is answered
            return
        if running is not None and running.epoch >= job.epoch:
            log.info("dropping a second copy of %s", request.generation_id)
            self.spawn(self.ack_or_retry_later(entry_id))
            return
        if running is not None:  # this worker was taken for lost; it continues it
            self.stop_run(running)
        self._run(job)

    def settle_second_copy(self, job: Job, claimed: bool) -> None:
        """``job``'s claim is answered (``claimed``: it holds, or the first copy ended the
        generation otherwise): drop the copy held meanwhile, or run it in ``job``'s place."""
        second = job.take_second_copy()
        if second is None:
            return
        if claimed:
            log.info("dropping a second copy of %s", job.generation_id)
            self.spawn(self.ack_or_retry_later(second.entry_id))
        else:
            log.info("the first copy of %s was refused: running the second", job.generation_id)
            self._run(second)

    async def turn_to_prepare(self) -> None:
        """Until this request may prepare: one request per turn of the event loop, in the
        order they asked (at once when none waits)."""
        if self._turn_taken or self._waiting_turns:
            turn = asyncio.get_running_loop().create_future()
            self._waiting_turns.append(turn)
            await turn  # given by ``_next_turn``, which took the turn for it
        else:
            self._take_turn()

    def _take_turn(self) -> None:
        self._turn_taken = True
        asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        """The loop has turned: the next waiting request's turn (one whose task was
        cancelled meanwhile is skipped)."""
        self._turn_taken = False
        while self._waiting_turns:
            turn = self._waiting_turns.popleft()
            if not turn.done():
                turn.set_result(None)
                self._take_turn()
                return

    def finished(self, job: Job) -> None:
        """``job``'s run is over: its slot is free (unless a continuation replaced it)."""
        if self.jobs.get(job.generation_id) is job:
            del self.jobs[job.generation_id]
        self._slot_freed.set()

    def stop_run(self, job: Job) -> None:
        """Abort a run whose events Redis no longer takes; no final event (not its own)."""
        if job.drop():
            self.spawn(self.backend.abort(job.request.engine_request_id))

    def spawn(self, work: Coroutine[Any, Any, None], name: str | None = None) -> None:
        """Run ``work`` in a task the drain waits for."""
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def ack_or_retry_later(
        self, entry_id: bytes, session_id: str = "", generation_id: str = ""
    ) -> None:
        """Acknowledge a request (of ``generation_id``, counted first where the topology
        needs it: ``Generations.acknowledge``); one that fails is tried again with each
        heartbeat."""
        ended = (entry_id, session_id, generation_id)
        try:
            await self.publisher.generations.acknowledge(self.queue, [ended])
        except (RedisError, OSError) as exc:
            log.warning(
                "acknowledging request %s failed (%s); retrying with the next heartbeat",
                entry_id.decode(),
                exc,
            )
            self.metrics.redis_errors.labels("ack").inc()
            self.unacked[entry_id] = (session_id, generation_id)

    async def acknowledge(self, job: Job) -> None:
        """Acknowledge the request of ``job``, whose run ended with no final event of its
        own (another writer may have ended it: a queued cancel, ``events_lost``)."""
        await self.ack_or_retry_later(job.entry_id, job.session_id, job.generation_id)

    async def retry_acks(self) -> None:
        """The acknowledgements that failed before."""
        if not self.unacked:
            return
        ended = [(entry_id, sid, gid) for entry_id, (sid, gid) in self.unacked.items()]
        await self.publisher.generations.acknowledge(self.queue, ended)
        for entry_id, _, _ in ended:
            del self.unacked[entry_id]
        log.info("acknowledged %d requests on a retry", len(ended))

    def _run(self, job: Job) -> None:
        self.jobs[job.generation_id] = job
        if self.full:
            self._filled.set()
        self.spawn(self.run_job(job), name=job.generation_id)
