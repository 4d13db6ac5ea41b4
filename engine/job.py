"""One generation as a worker runs it: its request and what it has streamed so far."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import wire
from engine.tools import ToolCallWriter
from wire import (
    Cancelled,
    CancelReason,
    Done,
    Error,
    GenerationRequest,
    Resumed,
    Started,
    Usage,
)
from wire.emit_step import EmitTarget


def epoch_of(request: GenerationRequest) -> int:
    """The takeover a request carries (0: the first run)."""
    return request.resume.takeover if request.resume is not None else 0


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
    cancel_reason: CancelReason | None = None
    cancelled_at: float | None = None
    ended: bool = False
    acked: bool = False
    events: int = 0
    """Events emitted so far: each one's number makes its write idempotent (EMIT's seq)."""
    token_ids: list[int] = field(default_factory=list)
    handing_over: bool = False
    """SIGTERM hand-over under way: what the engine still makes is not emitted."""
    handover_failed: bool = False
    """The last hand-over attempt raised (Redis away): tried again by the drain; if none
    goes through, the request is left pending for the gateways' reaper (never acked)."""
    claimed: bool = False
    claim_refused: bool = False
    """Redis refused its claim (it ended, or another worker has it): its run stops."""
    prepare_s: float = 0.0
    """How long the backend took to prepare it (tokenisation, the chat template)."""
    second_copy: Job | None = None
    """The same request taken again while this one's claim was on its way (engine/intake.py)."""
    tool_calls: ToolCallWriter | None = None
    """With tools: turns what the model writes into content and calls (engine/tools.py)."""
    estimated_tokens: int = 0
    """What its queue charged its tenant for its prompt before anyone knew its tokens (the
    entry's ``e``, ``wire.queue.estimated_tokens``; 0 for an entry that never waited in a
    tenant's list); the worker charges the difference once it knows."""

    def __post_init__(self) -> None:
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


def final_reason(event: wire.FinalEvent) -> str:
    match event:
        case Done():
            return event.finish_reason
        case Cancelled():
            return event.reason
        case Error():
            return event.code
    return ""
