"""One generation as a worker runs it: its request, what it has streamed so far, and where
its run stands (``JobState``).

The job table (engine/jobs.py), which alone holds the jobs, asks a job to move on
(``claim_answered``, ``stop``, ``drop``, ``begin_hand_over`` ...) and asks it what it may
do (``can_hand_over``, ``needs_ack`` ...); each move is one method, allowed from the states
it names, so no caller sets a flag the others read.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TypeVar

from engine.backends.base import Delta
from engine.tools import ToolCallWriter
from engine.tracing import JobTrace
from wire import (
    CancelReason,
    GenerationRequest,
    Resumed,
    Started,
    ToolCallDelta,
    Usage,
)
from wire.emit_step import EmitTarget
from wire.tracing import trace_id_of

Output = TypeVar("Output")


def epoch_of(request: GenerationRequest) -> int:
    """The takeover a request carries (0: the first run)."""
    return request.resume.takeover if request.resume is not None else 0


class JobState(enum.Enum):
    """Where a run stands. It starts ``PREPARING`` and ends ``ENDED``, ``HANDED_OVER`` or
    ``DROPPED``; only a ``RUNNING`` or ``PREPARING`` run emits tokens."""

    PREPARING = "preparing"
    """Taken: the engine prepares it while its claim is on its way."""
    RUNNING = "running"
    """Its claim held: its tokens are emitted."""
    HANDING_OVER = "handing over"
    """It moves to another worker (SIGTERM, a stop for another tenant), unless TAKEOVER
    declines: its engine outputs wait for the answer."""
    HANDOVER_FAILED = "hand-over failed"
    """The last hand-over attempt raised (Redis away): the drain tries again; if none goes
    through, the request stays pending for the gateways' reaper (never acknowledged). Its
    engine outputs are kept for a decline to come."""
    HANDED_OVER = "handed over"
    """Another worker goes on with it: its request is back on the queue, this one's
    acknowledged."""
    STOPPING = "stopping"
    """Cancelled, or the engine aborted it (``stop_reason``): its ``cancelled`` event is
    still to write."""
    DROPPED = "dropped"
    """Stopped with no final event of its own (its claim refused, its events refused, or
    a newer run of it took its place): its request is still to acknowledge."""
    ENDED = "ended"
    """Its final event is written (or on its way), acknowledging its request."""


_HANDED_ON = {JobState.HANDING_OVER, JobState.HANDOVER_FAILED, JobState.HANDED_OVER}
"""What the engine still makes is another worker's to make."""
_UNREAD_ABANDONS = {JobState.RUNNING, JobState.HANDING_OVER, JobState.HANDOVER_FAILED}
"""Claimed and not stopped: a run nobody reads is cancelled ``abandoned``."""
_CAN_HAND_OVER = {JobState.RUNNING, JobState.HANDOVER_FAILED}
_FINISHED = {JobState.ENDED, JobState.HANDED_OVER, JobState.DROPPED}
"""No final event of this run is to come from here."""


