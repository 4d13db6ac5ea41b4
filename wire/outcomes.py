"""What the Lua scripts answer, as typed values: one Struct per outcome, one union per
script. ``wire.scripts`` decodes each reply into these once, so callers ``match`` on types
that mypy checks instead of comparing lists of strings (each .lua file's header says what
it returns; the decoders in wire/scripts.py are the only readers of those lists)."""

from __future__ import annotations

import msgspec

from wire.limits import Counts
from wire.messages import CancelReason, ChatMessage, FinalEvent


class ScriptReplyError(ValueError):
    """A script answered what its wrapper does not know (a .lua file and its decoder
    disagree): a bug, never a state to handle."""


# --- TAKEOVER (wire/lua/takeover.lua) ------------------------------------------------


class TakenOver(msgspec.Struct, frozen=True, tag="takeover"):
    """Taken from ``from_worker``: queued at epoch ``takeovers``; queue its continuation."""

    takeovers: int
    from_worker: str


class NotStarted(msgspec.Struct, frozen=True, tag="queued"):
    """Not running (its worker never claimed it): queue it again at epoch ``takeovers``."""

    takeovers: int
    from_worker: str
    """The worker it was last taken from ("" if never)."""


class CancelAsked(msgspec.Struct, frozen=True, tag="cancel"):
    """A cancel was asked for: end it cancelled."""

    reason: CancelReason


class Exhausted(msgspec.Struct, frozen=True, tag="exhausted"):
    """Taken over the most times allowed already: end it."""


class AlreadyFinal(msgspec.Struct, frozen=True, tag="final"):
    """It ended (or expired): nothing to do."""


class Moved(msgspec.Struct, frozen=True, tag="moved"):
    """Another worker owns it now: nothing to do."""


TakeoverReply = TakenOver | NotStarted | CancelAsked | Exhausted | AlreadyFinal | Moved


# --- SUBMIT (wire/lua/submit.lua) ----------------------------------------------------


class Accepted(msgspec.Struct, frozen=True, tag="ok"):
    """Queued: its ``queued`` event's id, and the session's history to send the engine."""

    queued_id: str
    history: list[ChatMessage]


class SessionMissing(msgspec.Struct, frozen=True, tag="missing"):
    pass


class BadToken(msgspec.Struct, frozen=True, tag="forbidden"):
    """The session's token did not match."""


class Duplicate(msgspec.Struct, frozen=True, tag="duplicate"):
    """The idempotency key names ``generation_id``, made before."""

    generation_id: str


class Busy(msgspec.Struct, frozen=True, tag="busy"):
    """``generation_id`` still runs in the session."""

    generation_id: str


class HistoryFull(msgspec.Struct, frozen=True, tag="history_full"):
    pass


class OverCapacity(msgspec.Struct, frozen=True, tag="overloaded"):
    """Not admitted: ``count`` generations in flight, of all models (``scope`` "all") or of
    the request's own ("model"), reached the limit."""

    scope: str
    count: int


class Admitted(msgspec.Struct, frozen=True, tag="admitted"):
    """Queued, its key's limits admitted in the same call (one Redis): the key's counts."""

    queued_id: str
    counts: Counts


class Limited(msgspec.Struct, frozen=True, tag="limited"):
    """Not admitted: the key is at one of its limits (``counts.refused``)."""

    counts: Counts


class BadTurn(msgspec.Struct, frozen=True, tag="bad_turn"):
    """The history has nothing the turn can be: no user message at the ``edit`` index, none
    to ``regenerate`` from, no assistant message last to ``continue``."""

    kind: str


SubmitReply = (
    Accepted
    | Admitted
    | SessionMissing
    | BadToken
    | Duplicate
    | Busy
    | HistoryFull
    | OverCapacity
    | Limited
    | BadTurn
)


# --- CANCEL (wire/lua/cancel.lua) ----------------------------------------------------


class UnknownGeneration(msgspec.Struct, frozen=True, tag="unknown"):
    pass


class EndedBefore(msgspec.Struct, frozen=True, tag="final"):
    """It had ended already: its final event."""

    final: FinalEvent


class CancelledQueued(msgspec.Struct, frozen=True, tag="cancelled"):
    """It was queued: ended here, ``final`` written as ``event_id``."""

    event_id: str
    final: FinalEvent


class SignalWorker(msgspec.Struct, frozen=True, tag="signal"):
    """It runs: tell ``worker`` to stop it."""

    worker: str


CancelReply = UnknownGeneration | EndedBefore | CancelledQueued | SignalWorker
