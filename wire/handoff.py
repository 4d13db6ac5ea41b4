"""A running reply handed on to another worker: one transition, made by two callers.

The gateways' reaper makes it for a worker that was lost (gateway/recovery/takeover.py), a worker
that stops makes it for its own replies (engine/jobs.py). Both run the TAKEOVER script
(``wire.scripts.Takeover``: the generation moves from its worker to ``queued`` at the next
epoch, atomically, so it is handed on once) and, when it answers ``TakenOver``, queue
``continuation``: the same request, resumed from what was streamed. They differ only in how
they know what was streamed: the stopping worker knows it (and passes the usage to the
script), the reaper reads it back from the session's events after the script (from then on
no one writes them, so that read is exact).
"""

from __future__ import annotations

import time

import msgspec

from wire.messages import GenerationRequest, Resume, Usage
from wire.outcomes import NotStarted, TakenOver


class Streamed(msgspec.Struct, frozen=True):
    """What a generation streamed before it was taken over."""

    prompt_tokens: int
    completion_tokens: int
    text: str
    token_ids: list[int]

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens)


def continuation(
    request: GenerationRequest, taken: TakenOver | NotStarted, streamed: Streamed
) -> GenerationRequest:
    """The request that goes on with a generation TAKEOVER took (or found queued again
    after a takeover, its worker lost before it claimed it): queued now, its first event
    ``resumed``, its tokens numbered on from the streamed ones."""
    return msgspec.structs.replace(
        request,
        enqueued_at=time.time(),
        resume=Resume(
            takeover=taken.takeovers,
            from_worker=taken.from_worker,
            prompt_tokens=streamed.prompt_tokens,
            completion_tokens=streamed.completion_tokens,
            text=streamed.text,
            token_ids=streamed.token_ids,
        ),
    )
