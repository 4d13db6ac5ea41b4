"""One engine step's events in one script call (wire/lua/emit_step.lua): the same checks
and writes per event as ``wire.scripts.Emit``, the arguments built event by event.

A token is one record in the call's ARGV and two keys, no object: ``StepCall`` is what the
publisher (engine/publisher.py) fills while the engine steps, ``EmitStep`` sends it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

from redis.asyncio.client import Pipeline

from wire.keys import CONSUMER_GROUP
from wire.replies import text
from wire.scripts import EMIT_CORE, EMIT_EVENT, HOLD_CORE, Script


class EmitTarget(NamedTuple):
    """Where one generation's events go, worked out once per generation (not per token);
    bytes keys, as redis-py would encode str ones again in every call."""

    session_id: str
    generation_id: str
    epoch: int
    events: bytes
    gen: bytes
    active: bytes
    history: bytes
    head: bytes
    """The start of each of its records: ``b"<epoch> <maxlen> <ttl> <gid> "``."""


class StepCall:
    """The KEYS and ARGV of one EMIT_STEP call, built event by event: per event two keys
    and one record (a final event two more keys and its assistant message), no object;
    and, on one Redis, what the step's ended replies change in their model's queue with
    them: their requests acknowledged (``acknowledge``), the prefixes they left in the
    writer's engine held (``hold``)."""

    __slots__ = ("acked_in", "args", "held_in", "keys", "size", "targets", "writer")

    def __init__(self, writer: str) -> None:
        self.writer = writer
        self.keys: list[bytes] = []
        self.args: list[bytes] = [writer.encode(), b"", CONSUMER_GROUP.encode(), b""]
        self.targets: list[EmitTarget] = []
        """Whose each event is, in order (the reply has one entry per event)."""
        self.size = 0
        self.acked_in: bytes | None = None
        """The queue whose requests the call acknowledges (None: none)."""
        self.held_in: bytes | None = None
        """The fair base under which the call adds the writer to prefixes' holders."""

    def acknowledge(self, queue: bytes, entry_ids: list[bytes]) -> None:
        """Acknowledge these requests of ``queue`` once every event is written (their
        final events are among them, or in an earlier call). Only on one Redis: on a
        cluster the queue's slot is not the sessions'. Again: the same ids replace them."""
        self.args[1] = b" ".join(entry_ids)
        self.acked_in = queue if entry_ids else None

    def hold(self, fair_base: bytes, names: Collection[str], ttl_s: int) -> None:
        """Add the writer to the holders of ``names`` (prefixes its engine holds now) under
        ``fair_base`` with the call's events, for ``ttl_s`` (wire/lua/hold_core.lua). Only
        on one Redis, as ``acknowledge``. Again: the same names replace them."""
        if names:
            self.args[3] = b" ".join([b"%d" % ttl_s, *(name.encode() for name in names)])
            self.held_in = fair_base
        else:
            self.args[3], self.held_in = b"", None

    @property
    def all_keys(self) -> list[bytes]:
        tail = [key for key in (self.acked_in, self.held_in) if key is not None]
        return [*self.keys, *tail] if tail else self.keys

    def add(
        self,
        target: EmitTarget,
        seq: int,
        event_type: str,
        data: bytes,
        final_state: str = "",
        assistant: bytes = b"",
    ) -> int:
        """Queue one event (``seq``: the writer's number for it in its generation); returns
        where its record is (for ``rewrite``)."""
        self.targets.append(target)
        self.size += 1
        self.args.append(_record(target, seq, event_type, data, final_state))
        position = len(self.args) - 1
        if final_state:
            self.keys += (target.events, target.gen, target.active, target.history)
            self.args.append(assistant)
        else:
            self.keys += (target.events, target.gen)
        return position

    def rewrite(
        self, position: int, target: EmitTarget, seq: int, event_type: str, data: bytes
    ) -> None:
        """Replace the non-final event queued at ``position`` (its target and number stay)."""
        self.args[position] = _record(target, seq, event_type, data)


def _record(target: EmitTarget, seq: int, kind: str, data: bytes, state: str = "") -> bytes:
    """One event's ARGV record (wire/lua/emit_step.lua reads it back)."""
    final = state.encode() if state else b"-"
    return b"%s%d %s %s %s" % (target.head, seq, kind.encode(), final, data)


class EmitStep(Script):
    """Append every event of one engine step in one call (wire/lua/emit_step.lua): the same
    checks and writes per event as ``Emit``. Every key of a call must share one hash slot
    on a cluster (the publisher groups a step's events so)."""

    name = "emit_step"
    cores = (EMIT_CORE, EMIT_EVENT, HOLD_CORE)

    def target(
        self, session_id: str, generation_id: str, *, epoch: int, maxlen: int, ttl_s: int
    ) -> EmitTarget:
        keys = self.keys
        return EmitTarget(
            session_id,
            generation_id,
            epoch,
            keys.events(session_id).encode(),
            keys.generation(session_id, generation_id).encode(),
            keys.active(session_id).encode(),
            keys.history(session_id).encode(),
            f"{epoch} {maxlen} {ttl_s} {generation_id} ".encode(),
        )

    def queue_in(self, pipe: Pipeline, call: StepCall) -> None:
        """Queue ``call`` in ``pipe``, its bare call: on ``lost_scripts``, ``load`` and send
        the whole pipeline again (EMIT's seq makes that safe)."""
        self.queue_call(pipe, call.all_keys, call.args)

    async def send(self, call: StepCall) -> list[str | None]:
        """``call`` alone, outside a pipeline (redis-py's costs about 20 us of CPU a call):
        ``replies``. A Redis that lost its scripts gets it loaded and the call again."""
        return self.replies(await self._run(call.all_keys, call.args, None))

    @staticmethod
    def replies(reply: object) -> list[str | None]:
        """One entry id per event of the call, None where it was refused."""
        if not isinstance(reply, list):
            raise TypeError(f"EMIT_STEP answered {reply!r}")
        return [text(item) or None for item in reply]
