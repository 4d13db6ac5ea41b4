"""Writes session events to Redis: everything one engine step produced, in one script call.

Events queue up while the engine steps; at the end of a step (the next turn of the event
loop) the publisher writes them all: one EMIT_STEP call (``wire.emit_step.EmitStep``: per
event, append to the session stream, publish on the live channel, refuse anything after a
generation's final event or from a writer that does not own it) per group of sessions, and
the requests that ended acknowledged, and the prefixes they left in the engine's cache
held (for their next turns' cache affinity), in the same round trip (on a cluster, a
round trip after and before it): ``wire.generations.Generations.emit_step``.
``group_of`` says which sessions may share a call: all of them on one Redis, one hash
slot's on a Redis Cluster, where every script must keep to one slot (``wire.topology``).

A token costs a record in a list, no future and no object: only the events whose outcome
the worker acts on (a generation's claim and its end) get one. Events are written in the
order they were emitted; while a write is under way the next steps' events gather and go
in the next call together, so a slow Redis gets fewer, larger calls and no token waits
when nothing is behind. With ``join_tokens`` (the worker's ``--join-tokens``), a
generation's tokens that gather so (Redis a step or more behind) become one event, as a
step that made several tokens at once would be: Redis writes, publishes and relays one
event for them, not one each, and catches up. It is off by default: an OpenAI chunk or a
TGI event then carries several tokens' text in one, which clients of those formats may
not expect of a reply that is only late. While Redis is unreachable events wait and are
retried, so a short Redis restart delays tokens instead of losing them; each event
carries its number within its generation, so a write sent again never writes an event
twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Hashable, Sequence

from redis.exceptions import RedisError

import wire
from wire import SessionEvent, Token
from wire.connect import RETRY_MAX_S
from wire.emit_step import EmitTarget, StepCall
from wire.generations import Generations
from wire.library import lost_scripts
from wire.queue import RequestQueue

log = logging.getLogger("tokenspout.publisher")

GroupOf = Callable[[str], Hashable]
"""Session id -> the group whose events may share one script call."""

MAX_EVENTS_PER_CALL = 1_000
"""A call runs in Redis without a break: more events than this go in the next call."""


class _OpenToken:
    """A generation's token that the next one joins, while it waits for a write under way."""

    __slots__ = ("call", "position", "seq", "token")

    def __init__(self, call: StepCall, position: int, seq: int, token: Token) -> None:
        self.call = call
        self.position = position
        self.seq = seq
        self.token = token


def joined(first: Token, then: Token) -> Token:
    """Two consecutive tokens of a generation as one event: texts, ids, log probabilities
    and per-token texts in order, the later one's count."""
    return Token(
        first.generation_id,
        first.text + then.text,
        then.count,
        [*first.token_ids, *then.token_ids],
        wire.concat_optional(first.logprobs, then.logprobs),
        wire.concat_optional(first.tokens, then.tokens),
        wire.concat_optional(first.top_logprobs, then.top_logprobs),
        None if first.content is None and then.content is None else first.visible + then.visible,
        wire.concat_optional(first.tool_calls, then.tool_calls),
    )


class _Batch:
    """What one write sends: the calls per group, the acknowledgements, and who waits."""

    __slots__ = ("acks", "calls", "done", "finals", "held", "open_tokens", "waiters")

    def __init__(self) -> None:
        self.calls: dict[Hashable, list[StepCall]] = {}
        self.open_tokens: dict[EmitTarget, _OpenToken] = {}
        """Per generation, its token that is the last of its events here (kept only while
        a write is under way: then the next one joins it)."""
        self.acks: list[tuple[EmitTarget, bytes]] = []
        """The requests the batch's final events acknowledge (their targets, entry ids)."""
        self.waiters: dict[tuple[StepCall, int], asyncio.Future[str | None]] = {}
        """(call, event's position in it) -> the future of an event someone awaits."""
        self.finals: set[tuple[StepCall, int]] = set()
        """The final events: a refused one is no sign that another writer owns it."""
        self.done: asyncio.Future[None] | None = None
        """Made when someone waits for the whole batch (``Publisher.written``)."""
        self.held: set[str] = set()
        """The prefixes the batch's ended replies left in the engine's cache."""