@dataclass
class Job:
    request: GenerationRequest
    entry_id: bytes
    target: EmitTarget
    """Where its events go (``Publisher.target``, worked out once when the worker takes it)."""
    started_at: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    emitted_tokens: int = 0
    text: list[str] = field(default_factory=list)
    events: int = 0
    """Events emitted so far: each one's number makes its write idempotent (EMIT's seq)."""
    token_ids: list[int] = field(default_factory=list)
    prepare_s: float = 0.0
    """How long the backend took to prepare it (tokenisation, the chat template)."""
    tool_calls: ToolCallWriter | None = None
    """With tools: turns what the model writes into content and calls (engine/tools.py)."""
    estimated_tokens: int = 0
    """What its queue charged its tenant for its prompt before anyone knew its tokens (the
    entry's ``e``, ``wire.queue.estimated_tokens``; 0 for an entry that never waited in a
    tenant's list); the worker charges the difference once it knows."""
    state: JobState = JobState.PREPARING
    claim_held: bool | None = None
    """Its claim's answer: None while it is on its way (or was never sent)."""
    stop_reason: CancelReason | None = None
    second_copy: Job | None = None
    """The same request taken again while this one's claim was on its way (engine/jobs.py)."""
    first_token_s: float | None = None
    """From the gateway's enqueue to its first token here (None: none yet)."""
    trace: JobTrace | None = None
    """Its spans, when its trace is recorded (engine/tracing.py)."""
    _hand_over_decided: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    """Clear while TAKEOVER's answer to a hand-over is awaited."""

    def __post_init__(self) -> None:
        self._hand_over_decided.set()
        resume = self.request.resume
        if resume is not None:  # a takeover: go on from what was streamed
            self.prompt_tokens = resume.prompt_tokens
            self.emitted_tokens = resume.completion_tokens
            self.text.append(resume.text)
            self.token_ids.extend(resume.token_ids)

    @property
    def generation_id(self) -> str:
        return self.request.generation_id

    @property
    def epoch(self) -> int:
        """The takeover its request carries (0: the first run)."""
        return self.target.epoch

    @property
    def session_id(self) -> str:
        return self.request.session_id

    # --- what it may do --------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        """A cancel, an abort or a drop stopped it: what the engine makes is waste."""
        return self.stop_reason is not None

    @property
    def handed_on(self) -> bool:
        """Its hand-over has begun: what the engine makes is not emitted here."""
        return self.state in _HANDED_ON

    @property
    def abandonable(self) -> bool:
        """Claimed and not stopped: cancelled ``abandoned`` once nobody reads it."""
        return self.state in _UNREAD_ABANDONS

    @property
    def can_hand_over(self) -> bool:
        """Claimed and running here (or a hand-over to try again)."""
        return self.state in _CAN_HAND_OVER

    @property
    def needs_ack(self) -> bool:
        """Its run is over and its request not acknowledged by a final event or the queue."""
        return self.state not in (JobState.ENDED, JobState.HANDED_OVER)

    # --- its moves ---------------------------------------------------------------------------

    def claim_answered(self, held: bool) -> None:
        """Redis took its claim (``held``), or refused it (it ended, or another worker has
        it: the caller drops it)."""
        self.claim_held = held
        if held and self.state is JobState.PREPARING:
            self.state = JobState.RUNNING

    def stop(self, reason: CancelReason) -> bool:
        """A cancel (or the engine's abort) stops it: its ``cancelled`` event is to come.
        False when it stopped or finished already."""
        if self.stopped or self.state in _FINISHED:
            return False
        self.stop_reason, self.state = reason, JobState.STOPPING
        return True

    def drop(self) -> bool:
        """Stop it with no final event of its own (not its to write); True when the caller
        must abort its engine run (it had not stopped)."""
        if self.stopped or self.state in _FINISHED:
            return False
        self.stop_reason, self.state = "user", JobState.DROPPED
        return True

    def end(self) -> bool:
        """Its final event goes out now; False when one went, or none is its to write."""
        if self.state in _FINISHED:
            return False
        self.state = JobState.ENDED
        return True

    def final_refused(self) -> None:
        """Redis refused its final event (not its to write): dropped, not ended."""
        if self.state is JobState.ENDED:
            self.state = JobState.DROPPED

    def begin_hand_over(self) -> bool:
        """Stop emitting: it moves to another worker. False when it no longer can (it
        ended or stopped since it was picked)."""
        if self.state not in _CAN_HAND_OVER:
            return False
        self.state = JobState.HANDING_OVER
        self._hand_over_decided.clear()
        return True

    def hand_over_failed(self) -> None:
        if self.state is JobState.HANDING_OVER:
            self.state = JobState.HANDOVER_FAILED
        self._hand_over_decided.set()

    def hand_over_declined(self) -> None:
        """TAKEOVER would not take it (it ended, or went round too often): it runs on here,
        from the first output it held back."""
        if self.state is JobState.HANDING_OVER:
            self.state = JobState.RUNNING
        self._hand_over_decided.set()

    def handed_over(self) -> None:
        self.state = JobState.HANDED_OVER
        self._hand_over_decided.set()

    async def own_outputs(
        self, outputs: AsyncGenerator[Output, None]
    ) -> AsyncGenerator[Output, None]:
        """The engine's ``outputs`` that are this run's to emit, in order, and none twice:
        while a hand-over waits for TAKEOVER's answer they wait too, so a declined one goes
        on with no gap; once handed over they are another worker's (dropped); after a
        failed attempt they are kept for a decline to come. Closing it closes ``outputs``."""
        kept: list[Output] = []
        try:
            async for output in outputs:
                if self.handed_on:
                    await self._hand_over_decided.wait()
                    if self.handed_on:
                        if self.state is JobState.HANDOVER_FAILED:
                            kept.append(output)
                        continue
                for earlier in kept:
                    yield earlier
                kept.clear()
                yield output
            await self._hand_over_decided.wait()  # it ended while one was undecided
            if not self.handed_on:
                for earlier in kept:
                    yield earlier
        finally:
            await outputs.aclose()

    def step(self, delta: Delta) -> tuple[str | None, list[ToolCallDelta] | None, str | None]:
        """What an engine output makes of the reply: its content and tool calls (with
        tools), and its finish reason when it is the reply's last (None: not the last, or
        aborted): ``tool_calls`` for a reply that made calls, as vLLM's server says it (a
        named function's call ends ``stop``, as OpenAI's does)."""
        writer, reason = self.tool_calls, delta.finish_reason
        ending = reason not in (None, "abort")
        if writer is None:
            return None, None, reason if ending else None
        content, calls = writer.step(delta.text, final=ending)
        if ending and writer.made_calls() and writer.tools.choice != "named":
            reason = "tool_calls"
        return content, calls, reason if ending else None

    def first_token_out(self) -> float | None:
        """Its run's first token goes out (its trace's prefill ends): the reply's time to
        first token, from the gateway's enqueue (None: a continuation's run)."""
        if self.trace is not None:
            self.trace.first_token()
        if self.request.resume is not None:
            return None
        self.first_token_s = time.time() - self.request.enqueued_at
        return self.first_token_s

    def streamed(self, text: str, token_ids: list[int]) -> None:
        """An engine step's output went out (``emitted_tokens`` counts its tokens)."""
        self.emitted_tokens += len(token_ids)
        self.text.append(text)
        self.token_ids.extend(token_ids)

    def hold_second_copy(self, copy: Job) -> None:
        """Keep ``copy`` until this one's claim is answered (engine/jobs.py)."""
        self.second_copy = copy

    def take_second_copy(self) -> Job | None:
        copy, self.second_copy = self.second_copy, None
        return copy

    # --- its events ------------------------------------------------------------------------

    def claim_event(self, model: str, worker_id: str) -> Started | Resumed:
        """The event that claims the generation: ``started``, or ``resumed`` for a takeover."""
        resume = self.request.resume
        if resume is None:
            choice = self.request.choice
            return Started(self.generation_id, model, self.prompt_tokens, choice=choice)
        return Resumed(
            self.generation_id,
            resume.from_worker,
            worker_id,
            resume.completion_tokens,
            resume.takeover,
        )

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.emitted_tokens)

    def end_line(self, model: str, state: str, reason: str) -> dict[str, object]:
        """The fields of its one log line at its end, for a log store to query."""
        request = self.request
        line: dict[str, object] = {
            "session_id": self.session_id,
            "generation_id": self.generation_id,
            "state": state,
            "reason": reason,
            "tenant": request.tenant or "anonymous",
            "model": model,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.emitted_tokens,
            "duration_ms": round((time.monotonic() - self.started_at) * 1000, 1),
        }
        if self.first_token_s is not None:
            line["ttft_ms"] = round(self.first_token_s * 1000, 1)
        if request.traceparent:  # a cancel's line is written outside the job's task
            line["trace_id"] = trace_id_of(request.traceparent)
        return line
