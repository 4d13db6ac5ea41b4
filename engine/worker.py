"""The engine worker: Redis in, backend in the middle, Redis out.

- its job table (engine/jobs.py) takes requests from its model's queue
  (``wire.queue.RequestQueue``), never more than the backend's capacity, holds every job and
  makes every move of one: its claim, its end (acknowledging its request), its cancel, its
  hand-over or preemption; the worker runs each job's engine stream (``run_job``);
- publishes events through ``Publisher`` (one script call per engine step);
- reads the ``cancels`` stream (engine/cancels.py): the ``cancelled`` event is written at
  once (no token of that generation reaches a client after it), then the engine aborts;
- aborts generations nobody has read for the grace period (``abandoned``);
- heartbeats over its lease connection, so gateways know it is alive (``/ready``), what
  model it serves, and at once when it dies (engine/lease.py);
- continues replies taken over from a lost worker (``GenerationRequest.resume``: its first
  event is ``resumed``, then tokens numbered on from the streamed ones), and on SIGTERM
  hands its own running replies over to the other workers at once.

A worker serves one model: it reads that model's queue only (``Keys.requests(model)``), so
a slow model never holds up another, and registers the model's names (``Keys.models``).

A burst: one read of the queue can bring a thousand requests, and a request's prepare (the
chat template and tokenizer, vLLM's ``prepare``) is CPU on the worker's event loop. Started
all at once, every job would prepare in the same turn of the loop, so no claim, engine step
or first token would go out until the last request was prepared (1,024 requests at 0.25 ms
each: a quarter of a second of the loop's time, several times that on a shared core). So
requests prepare one per turn of the loop, in the order taken (``PrepareTurns``): what the
others need (the claims and first tokens of the requests prepared so far, the engine's
steps) goes out in between, as vLLM's own server admits a burst.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import time
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from redis.exceptions import RedisError

import wire
from engine.backends.base import Backend, BackendError, Prepared
from engine.cancels import cancel_signals
from engine.job import Job
from engine.jobs import JobTable
from engine.lease import HEARTBEAT_S, Lease
from engine.metrics import WorkerMetrics
from engine.policies import (
    AFFINITY_WAIT_MS,
    CacheAffinity,
    FairPreemption,
    QueueOrder,
    TakePolicy,
)
from engine.publisher import Publisher
from engine.tools import ToolCallWriter
from engine.tracing import WorkerTracing, exemplar
from wire import Done, Error, FinalEvent, Keys, Started, Token, WorkerInfo
from wire.connect import when_redis_answers
from wire.generations import Generations
from wire.queue import RequestQueue, ServedTokens

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

log = logging.getLogger("tokenspout.worker")

ABANDON_CHECK_S = 1.0


PREPARE_TURN_S = 0.001
"""About how much prepare CPU one turn of the event loop takes (``PrepareTurns``)."""


class PrepareTurns:
    """Requests prepare in the order they asked, about ``PREPARE_TURN_S`` of it per turn of
    the event loop: a burst's first claims, steps and tokens go out while the rest prepare
    (a chat template and a tokenizer are CPU on this loop), and cheap prepares go many to a
    turn, so their claims share the publisher's write as they were taken together."""

    WEIGHT = 0.1
    """Of the latest prepare in the moving mean."""

    def __init__(self, turn_s: float = PREPARE_TURN_S) -> None:
        self.turn_s = turn_s
        self.mean_s = 0.0
        """A prepare's time, a moving mean (0: none measured yet: one per turn)."""
        self._given = 0
        """Prepares given this turn of the loop."""
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def per_turn(self) -> int:
        return max(1, int(self.turn_s / self.mean_s)) if self.mean_s > 0 else 1

    async def take(self) -> None:
        """Until this request may prepare (at once while this turn has room and none waits)."""
        if self._waiting or self._given >= self.per_turn:
            turn = asyncio.get_running_loop().create_future()
            self._waiting.append(turn)
            await turn  # given by ``_next``
        else:
            self._give()

    def prepared(self, seconds: float) -> None:
        """A prepare took ``seconds``."""
        mean = self.mean_s
        self.mean_s = seconds if mean == 0 else mean + self.WEIGHT * (seconds - mean)

    def _give(self) -> None:
        if self._given == 0:
            asyncio.get_running_loop().call_soon(self._next)
        self._given += 1

    def _next(self) -> None:
        """The loop has turned: the next waiting requests' turn (one whose task was
        cancelled meanwhile is skipped)."""
        self._given = 0
        while self._waiting and self._given < self.per_turn:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                self._give()