class Publisher:
    def __init__(
        self,
        generations: Generations,
        *,
        queue: RequestQueue,
        writer: str,
        on_rejected: Callable[[str, int], None],
        group_of: GroupOf | None = None,
        join_tokens: bool = False,
    ) -> None:
        self.generations = generations
        """Writes each step's events and acknowledgements (wire/generations.py)."""
        self.queue = queue
        """The queue final events acknowledge their request in (the worker's model's)."""
        self.writer = writer
        """The worker's id: Redis refuses its event unless it owns the generation (a
        ``started`` or ``resumed`` event claims it with the request of its epoch)."""
        self.on_rejected = on_rejected
        """Called with a generation id and the writer's epoch whose event Redis refused
        (the generation ended, or another writer owns it now)."""
        self.group_of: GroupOf = group_of or generations.topology.group_of
        """Which sessions' events may share a call (default: the topology's)."""
        self.join_tokens = join_tokens
        """Join a generation's tokens that wait for the next write (see the module's doc)."""
        self._batch = _Batch()
        self._in_flight: _Batch | None = None
        self._events = 0
        self._wakeup = asyncio.Event()
        self.pipelines = 0
        self.events = 0

    def emit(self, target: EmitTarget, token: Token, seq: int) -> int:
        """Queue a token: written with the step, nobody waits for it. Returns the number of
        the event that carries it.

        ``seq``: the number a new event takes within its generation (1, 2, 3...): Redis
        writes an event once whatever the retries. With ``join_tokens``, while a write is
        under way, a token whose generation's last event here is a token joins that one
        and takes its number (see the module's doc)."""
        batch = self._batch
        open_token = batch.open_tokens.get(target) if batch.open_tokens else None
        if open_token is None:
            call = self._call(target.session_id)
            position = call.add(target, seq, "token", wire.encode(token))
            if self.join_tokens and self.writing:
                batch.open_tokens[target] = _OpenToken(call, position, seq, token)
            return seq
        open_token.token = joined(open_token.token, token)
        data = wire.encode(open_token.token)
        open_token.call.rewrite(open_token.position, target, open_token.seq, "token", data)
        return open_token.seq

    @property
    def writing(self) -> bool:
        """A write is under way: what is emitted meanwhile waits for the next one."""
        return self._in_flight is not None

    def emit_waited(
        self,
        target: EmitTarget,
        event: SessionEvent,
        seq: int,
        *,
        final: bool = False,
        assistant: wire.ChatMessage | None = None,
        ack: bytes | None = None,
        held: Sequence[str] = (),
    ) -> asyncio.Future[str | None]:
        """Queue an event; the future resolves to its stream id, or None if refused.

        ``final``: it ends the generation (``assistant`` joins the history). ``ack``: the
        request's entry id, acknowledged once the event is written (one Redis: in the same
        round trip, so "in flight", gateway/core/store/queue.py, drops the moment it
        ends). ``held``: the names of the prefixes the reply left in the engine's cache,
        held by this worker once the event is written (in the same round trip on one
        Redis), so the client's next turn finds them."""
        batch = self._batch
        batch.held.update(held)
        if batch.open_tokens:
            batch.open_tokens.pop(target, None)  # no token joins one before this event
        call = self._call(target.session_id)
        where = (call, call.size)
        call.add(
            target,
            seq,
            wire.event_type(event),
            wire.encode(event),
            wire.final_state(event) if final else "",  # type: ignore[arg-type]
            wire.encode(assistant) if assistant is not None else b"",
        )
        if final:
            batch.finals.add(where)
        if ack is not None:
            batch.acks.append((target, ack))
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        batch.waiters[where] = future
        return future

    def written(self) -> asyncio.Future[None]:
        """Resolves once every event emitted so far is in Redis (written in order)."""
        batch = self._batch if self._events else self._in_flight
        if batch is None:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            future.set_result(None)
            return future
        if batch.done is None:
            batch.done = asyncio.get_running_loop().create_future()
        return batch.done

    def _call(self, session_id: str) -> StepCall:
        group = self.group_of(session_id)
        calls = self._batch.calls.get(group)
        if calls is None:
            calls = self._batch.calls[group] = [StepCall(self.writer)]
        elif calls[-1].size >= MAX_EVENTS_PER_CALL:
            calls.append(StepCall(self.writer))
        if not self._events:
            self._wakeup.set()
        self._events += 1
        return calls[-1]

    async def run_forever(self) -> None:
        backoff = 0.05
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            await asyncio.sleep(0)  # let every request of this engine step add its delta
            batch = self._in_flight = self._batch
            self._batch, self._events = _Batch(), 0
            calls = [call for group in batch.calls.values() for call in group]
            while True:
                try:
                    replies = await self._write(calls, batch)
                    backoff = 0.05
                    break
                except (RedisError, OSError) as exc:
                    if lost_scripts(exc):
                        # A restarted Redis, or a replica promoted in a failover, has no
                        # scripts: load it and send the step again (seq makes that safe);
                        # if loading fails too, the warning below says why.
                        with contextlib.suppress(RedisError, OSError):
                            await self.generations.load_step()
                            continue
                    count = sum(call.size for call in calls)
                    log.warning("publishing %d events failed (%s); retrying", count, exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RETRY_MAX_S)
            self._in_flight = None
            self._settle(batch, calls, replies)

    def _settle(
        self, batch: _Batch, calls: list[StepCall], replies: list[list[str | None]]
    ) -> None:
        for call, ids in zip(calls, replies, strict=True):
            if None in ids:
                for index, (target, stream_id) in enumerate(zip(call.targets, ids, strict=True)):
                    if stream_id is None and (call, index) not in batch.finals:
                        self.on_rejected(target.generation_id, target.epoch)
        if batch.waiters:
            ids_of = dict(zip(calls, replies, strict=True))
            for (call, index), future in batch.waiters.items():
                if not future.done():
                    future.set_result(ids_of[call][index])
        if batch.done is not None and not batch.done.done():
            batch.done.set_result(None)

    async def _write(self, calls: list[StepCall], batch: _Batch) -> list[list[str | None]]:
        replies = await self.generations.emit_step(calls, batch.acks, self.queue, batch.held)
        self.pipelines += 1
        self.events += sum(call.size for call in calls)
        return replies
