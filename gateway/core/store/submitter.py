"""What a client submits, queued; and its cancel.

Every API goes through ``Submitter``, so they all share one admission
(gateway/core/store/admission.py), one queue and one cancel path:

- ``submit_stateless``: one generation of a one-shot request (OpenAI, TGI, OIP, a stored
  response) in a throwaway session SUBMIT makes with it;
- ``submit_message``: a session turn (a message, an edit, a regenerate, a continue) and
  its reply, ``n`` replies for ``n`` choices;
- ``cancel``: a generation stopped wherever it runs.

The engine's ``GenerationRequest`` is built here once per generation (``_one_shot``,
``_turn_request``): a session turn's conversation comes back from SUBMIT, which read the
history in the call that appended to it. The transitions themselves are
``wire.generations.Generations``'s.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from redis.asyncio.client import Pipeline

import wire
from gateway.core import tracing
from gateway.core.ask import GenerationAsk, KeptSession
from gateway.core.conversations import ConversationSettings
from gateway.core.errors import AGAIN_AFTER_S, BadRequest, Conflict, GatewayError, Unavailable
from gateway.core.ids import new_id
from gateway.core.settings import Settings
from gateway.core.store.admission import Admission, AdmissionObserver, Ticket
from gateway.core.store.durable import DurableSubmits
from gateway.core.store.models import ModelDirectory
from gateway.core.store.queue import GenerationQueue
from gateway.core.store.sessions import (
    Sessions,
    bad_token,
    conversation,
    digest,
    unknown_generation,
    unknown_session,
)
from gateway.tenants.caller import Caller
from gateway.tenants.records import ANONYMOUS_ID, Tenant
from wire import (
    CancelReason,
    CancelSignal,
    ChatMessage,
    FinalEvent,
    GenerationRequest,
    Keys,
    SamplingParams,
)
from wire import outcomes as script
from wire.connect import when_redis_answers
from wire.generations import Generations
from wire.scripts import Bill, NewSession

REQUEUE_WAIT_S = 10.0
"""How long a submit waits for Redis to take the request of a generation it has written."""
ANSWERED_KEPT = 20_000
"""Session turns answered lately kept at most (a few seconds' worth, looked at each second)."""


class Submitted(msgspec.Struct, frozen=True):
    generation_id: str
    session_id: str
    queued_event_id: str | None
    """None when it was submitted before: an Idempotency-Key matched, or SUBMIT was sent
    again after its reply was lost."""
    choices: list[str] = []
    """With ``n`` > 1: every choice's generation id, in choice order (the first is
    ``generation_id``)."""


@dataclass(frozen=True, slots=True)
class Turn:
    """A session turn on its way to the queue: its model, the tenant it serves, the
    generation id of each of its choices (the first is the turn's own) and their sampling."""

    session_id: str
    model: str
    tenant: Tenant
    generation_ids: list[str]
    params: SamplingParams
    kind: str = ""
    """How it changes the history first: "" a new message, ``edit <i>``, ``regenerate``,
    ``continue`` (wire/lua/submit.lua)."""
    system: str = ""
    """The conversation's system prompt, sent to the engine first."""


@dataclass(frozen=True)
class AnsweredTurn:
    """A session turn this process answered 202 for: what submitting it again takes
    (gateway/recovery/lost_submits.py)."""

    at: float
    turn: Turn
    note: bytes
    submit: dict[str, Any]
    """SUBMIT's arguments."""


class CancelOutcome(msgspec.Struct, frozen=True):
    generation_id: str
    state: str
    """``cancelled``, ``done`` or ``error`` when final; ``cancelling`` while the worker aborts."""
    final: FinalEvent | None = None


class SubmitObserver(AdmissionObserver, Protocol):
    """Told when a generation is queued or a cancel is sent, and of each key's admissions
    and refusals (gateway/server/metrics.py)."""

    def submitted(
        self, session_id: str, generation_id: str, queued_event_id: str, model: str, tenant: str
    ) -> None: ...

    def cancel_sent(self, session_id: str, generation_id: str, began: float) -> None: ...

    def cancel_stopped(self, generation_id: str, seconds: float) -> None: ...


def keep_in(pipe: Pipeline, keys: Keys, session_id: str, kept: KeptSession) -> None:
    """A one-generation session kept past its request: its meta, its TTL, and (a
    background response) its ``keep`` mark, which workers count as a reader."""
    meta = keys.meta(session_id)
    pipe.hset(meta, mapping=kept.meta)  # type: ignore[arg-type]
    pipe.expire(meta, kept.ttl_s)
    if kept.background:
        pipe.set(keys.keep(session_id), 1, ex=kept.ttl_s)


class Submitter:
    def __init__(
        self,
        sessions: Sessions,
        admission: Admission,
        generations: Generations,
        queue: GenerationQueue,
        models: ModelDirectory,
        settings: Settings,
        observer: SubmitObserver | None = None,
    ) -> None:
        self.sessions = sessions
        self.admission = admission
        self.generations = generations
        self.queue = queue
        self.models = models
        self.settings = settings
        self.observer = observer
        self.keys = sessions.keys
        self.durable = DurableSubmits(generations.redis, generations.topology, settings)
        self.answered: collections.deque[AnsweredTurn] = collections.deque(maxlen=ANSWERED_KEPT)
        """The session turns answered lately, oldest first: a Redis that lost one after its
        answer (a crash, a failover) gets it again (gateway/recovery/lost_submits.py)."""

    # --- one-shot requests ------------------------------------------------------------------

    async def submit_stateless(
        self,
        ask: GenerationAsk,
        model: str,
        session_id: str | None = None,
        kept: KeptSession | None = None,
        choice: int = 0,
    ) -> Submitted:
        """Queue one generation in a throwaway session (the OpenAI/TGI/OIP adapters) for
        ``model`` (``ask.model`` resolved: ``ModelDirectory.resolve``), serving
        ``ask.caller``'s key, admitted as ``Admission.one_shot`` says (in SUBMIT itself
        where it can). ``session_id``: the new session's id, when the caller subscribed to
        it first. ``kept``: a session that outlives its request (a stored response): its
        TTL, meta fields and whether it runs on with no reader. ``choice``: which of a
        request's ``n`` choices it is (only the first counts as a request and bills the
        prompt)."""
        for message in ask.messages or []:
            self._check_content(message.content, allow_empty=True)
        if ask.prompt is not None:
            self._check_content(ask.prompt)
        ttl_s = kept.ttl_s if kept is not None else self.settings.stateless_ttl_s
        request = self._one_shot(ask, session_id or new_id("s"), ttl_s, choice)
        new = self._new_session(model, request, ask.caller.tenant)
        keep = None
        if kept is not None:
            keep = functools.partial(
                keep_in, keys=self.keys, session_id=request.session_id, kept=kept
            )
        # Queued after its session on a cluster: noted first, whole (no session history
        # holds its conversation; Generations.create_queued).
        note = None if self.generations.topology.one_node else wire.encode(request)
        ticket = await self.admission.one_shot(
            ask.caller, ask.model or model, model, request, kept=kept is not None
        )
        try:
            if ticket.in_submit is not None:
                created = await self.generations.create_admitted(new, ticket.in_submit)
            else:
                waiting = self.queue.waiting(model, request, note)
                queue = self.queue.of(model)
                created = await self.generations.create_queued(new, queue, waiting, keep)
            reply = ticket.settled(created)
        except BaseException:
            await ticket.give_back()
            raise
        if reply == script.Duplicate(request.generation_id):  # sent again, its reply lost
            return Submitted(request.generation_id, request.session_id, None)
        if not isinstance(reply, script.Accepted):
            raise Unavailable(f"queueing a stateless generation failed: {reply!r}")
        await self.durable.confirm(self.keys.events(request.session_id), self.queue.of(model).key)
        if self.observer is not None:
            self.observer.submitted(
                request.session_id, request.generation_id, reply.queued_id, model, request.tenant
            )
        return Submitted(request.generation_id, request.session_id, reply.queued_id)

    def _one_shot(
        self, ask: GenerationAsk, session_id: str, ttl_s: int, choice: int
    ) -> GenerationRequest:
        """What the engine gets of a one-shot ask's ``choice``: its conversation (or
        prompt), how to continue it (the choice's own seed), and whom it serves."""
        return GenerationRequest(
            generation_id=new_id("g"),
            session_id=session_id,
            params=ask.sampling.for_choice(choice),
            messages=ask.messages or [],
            prompt=ask.prompt,
            enqueued_at=time.time(),
            session_ttl_s=ttl_s,
            events_maxlen=self.settings.events_maxlen,
            tools=ask.tools,
            task=ask.task,
            token_ids=ask.token_ids or [],
            tenant=ask.caller.tenant.id,
            choice=choice,
            traceparent=tracing.traceparent(),
        )

    def _new_session(self, model: str, request: GenerationRequest, tenant: Tenant) -> NewSession:
        """The stateless session SUBMIT makes for ``request`` to ``model``'s queue: its
        tenant billed its prompt and completion (another choice of a request: its
        completion; tokenize: nothing), and what its end keeps for the tenant's limits."""
        task, choice = request.task, request.choice
        bill: Bill = "none" if task != "generate" else "completion" if choice else "all"
        return NewSession(
            request.session_id,
            request.generation_id,
            self.settings.events_maxlen,
            request.session_ttl_s,
            self.sessions.watch_ttl_s,
            self._billed(tenant),
            bill,
            limits=tenant.limits,
            queue=self.queue.of(model).model,
        )

    def _billed(self, tenant: Tenant) -> str:
        """Whom a generation's final event counts the usage of ("": nobody): its tenant's
        key; a request with no key only with ``TOKENSPOUT_ANONYMOUS_USAGE`` (else it pays
        for no bookkeeping)."""
        anonymous = tenant.id == ANONYMOUS_ID and not self.settings.anonymous_usage
        return "" if anonymous else tenant.id

    # --- session turns ----------------------------------------------------------------------

    async def submit_message(
        self,
        session_id: str,
        token: str | None,
        ask: GenerationAsk,
        idempotency_key: str | None = None,
        *,
        owner: str | None = None,
    ) -> Submitted:
        """Append the ask's user message to the session and queue the reply (``ask.n``
        replies: the first is the turn's and joins the history; the others are queued
        beside it).

        ``ask.turn``: "" a new message; ``edit <i>``: it replaces history message ``i`` (a
        user message) and everything after it; ``regenerate`` (no message): the last user
        message is answered again, its reply cut off; ``continue`` (no message): the last
        message, an assistant one, is extended. The conversation's settings fill the
        sampling fields the request did not set (``ask.given``), its system prompt goes
        first. Authorises like ``Sessions.authorise``, by ``token`` or the ``owner``'s
        cookie (404, then 403); admitted against the key that made the session.
        """
        message = ask.message
        if message is not None:
            self._check_content(message.content)
        meta = await self.sessions.session_meta(session_id, token, owner)
        params = self._with_settings(ask.sampling, meta.settings, ask.given)
        # Checked again in the script. No token never matches: a digest is never "-"; an
        # owner's cookie was checked just now (an owner never changes).
        token_digest = "" if meta.by_owner else digest(token) if token is not None else "-"
        ids = [new_id("g") for _ in range(ask.n)]
        turn = Turn(
            session_id, meta.model, meta.tenant, ids, params, ask.turn, meta.settings.system
        )
        submitted = await self._submit_turn(
            ask.caller, turn, message, idempotency_key, token_digest
        )
        if submitted.queued_event_id is not None:
            content = message.content if message is not None else ""
            first = ask.turn == "edit 0"
            await self.sessions.conversations.touched(session_id, meta.owner, content, first=first)
        return submitted

    def _with_settings(
        self, params: SamplingParams, settings: ConversationSettings, given: frozenset[str]
    ) -> SamplingParams:
        """``params`` with the conversation's temperature and max tokens where the request
        left them to it (a lowered ``TOKENSPOUT_MAX_TOKENS_LIMIT`` still caps them)."""
        changes: dict[str, Any] = {}
        if settings.temperature is not None and "temperature" not in given:
            changes["temperature"] = settings.temperature
            left = [name for name in params.model_defaults if name != "temperature"]
            changes["model_defaults"] = left  # the conversation's, not the model's
        if settings.max_tokens is not None and "max_tokens" not in given:
            changes["max_tokens"] = min(settings.max_tokens, self.settings.max_tokens_limit)
            changes["min_tokens"] = min(params.min_tokens, changes["max_tokens"])
        return msgspec.structs.replace(params, **changes) if changes else params

    async def _submit_turn(
        self,
        caller: Caller,
        turn: Turn,
        user_message: ChatMessage | None,
        idempotency_key: str | None,
        token_digest: str,
    ) -> Submitted:
        session_id, model, generation_id = turn.session_id, turn.model, turn.generation_ids[0]
        ticket = await self.admission.turn(
            caller, turn.tenant, model, session_id, turn.generation_ids, idempotency_key
        )
        note = wire.encode(self._turn_request(turn, 0, []))  # its conversation: SUBMIT's
        submit = {
            "session_id": session_id,
            "generation_id": generation_id,
            "user_message": user_message,
            "token_digest": token_digest,
            "idempotency_key": idempotency_key,
            "maxlen": self.settings.events_maxlen,
            "ttl_s": self.settings.session_ttl_s,
            "max_history": self.settings.max_history_messages,
            "watch_ttl_s": self.sessions.watch_ttl_s,
            "tenant": self._billed(turn.tenant),
            "turn": turn.kind,
            "limits": turn.tenant.limits,
        }
        try:
            reply = await self.generations.submit_noted(self.queue.of(model), note, **submit)
            accepted = self._accepted(turn, ticket.settled(reply))
        except BaseException:
            await ticket.give_back()
            raise
        if isinstance(accepted, str):  # a resend: no new generation
            await ticket.give_back()
            await self._requeue_if_lost(turn, accepted)
            return Submitted(accepted, session_id, None)
        self.answered.append(AnsweredTurn(time.monotonic(), turn, note, submit))
        messages = conversation(turn.system, accepted.history)
        request = self._turn_request(turn, 0, messages)
        await self._enqueue_written(model, request, note)
        await self.durable.confirm(self.keys.events(session_id), self.queue.of(model).key)
        self._submitted(request, accepted.queued_id, model)
        for choice in range(1, len(turn.generation_ids)):
            await self._submit_choice(turn, choice, messages, ticket)
        choices = turn.generation_ids if len(turn.generation_ids) > 1 else []
        return Submitted(generation_id, session_id, accepted.queued_id, choices)

    async def submit_again(self, answered: AnsweredTurn) -> bool:
        """Submit a turn again as it was, its generation gone from Redis (lost after its
        answer); whether it was (a session gone too is not: its readers get
        ``session_lost`` or 404, gateway/core/errors.py)."""
        turn = answered.turn
        queue = self.queue.of(turn.model)
        reply = await self.generations.submit_noted(queue, answered.note, **answered.submit)
        if isinstance(reply, script.SessionMissing):
            return False
        accepted = self._accepted(turn, reply)
        if isinstance(accepted, str):  # its Idempotency-Key's generation is there after all
            return False
        request = self._turn_request(turn, 0, conversation(turn.system, accepted.history))
        await self._enqueue_written(turn.model, request, answered.note)
        return True

    def _turn_request(
        self, turn: Turn, choice: int, messages: list[ChatMessage], generation_id: str = ""
    ) -> GenerationRequest:
        """What the engine gets of choice ``choice`` of a turn: the conversation it answers
        (its note leaves it out: SUBMIT gives it back), its own seed."""
        return GenerationRequest(
            generation_id=generation_id or turn.generation_ids[choice],
            session_id=turn.session_id,
            params=turn.params.for_choice(choice),
            messages=messages,
            enqueued_at=time.time(),
            session_ttl_s=self.settings.session_ttl_s,
            events_maxlen=self.settings.events_maxlen,
            tenant=turn.tenant.id,
            choice=choice,
            continue_final_message=turn.kind == "continue",
            traceparent=tracing.traceparent(),
        )

    def _accepted(self, turn: Turn, reply: script.SubmitReply) -> script.Accepted | str:
        """SUBMIT's answer to a turn: accepted, or the generation an Idempotency-Key made
        before (its id); every other answer as the gateway's error (``_refusal``)."""
        match reply:
            case script.Accepted():
                return reply
            case script.Duplicate(generation_id=earlier):
                return earlier
        raise self._refusal(reply, turn.session_id)

    def _refusal(self, reply: script.SubmitReply, session_id: str) -> GatewayError:
        """What a client is told when SUBMIT refused a session turn."""
        match reply:
            case script.SessionMissing():
                return unknown_session(session_id)
            case script.BadToken():
                return bad_token()
            case script.Busy(generation_id=running):
                return Conflict(
                    f"generation {running} is still running in this session",
                    code="generation_running",
                    retry_after_s=AGAIN_AFTER_S,
                )
            case script.HistoryFull():
                return BadRequest(
                    f"the session holds {self.settings.max_history_messages} messages, the "
                    "limit set by TOKENSPOUT_MAX_HISTORY_MESSAGES; start a new session",
                    code="history_full",
                )
            case script.BadTurn(kind="edit"):
                return BadRequest(
                    "edit must be the index of a user message of the history (GET "
                    "/v1/sessions/{id} lists them)",
                    code="bad_edit",
                    field="edit",
                )
            case script.BadTurn(kind="regenerate"):
                return Conflict(
                    "the history has no user message to answer again: send a message",
                    code="nothing_to_regenerate",
                )
            case script.BadTurn():
                return Conflict(
                    "the history does not end with an assistant message to continue: send "
                    "a message",
                    code="nothing_to_continue",
                )
        return Unavailable(f"SUBMIT answered {reply!r}")

    async def _submit_choice(
        self, turn: Turn, choice: int, messages: list[ChatMessage], ticket: Ticket
    ) -> None:
        """Queue another choice of the turn: the same conversation, its own seed; it is not
        the session's running generation and never joins the history, and its prompt is
        billed with the first choice's."""
        session_id, generation_id = turn.session_id, turn.generation_ids[choice]
        request = self._turn_request(turn, choice, messages)
        note = wire.encode(msgspec.structs.replace(request, messages=[]))
        reply = await self.generations.submit_noted(
            self.queue.of(turn.model),
            note,
            session_id=session_id,
            generation_id=generation_id,
            user_message=None,
            token_digest="",
            idempotency_key=None,
            maxlen=self.settings.events_maxlen,
            ttl_s=self.settings.session_ttl_s,
            max_history=self.settings.max_history_messages,
            watch_ttl_s=self.sessions.watch_ttl_s,
            choice=choice,
            tenant=self._billed(turn.tenant),
            bill="completion",
            limits=turn.tenant.limits,
        )
        if not isinstance(reply, script.Accepted):  # the session was there a moment ago
            await ticket.give_back([generation_id])
            raise Unavailable(f"queueing choice {choice} failed: {reply!r}")
        await self._enqueue_written(turn.model, request, note)
        self._submitted(request, reply.queued_id, turn.model)

    async def _enqueue_written(
        self, model: str, request: GenerationRequest, note: bytes | None = None
    ) -> None:
        """Queue the request of a generation the SUBMIT script has written, crossing off
        its ``note``. Without it no worker would run that generation until the reaper found
        the note, so a Redis that went away between the two round trips (a restart) is
        waited for, up to ``REQUEUE_WAIT_S``. A copy sent twice (the first one's reply
        lost) runs once: a worker claims a generation only while it is queued."""
        try:
            async with asyncio.timeout(REQUEUE_WAIT_S):
                await when_redis_answers(
                    lambda: self.queue.enqueue(model, request, note),
                    f"queueing {request.generation_id}",
                )
        except TimeoutError:
            raise Unavailable(
                "Redis went away while the request was queued; send it again with the "
                "same Idempotency-Key",
                retry_after_s=AGAIN_AFTER_S,
            ) from None

    async def _requeue_if_lost(self, turn: Turn, generation_id: str) -> None:
        """A message sent again with its Idempotency-Key: if its generation is still
        waiting for a worker, its request may never have reached the queue (the gateway
        died, or Redis went away, between the two round trips of the first send), so it is
        queued again; a second copy runs once. One round trip more, on retries only."""
        if await self.sessions.generation_state(turn.session_id, generation_id) != "queued":
            return
        request = self._turn_request(turn, 0, [], generation_id)
        await self._enqueue_written(turn.model, await self.sessions.with_turn(request))

    def _check_content(self, content: str, *, allow_empty: bool = False) -> None:
        if not content.strip() and not allow_empty:
            raise BadRequest("content must not be empty", field="content")
        if len(content) > self.settings.max_message_chars:
            raise BadRequest(
                f"content is longer than {self.settings.max_message_chars} characters "
                "(TOKENSPOUT_MAX_MESSAGE_CHARS)",
                code="message_too_long",
                field="content",
            )

    def _submitted(self, request: GenerationRequest, queued_id: str, model: str) -> None:
        if self.observer is not None:
            session_id, generation_id = request.session_id, request.generation_id
            self.observer.submitted(session_id, generation_id, queued_id, model, request.tenant)

    # --- cancel -----------------------------------------------------------------------------

    async def cancel(
        self, session_id: str, generation_id: str, reason: CancelReason = "user"
    ) -> CancelOutcome:
        """Stop a generation wherever it runs; idempotent (a final one reports its end)."""
        began = time.monotonic()
        reply = await self.generations.cancel(session_id, generation_id, reason)
        match reply:
            case script.UnknownGeneration():
                raise unknown_generation(generation_id)
            case script.EndedBefore(final=final):
                return CancelOutcome(generation_id, wire.final_state(final), final)
            case script.CancelledQueued(final=final):
                if self.observer is not None:
                    self.observer.cancel_stopped(generation_id, time.monotonic() - began)
                # Its usage: zero, or what it streamed before a takeover queued it again.
                return CancelOutcome(generation_id, "cancelled", final)
        if self.observer is not None:
            self.observer.cancel_sent(session_id, generation_id, began)
        await self.generations.signal_cancel(CancelSignal(generation_id, session_id, reason))
        return CancelOutcome(generation_id, "cancelling")
