"""The engine worker: Redis in, backend in the middle, Redis out.

- takes requests from its model's queue (``wire.queue.RequestQueue``), never more than
  the backend's capacity; acknowledges each when its generation has ended (a dead worker's
  unacknowledged requests are taken over by the gateway's reaper);
- publishes events through ``Publisher`` (one script call per engine step);
- reads the ``cancels`` stream (engine/cancels.py): the ``cancelled`` event is written at
  once (no token of that generation reaches a client after it), then the engine aborts;
- aborts generations nobody has read for the grace period (``abandoned``);
- heartbeats over its lease connection, so gateways know it is alive (``/ready``), what
  model it serves, and at once when it dies (engine/lease.py);
- continues replies taken over from a lost worker (``GenerationRequest.resume``: its first
  event is ``resumed``, then tokens numbered on from the streamed ones), and on SIGTERM
  hands its own running replies over to the other workers at once (engine/handover.py).

What it takes from the queue, and the tasks that run it, are the intake's
(engine/intake.py); this module runs one generation and the loops around it.

A worker serves one model: it reads that model's queue only (``Keys.requests(model)``), so
a slow model never holds up another, and registers the model's names (``Keys.models``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from redis.exceptions import RedisError

import wire
from engine.backends.base import Backend, BackendError, Delta, Prepared
from engine.cancels import cancel_signals
from engine.handover import HandOver
from engine.intake import Intake
from engine.job import Job, JobState
from engine.lease import HEARTBEAT_S, Lease
from engine.metrics import WorkerMetrics
from engine.preempt import Preemptor
from engine.publisher import Publisher
from engine.tools import ToolCallWriter
from engine.tracing import WorkerTracing, exemplar, follow
from wire import (
    Cancelled,
    CancelReason,
    ChatMessage,
    Done,
    Error,
    Keys,
    Resumed,
    Started,
    Token,
    WorkerInfo,
)
from wire.connect import when_redis_answers
from wire.queue import RequestQueue, ServedTokens
from wire.scripts import Takeover
from wire.tracing import trace_id_of

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

log = logging.getLogger("tokenspout.worker")

ABANDON_CHECK_S = 1.0


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
    ) -> None:
        self.redis, self.backend = redis, backend
        self.keys = keys or Keys()
        self.aliases = [name for name in aliases or [] if name != backend.model]
        for name in [backend.model, *self.aliases]:
            wire.check_model_name(name)
        self.queue = RequestQueue(redis, self.keys, backend.model)
        """This worker's model's queue: it never sees another model's requests."""
        self.served = ServedTokens()
        """Tokens served per tenant, told to the queue (its fair share: docs/tenants.md)."""
        self.requests_key = self.queue.key
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = metrics or WorkerMetrics()
        self.lease = Lease(redis, self.keys, self.worker_id, backend.model)
        self.publisher = Publisher(
            redis,
            self.keys,
            queue=self.queue,
            writer=self.worker_id,
            on_rejected=self._on_rejected,
            join_tokens=join_tokens,
        )
        self.intake = Intake(
            queue=self.queue,
            publisher=self.publisher,
            backend=backend,
            metrics=self.metrics,
            worker_id=self.worker_id,
            run_job=self.run_job,
            before_taking=self.announce_if_silent,
            served=self.served,
        )
        self.jobs = self.intake.jobs  # the generations running here (the intake's), by id
        self.handover = HandOver(
            takeover=Takeover(redis, self.keys),
            lease=self.lease,
            publisher=self.publisher,
            queue=self.queue,
            backend=backend,
            metrics=self.metrics,
            worker_id=self.worker_id,
            max_takeovers=max_takeovers,
        )
        self.preemptor = Preemptor(self.intake, self.handover) if preempt else None
        self.tracing = WorkerTracing.of(tracer, self.worker_id, backend)  # None: tracing off
        self._started_at = time.time()
        self._export_gauges()

    def _export_gauges(self) -> None:
        self.metrics.generations_running.set_function(lambda: len(self.jobs))
        self.metrics.capacity.set_function(lambda: self.backend.capacity)

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
            asyncio.create_task(self.intake.consume_forever(), name="consume"),
            asyncio.create_task(self._cancels_forever(), name="cancels"),
            asyncio.create_task(self._heartbeat_forever(), name="heartbeat"),
            asyncio.create_task(self._abandon_forever(), name="abandon"),
        ]
        if self.preemptor is not None:
            loops.append(asyncio.create_task(self.preemptor.run_forever(), name="preempt"))
        log.info(
            "worker %s ready: backend=%s model=%s aliases=%s",
            self.worker_id,
            self.backend.name,
            self.backend.model,
            ",".join(self.aliases) or "-",
        )
        stopping = asyncio.create_task(stop.wait(), name="stop")
        try:
            done, _ = await asyncio.wait([stopping, *loops], return_when=asyncio.FIRST_COMPLETED)
            for task in done - {stopping}:
                # A loop that ends on its own is a bug: fail loudly rather than idle on.
                raise RuntimeError(f"worker loop {task.get_name()} ended") from task.exception()
            await self.drain(drain_s)
        finally:
            stopping.cancel()
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            with contextlib.suppress(RedisError, OSError):
                await self.lease.release()

    async def drain(self, timeout_s: float) -> None:
        """Take no new work; hand running generations over to the other workers at once
        (while one serves); let the rest finish up to ``timeout_s``, then cancel them."""
        self.intake.stop_accepting()
        with contextlib.suppress(RedisError, OSError):  # else pending: the reaper's, later
            await self.intake.give_back_kept()
        self.metrics.draining.set(1)
        log.info("draining", extra={"running": len(self.jobs), "drain_s": timeout_s})
        with contextlib.suppress(RedisError, OSError):
            await self._heartbeat_once()  # tell the others this one takes nothing now
        deadline = time.monotonic() + timeout_s
        while self.jobs and time.monotonic() < deadline:
            await self.handover.hand_over_running(list(self.jobs.values()))
            await asyncio.sleep(0.02)
        for job in list(self.jobs.values()):
            await self.cancel(job.generation_id, "shutdown")
        while self.intake.busy:
            await asyncio.sleep(0.02)

    # --- one generation ------------------------------------------------------------------

    async def run_job(self, job: Job) -> None:
        """Run one generation the intake took, to its end."""
        gid = job.generation_id
        if job.request.traceparent:  # the gateway traces it: so does this run
            job.trace = follow(job.request, job.started_at, self.tracing)
        try:
            await self.intake.turn_to_prepare()
            if job.request.task != "generate":
                await self._run_tokenizer_task(job)
                return
            try:
                prepared = await self._prepare(job)
            except BackendError as exc:
                await self._finish(job, Error(gid, exc.code, exc.message, job.usage()))
                return
            if job.request.resume is None:
                job.prompt_tokens = len(prepared.prompt_token_ids)
                # Its queue charged an estimate when it left the tenant's list; a
                # continuation's prompt was served (and charged) by its first run.
                self.served.add(job.request.tenant, job.prompt_tokens - job.estimated_tokens)
            job.tool_calls = self._tool_call_writer(job)
            claim = job.claim_event(self.backend.model, self.worker_id)
            # The engine starts while the claim is on its way, so the first token does not
            # wait for the claim's round trip (it even shares its write when the engine is
            # that quick). Redis takes no event of this run unless the claim held (EMIT's
            # owner check); a refused claim stops the run (``_claim_answered``).
            answer = self.emit_waited(job, claim)
            answer.add_done_callback(functools.partial(self._claim_answered, job, claim))
            if not job.stopped:
                await self._stream(job, prepared)
        except BackendError as exc:
            await self._finish(job, Error(gid, exc.code, exc.message, job.usage()))
        except Exception as exc:
            log.exception("generation %s failed", gid)
            await self._finish(
                job, Error(gid, "engine_error", f"{type(exc).__name__}: {exc}", job.usage())
            )
        finally:
            # Only now, the engine's run over, may a second copy run (the same engine
            # request id); one that ended before its claim was answered drops it.
            self.intake.settle_second_copy(job, claimed=job.claim_held is not False)
            if job.state is JobState.STOPPING and job.stop_reason is not None:
                await self._finish(job, Cancelled(gid, job.stop_reason, job.usage()))
            self.intake.finished(job)
            if job.trace is not None:
                job.trace.end(job.state.value)
            if job.state is JobState.HANDOVER_FAILED:
                # Its tokens stopped at the hand-over: the request stays pending, so the
                # reaper takes the reply over once this worker is gone.
                log.warning("%s: its hand-over did not go through; left to the reaper", gid)
            elif job.needs_ack:
                # Dropped: it may have ended by another writer (a queued cancel,
                # ``events_lost``), lost before it counted it: counted again, once.
                await self.intake.count_then_ack(job)

    async def _prepare(self, job: Job) -> Prepared:
        """The engine's input for ``job`` (the chat template, the tokenizer), timed."""
        began = time.monotonic()
        prepared = await self.backend.prepare(job.request)
        job.prepare_s = time.monotonic() - began
        if self.tracing is not None:  # its span, and the trace vLLM's spans join
            return self.tracing.prepared(prepared, job.request, job.trace, job.prepare_s)
        return prepared

    def _claim_answered(
        self, job: Job, claim: Started | Resumed, answer: asyncio.Future[str | None]
    ) -> None:
        if answer.cancelled() or answer.result() is None:
            log.info("skipping %s: it ended, or another worker has it", job.generation_id)
            job.claim_answered(held=False)
            self.intake.stop_run(job)
            return
        job.claim_answered(held=True)
        self.intake.settle_second_copy(job, claimed=True)
        if isinstance(claim, Resumed):
            self.metrics.takeovers.inc()
        request, model = job.request, self.backend.model
        waited_s = time.time() - request.enqueued_at
        self.metrics.started(waited_s, model, request.tenant, exemplar(job.trace))
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

    async def _stream(self, job: Job, prepared: Prepared) -> None:
        gid = job.generation_id
        first, engine_began = True, time.monotonic()
        deltas = self.backend.generate(prepared)
        async for delta in deltas:
            if job.handed_on:
                continue  # another worker makes these tokens
            if job.stopped:
                # Cancelled: the final event is out; what the engine made since is waste.
                # Closing the run stops it even where the abort found nothing to stop:
                # vLLM takes a request in an await of its own, and an abort (a refused
                # claim's, or a cancel's) can come first.
                self.metrics.tokens_after_cancel.inc(len(delta.token_ids))
                await deltas.aclose()
                return
            content, calls = None, None
            if job.tool_calls is not None:
                ending = delta.finish_reason not in (None, "abort")
                content, calls = job.tool_calls.step(delta.text, final=ending)
            if delta.text or delta.token_ids or content or calls:
                job.streamed(delta.text, delta.token_ids)
                self.served.add(job.request.tenant, len(delta.token_ids))
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
                if first:
                    self._first_token(job, job.prepare_s + time.monotonic() - engine_began)
                    first = False
                self.metrics.tokens.inc(len(delta.token_ids))
            if delta.finish_reason is not None:
                if delta.finish_reason == "abort":
                    job.stop("shutdown")  # unless a cancel stopped it first
                    return
                await self._finish(job, Done(gid, self._finish_reason(job, delta), job.usage()))
                return

    def _first_token(self, job: Job, engine_s: float) -> None:
        """A run's first token is out, ``engine_s`` of it the engine's own; a reply's
        first (not a continuation's) is its time to first token."""
        if job.trace is not None:
            job.trace.first_token()
        request = job.request
        if request.resume is not None:
            return
        job.first_token_s = time.time() - request.enqueued_at
        model, trace_id = self.backend.model, exemplar(job.trace)
        self.metrics.first_token(job.first_token_s, engine_s, model, request.tenant, trace_id)

    async def _run_tokenizer_task(self, job: Job) -> None:
        """``/tokenize`` and ``/detokenize``: the model's tokenizer lives here, with vLLM,
        so they go the way a generation goes and come back as its events."""
        request, gid, model = job.request, job.generation_id, self.backend.model
        try:
            if request.task == "tokenize":
                ids = (await self.backend.prepare(request)).prompt_token_ids
                job.prompt_tokens = len(ids)
                claim, text = Started(gid, model, len(ids), list(ids)), None
            else:
                text = self.backend.detokenize(request.token_ids)
                job.prompt_tokens = len(request.token_ids)
                claim = Started(gid, model, job.prompt_tokens)
        except BackendError as exc:
            await self._finish(job, Error(gid, exc.code, exc.message, job.usage()))
            return
        if await self.emit_waited(job, claim) is None:
            job.claim_answered(held=False)
            job.drop()  # nothing runs in the engine: no abort
            return
        job.claim_answered(held=True)
        if text is not None:
            job.events = self.publisher.emit(job.target, Token(gid, text, 0), job.events + 1)
        ended = "tokenized" if request.task == "tokenize" else "detokenized"
        await self._finish(job, Done(gid, ended, job.usage()))

    def _tool_call_writer(self, job: Job) -> ToolCallWriter | None:
        tools = job.request.tools
        if tools is None or tools.choice == "none":
            return None
        parser = self.backend.auto_parser(tools) if tools.choice == "auto" else None
        written = job.request.resume.text if job.request.resume is not None else ""
        return ToolCallWriter(tools, job.generation_id, parser, written)

    @staticmethod
    def _finish_reason(job: Job, delta: Delta) -> str:
        """``tool_calls`` for a reply that made calls, as vLLM's server says it (a named
        function's call ends ``stop``, as OpenAI's does)."""
        writer, reason = job.tool_calls, delta.finish_reason or "stop"
        if writer is not None and writer.made_calls() and writer.tools.choice != "named":
            return "tool_calls"
        return reason

    async def _finish(self, job: Job, event: wire.FinalEvent) -> None:
        if not job.end():
            return
        assistant = None
        if not isinstance(event, Error):
            # A continued reply's message is the one it extends, made longer (the history
            # keeps it in that message's place).
            assistant = ChatMessage("assistant", job.request.continued + "".join(job.text))
        # Its request is acknowledged by this final event's write, or (a cluster) once
        # its usage is counted.
        counts_after = self.publisher.counts_usage_after
        written = await self.emit_waited(
            job,
            event,
            final=True,
            # Only a chat turn's first choice joins the history (a message with n > 1).
            assistant=assistant if job.request.prompt is None and not job.request.choice else None,
            ack=None if counts_after else job.entry_id,
        )
        if counts_after:
            await self.intake.count_then_ack(job)
        state = wire.final_state(event)
        if written is None:  # it ended elsewhere, or is not this worker's: not counted here
            log.info("%s: its %s event was refused", job.generation_id, state)
            return
        self.metrics.generations.labels(state).inc()
        self._bill(job)
        reason = wire.final_reason(event)
        if job.trace is not None:
            job.trace.ended(state, reason, job.prompt_tokens, job.emitted_tokens)
        log.info("generation ended", extra=self._end_line(job, state, reason))

    def _end_line(self, job: Job, state: str, reason: str) -> dict[str, object]:
        """The fields of a generation's one line at its end, for a log store to query."""
        request = job.request
        line: dict[str, object] = {
            "session_id": job.session_id,
            "generation_id": job.generation_id,
            "state": state,
            "reason": reason,
            "tenant": request.tenant or "anonymous",
            "model": self.backend.model,
            "prompt_tokens": job.prompt_tokens,
            "completion_tokens": job.emitted_tokens,
            "duration_ms": round((time.monotonic() - job.started_at) * 1000, 1),
        }
        if job.first_token_s is not None:
            line["ttft_ms"] = round(job.first_token_s * 1000, 1)
        if request.traceparent:  # a cancel's line is written outside the job's task
            line["trace_id"] = trace_id_of(request.traceparent)
        return line

    def _bill(self, job: Job) -> None:
        """The metric of the tokens its final event billed its tenant (usage_core.lua):
        another choice of a request bills no prompt, a tokenizer task nothing."""
        request = job.request
        if request.task == "generate":
            prompt = job.prompt_tokens if request.choice == 0 else 0
            self.metrics.billed(request.tenant, prompt, job.emitted_tokens)

    def emit_waited(
        self,
        job: Job,
        event: wire.SessionEvent,
        *,
        final: bool = False,
        assistant: ChatMessage | None = None,
        ack: bytes | None = None,
    ) -> asyncio.Future[str | None]:
        """Queue an event the caller waits on (a claim, a final event): its stream id, or
        None when Redis refused it. Tokens go straight to ``Publisher.emit``."""
        job.events += 1
        return self.publisher.emit_waited(
            job.target, event, job.events, final=final, assistant=assistant, ack=ack
        )

    # --- cancel --------------------------------------------------------------------------

    async def cancel(self, generation_id: str, reason: CancelReason) -> bool:
        """End a generation this worker runs: final event now, engine abort right after."""
        job = self.jobs.get(generation_id)
        if job is None or not job.stop(reason):
            return False
        if job.trace is not None:
            job.trace.event("cancel", {"tokenspout.reason": reason})
        began = time.monotonic()
        await self._finish(job, Cancelled(generation_id, reason, job.usage()))
        self.metrics.cancel_to_final.observe(time.monotonic() - began)
        await self.backend.abort(job.request.engine_request_id)
        self.metrics.cancels.labels(reason).inc()
        return True

    def _on_rejected(self, generation_id: str, epoch: int) -> None:
        # Redis refused an event: the generation was ended elsewhere (or expired), or taken
        # over by another worker (this one was thought lost). Stop it.
        job = self.jobs.get(generation_id)
        if job is not None and job.epoch == epoch and not job.handed_on:
            self.intake.stop_run(job)

    async def _cancels_forever(self) -> None:
        async for signal in cancel_signals(self.redis, self.keys, self.metrics):
            if signal.generation_id in self.jobs:
                await self.cancel(signal.generation_id, signal.reason)

    async def _abandon_forever(self) -> None:
        while True:
            await asyncio.sleep(ABANDON_CHECK_S)
            # Only claimed ones: before its claim a generation may not be in Redis yet (a
            # request queued twice after a Redis restart, its first copy taken before the
            # submit script ran), so no reader could have marked it watched.
            jobs = [j for j in self.jobs.values() if j.abandonable]
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
                    await self.cancel(job.generation_id, "abandoned")

    # --- heartbeat -----------------------------------------------------------------------

    async def announce_if_silent(self) -> None:
        """Heartbeat until the last one Redis took is at most two beats old (this process
        was stopped, Redis away, or its writes held up) before taking work. The gateways'
        reaper takes a silent worker's pending requests away; work it took before the
        others saw it alive again would be taken away as soon as taken, over and over: a
        worker resumed after a SIGSTOP past the worker timeout, or whose heartbeat a write
        pause held up (it lands with its old score), would burn a reply's takeovers in
        under a second."""
        while self.lease.silent_for() > 2 * HEARTBEAT_S:
            await self._heartbeat_once()

    async def _heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._heartbeat_once()
                await self.intake.retry_acks()
                await self.queue.charge(self.served)
            except (RedisError, OSError) as exc:
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
            draining=not self.intake.accepting,
        )
        self.metrics.engine_running.set(self.backend.running())
        await self.lease.heartbeat(info)