class Worker:
    def __init__(
        self,
        redis: aioredis.Redis,
        backend: Backend,
        *,
        keys: Keys | None = None,
        worker_id: str | None = None,
        metrics: WorkerMetrics | None = None,
        aliases: list[str] | None = None,
        max_takeovers: int = 3,
        join_tokens: bool = False,
        preempt: bool = False,
        tracer: Tracer | None = None,
        affinity_wait_ms: int = AFFINITY_WAIT_MS,
    ) -> None:
        self.redis, self.backend = redis, backend
        self.keys = keys or Keys()
        self.aliases = [name for name in aliases or [] if name != backend.model]
        for name in [backend.model, *self.aliases]:
            wire.check_model_name(name)
        self.queue = RequestQueue(redis, self.keys, backend.model, offers_free=not preempt)
        """This worker's model's queue: it never sees another model's requests."""
        self.served = ServedTokens()
        """Tokens served per tenant, told to the queue (its fair share: docs/tenants.md)."""
        self.requests_key = self.queue.key
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = metrics or WorkerMetrics()
        self.lease = Lease(redis, self.keys, self.worker_id, backend.model)
        self.publisher = Publisher(
            Generations(redis, self.keys),
            queue=self.queue,
            writer=self.worker_id,
            on_rejected=lambda gid, epoch: self.jobs.rejected(gid, epoch),
            join_tokens=join_tokens,
        )
        self.placement = self._take_policy(affinity_wait_ms)
        """Which queued requests this worker takes (told each run's prefill)."""
        self.tracing = WorkerTracing.of(tracer, self.worker_id, backend)  # None: tracing off
        self.jobs = JobTable(
            publisher=self.publisher,
            queue=self.queue,
            backend=backend,
            lease=self.lease,
            metrics=self.metrics,
            worker_id=self.worker_id,
            max_takeovers=max_takeovers,
            run=self.run_job,
            tracing=self.tracing,
            before_taking=self.announce_if_silent,
            take=self.placement,
            preempt=FairPreemption(self.queue, self.worker_id) if preempt else None,
        )
        """Every job this worker holds, and every move of one (engine/jobs.py)."""
        self.turns = PrepareTurns()
        self.engine_failed = asyncio.Event()
        """Set when the engine died under a run: the worker drains and stops."""
        self._started_at = time.time()
        self.metrics.generations_running.set_function(lambda: len(self.jobs))
        self.metrics.capacity.set_function(lambda: self.backend.capacity)

    def _take_policy(self, affinity_wait_ms: int) -> TakePolicy:
        """The queue's order, this worker's cached prefixes first unless the wait is 0."""
        if affinity_wait_ms <= 0:
            return QueueOrder(self.queue, self.worker_id, self.served)
        return CacheAffinity(
            self.queue, self.worker_id, self.served, wait_ms=affinity_wait_ms, metrics=self.metrics
        )

    # --- lifecycle -----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, drain_s: float = 30.0) -> None:
        """Serve until ``stop`` is set, then drain: finish what runs (up to ``drain_s``)."""
        joining = asyncio.create_task(when_redis_answers(self._join, f"worker {self.worker_id}"))
        stopped_first = asyncio.create_task(stop.wait())
        await asyncio.wait([joining, stopped_first], return_when=asyncio.FIRST_COMPLETED)
        stopped_first.cancel()
        if not joining.done():  # stopped while waiting for Redis: nothing to drain
            joining.cancel()
            return
        joining.result()
        loops = [
            asyncio.create_task(self.publisher.run_forever(), name="publisher"),
            asyncio.create_task(self.jobs.take_forever(), name="consume"),
            asyncio.create_task(self._cancels_forever(), name="cancels"),
            asyncio.create_task(self._heartbeat_forever(), name="heartbeat"),
            asyncio.create_task(self._abandon_forever(), name="abandon"),
        ]
        if self.jobs.preempt is not None:
            loops.append(asyncio.create_task(self.jobs.preempt_forever(), name="preempt"))
        log.info(
            "worker %s ready: backend=%s model=%s aliases=%s",
            self.worker_id,
            self.backend.name,
            self.backend.model,
            ",".join(self.aliases) or "-",
        )
        stopping = asyncio.create_task(stop.wait(), name="stop")
        failing = asyncio.create_task(self.engine_failed.wait(), name="engine failed")
        try:
            done, _ = await asyncio.wait(
                [stopping, failing, *loops], return_when=asyncio.FIRST_COMPLETED
            )
            for task in done - {stopping, failing}:
                # A loop that ends on its own is a bug: fail loudly rather than idle on.
                raise RuntimeError(f"worker loop {task.get_name()} ended") from task.exception()
            if failing in done:
                log.error("the engine failed: its replies go to the other workers; stopping")
            await self.drain(drain_s)
        finally:
            stopping.cancel()
            failing.cancel()
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            with contextlib.suppress(RedisError, OSError):
                await self.lease.release()

    async def drain(self, timeout_s: float) -> None:
        """Take no new work; hand running generations over to the other workers at once
        (while one serves); let the rest finish up to ``timeout_s``, then cancel them."""
        self.jobs.stop_accepting()
        with contextlib.suppress(RedisError, OSError):  # else pending: the reaper's, later
            await self.jobs.give_back_kept()
        self.metrics.draining.set(1)
        log.info("draining", extra={"running": len(self.jobs), "drain_s": timeout_s})
        with contextlib.suppress(RedisError, OSError):
            await self._heartbeat_once()  # tell the others this one takes nothing now
        deadline = time.monotonic() + timeout_s
        while self.jobs and time.monotonic() < deadline:
            await self.jobs.hand_over_running()
            await asyncio.sleep(0.02)
        for job in self.jobs.jobs():
            await self.jobs.cancel(job.generation_id, "shutdown")
        while self.jobs.busy:
            await asyncio.sleep(0.02)

    # --- one job's engine stream ---------------------------------------------------------

    async def run_job(self, job: Job) -> None:
        """Run one job the table started to its end, then hand it back to the table with
        its final event, or with what failed it (``JobTable.run_over``)."""
        end: FinalEvent | None = None
        failure: Exception | None = None
        try:
            resume = job.request.resume
            if resume is not None and resume.from_worker == self.worker_id:
                await self._alive_before_going_on(job)
            await self.turns.take()
            end = await self._run(job)
        except BackendError as exc:
            end = Error(job.generation_id, exc.code, exc.message, job.usage())
        except Exception as exc:
            failure = exc
            if self.backend.failed:  # this worker stops; the reply goes on elsewhere
                self.engine_failed.set()
        finally:
            await self.jobs.run_over(job, end, failure, engine_lost=self.backend.failed)

    async def _run(self, job: Job) -> FinalEvent | None:
        """The job's run in the engine: its final event (None: it has none of its own to
        write, it was stopped or dropped). ``/tokenize`` and ``/detokenize`` run here too:
        the model's tokenizer lives here, with vLLM, so they go the way a generation goes
        and come back as its events (a ``BackendError``: the caller's ``error`` event)."""
        request, gid, model = job.request, job.generation_id, self.backend.model
        if request.task == "generate":
            prepared = await self._prepare(job)
            if request.resume is None:
                job.prompt_tokens = len(prepared.prompt_token_ids)
                # Its queue charged an estimate when it left the tenant's list; a
                # continuation's prompt was served (and charged) by its first run.
                self.served.add(request.tenant, job.prompt_tokens - job.estimated_tokens)
            # The engine starts while the claim is on its way, so the first token does not
            # wait for the claim's round trip (it even shares its write when the engine is
            # that quick).
            self.jobs.claim(job)
            if job.stopped:
                return None
            return await self._stream(job, prepared)
        if request.task == "tokenize":
            ids = (await self.backend.prepare(request)).prompt_token_ids
            job.prompt_tokens = len(ids)
            claim, text = Started(gid, model, len(ids), list(ids)), None
        else:
            text = self.backend.detokenize(request.token_ids)
            job.prompt_tokens = len(request.token_ids)
            claim = Started(gid, model, job.prompt_tokens)
        if await self.jobs.claim(job, claim) is None:
            return None  # dropped (nothing runs in the engine: no abort)
        if text is not None:
            job.events = self.publisher.emit(job.target, Token(gid, text, 0), job.events + 1)
        return Done(gid, "tokenized" if request.task == "tokenize" else "detokenized", job.usage())

    async def _prepare(self, job: Job) -> Prepared:
        """The engine's input for ``job`` (the chat template, the tokenizer), timed."""
        began = time.monotonic()
        prepared = await self.backend.prepare(job.request)
        job.prepare_s = time.monotonic() - began
        self.turns.prepared(job.prepare_s)
        if self.tracing is not None:  # its span, and the trace vLLM's spans join
            return self.tracing.prepared(prepared, job.request, job.trace, job.prepare_s)
        return prepared

    async def _stream(self, job: Job, prepared: Prepared) -> Done | None:
        """The engine's outputs, emitted; its ``done`` event when it ends (None: it was
        stopped)."""
        gid = job.generation_id
        job.tool_calls = self._tool_call_writer(job)
        first, engine_began = True, time.monotonic()
        end: Done | None = None
        deltas = job.own_outputs(self.backend.generate(prepared))
        async for delta in deltas:
            if end is not None:  # its last output was read: the run only ends now
                continue
            if job.stopped:
                # Cancelled: the final event is out; what the engine made since is waste.
                # Closing the run stops it even where the abort found nothing to stop:
                # vLLM takes a request in an await of its own, and an abort (a refused
                # claim's, or a cancel's) can come first.
                self.metrics.tokens_after_cancel.inc(len(delta.token_ids))
                await deltas.aclose()
                return None
            if delta.cached_tokens is not None:  # the first output after its prefill
                computed = len(prepared.prompt_token_ids) - delta.cached_tokens
                self.placement.prefilled(computed, time.monotonic() - engine_began)
            content, calls, reason = job.step(delta)
            if delta.text or delta.token_ids or content or calls:
                job.streamed(delta.text, delta.token_ids)
                self.served.add(job.request.tenant, len(delta.token_ids))
                if first:  # its prefill is over: a reply's time to first token
                    first, first_token_s = False, job.first_token_out()
                    if first_token_s is not None:
                        engine_s = job.prepare_s + time.monotonic() - engine_began
                        model, tenant = self.backend.model, job.request.tenant
                        trace_id = exemplar(job.trace)
                        self.metrics.first_token(first_token_s, engine_s, model, tenant, trace_id)
                token = Token(
                    gid,
                    delta.text,
                    job.emitted_tokens,
                    delta.token_ids,
                    delta.logprobs,
                    delta.tokens,
                    delta.top_logprobs,
                    content,
                    calls,
                )
                seq = self.publisher.emit(job.target, token, job.events + 1)
                if seq == job.events:  # joined the token before: Redis is behind
                    self.metrics.tokens_joined.inc(len(delta.token_ids))
                job.events = seq
                self.metrics.tokens.inc(len(delta.token_ids))
            if delta.finish_reason == "abort":
                job.stop("shutdown")  # unless a cancel stopped it first
                return None
            if reason is not None:
                # The run ends by itself right after its last output: leaving the loop
                # here would leave it to the loop's finalizer (a task and a wake-up each).
                end = Done(gid, reason, job.usage())
        return end

    def _tool_call_writer(self, job: Job) -> ToolCallWriter | None:
        tools = job.request.tools
        if tools is None or tools.choice == "none":
            return None
        parser = self.backend.auto_parser(tools) if tools.choice == "auto" else None
        written = job.request.resume.text if job.request.resume is not None else ""
        return ToolCallWriter(tools, job.generation_id, parser, written)

    # --- cancel and abandonment ---------------------------------------------------------------

    async def _cancels_forever(self) -> None:
        async for signal in cancel_signals(self.redis, self.keys, self.metrics):
            await self.jobs.cancel(signal.generation_id, signal.reason)

    async def _abandon_forever(self) -> None:
        while True:
            await asyncio.sleep(ABANDON_CHECK_S)
            # Only claimed ones: before its claim a generation may not be in Redis yet (a
            # request queued twice after a Redis restart, its first copy taken before the
            # submit script ran), so no reader could have marked it watched.
            jobs = [job for job in self.jobs.jobs() if job.abandonable]
            if not jobs:
                continue
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for job in jobs:
                        sid = job.session_id  # a reader, or a background response
                        pipe.exists(self.keys.watch(sid), self.keys.keep(sid))
                    watched = await pipe.execute()
            except (RedisError, OSError) as exc:
                log.warning("checking readers failed (%s)", exc)
                self.metrics.redis_errors.labels("abandon").inc()
                continue
            for job, is_watched in zip(jobs, watched, strict=True):
                if not is_watched:
                    log.info("aborting %s: nobody is reading it", job.generation_id)
                    await self.jobs.cancel(job.generation_id, "abandoned")

    # --- heartbeat -----------------------------------------------------------------------

    async def announce_if_silent(self) -> None:
        """Heartbeat until the last one Redis took is at most two beats old (this process
        was stopped, Redis away, or its writes held up) before taking work. The gateways'
        reaper takes a silent worker's pending requests away; work it took before the
        others saw it alive again would be taken away as soon as taken, over and over: a
        worker resumed after a SIGSTOP past the worker timeout, or whose heartbeat a write
        pause held up (it lands with its old score), would burn a reply's takeovers in
        under a second. So would a worker whose lease connection was cut (the others see
        its lease gone at once) until its next heartbeat: a failed heartbeat, or work taken
        over from this worker, makes takes wait for one that goes through."""
        while self.lease.silent_for() > 2 * HEARTBEAT_S or self.lease.doubted:
            await self._heartbeat_once()

    async def _alive_before_going_on(self, job: Job) -> None:
        """``job`` was taken over from this very worker: the others took it for lost. It
        says it is alive (a heartbeat, a fresh lease) before going on, or they take this
        run away as well, and each one after it, until the reply's takeovers are spent."""
        self.lease.doubt()
        while not job.stopped:
            try:
                await self.announce_if_silent()
                return
            except (RedisError, OSError) as exc:
                log.warning("heartbeat before %s failed (%s)", job.generation_id, exc)
                self.metrics.redis_errors.labels("heartbeat").inc()
                await asyncio.sleep(HEARTBEAT_S / 4)

    async def _heartbeat_forever(self) -> None:
        away = False
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._heartbeat_once()
                if away or self.lease.reconnected:  # it may have lost what was written
                    self.jobs.ends.restate_soon()
                away = False
                await self.jobs.retry_acks()
                await self.queue.charge(self.served)
            except (RedisError, OSError) as exc:
                away = True
                log.warning("heartbeat failed (%s)", exc)
                self.metrics.redis_errors.labels("heartbeat").inc()

    async def _join(self) -> None:
        """The consumer group exists and the others see this worker."""
        await self.queue.ensure_group()
        await self._heartbeat_once()

    async def _heartbeat_once(self) -> None:
        info = WorkerInfo(
            worker_id=self.worker_id,
            backend=self.backend.name,
            model=self.backend.model,
            capacity=self.backend.capacity,
            running=self.backend.running(),
            started_at=self._started_at,
            aliases=self.aliases,
            max_model_len=self.backend.max_model_len,
            draining=not self.jobs.accepting,
        )
        self.metrics.engine_running.set(self.backend.running())
        await self.lease.heartbeat(info)
