"""Sessions in Redis: create, authorise, submit a message, cancel a generation.

Every transport (SSE, WebSocket, OpenAI, TGI, OIP) goes through ``SessionStore``, so they
all share one set of limits, one queue and one cancel path. It holds the two other owners
of gateway state in Redis: ``queue`` (gateway/core/generations.py: sampling limits, capacity,
the models' queues, cancel signals) and ``models`` (gateway/core/models.py: which models and
workers are live). With ``relay.py`` (reading events) these are the only gateway code that
talks to Redis.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import msgspec
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

import wire
from gateway.core.ask import GenerationAsk, KeptSession
from gateway.core.auth import tenant_directory
from gateway.core.conversations import Conversation, Conversations, ConversationSettings
from gateway.core.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    GatewayError,
    NotFound,
    Overloaded,
    Unavailable,
)
from gateway.core.generations import GenerationQueue
from gateway.core.ids import new_id, token_urlsafe
from gateway.core.models import ModelDirectory
from gateway.core.settings import Settings
from gateway.core.tenancy import TenantGate, TenantObserver
from gateway.tenants.records import ANONYMOUS_ID, Tenant
from wire import (
    CancelReason,
    CancelSignal,
    ChatMessage,
    FinalEvent,
    GenerationRequest,
    Keys,
    SamplingParams,
    scripts,
)
from wire import outcomes as script
from wire.connect import is_cluster, when_redis_answers
from wire.scripts import Bill
from wire.tenancy import UsageCounter

log = logging.getLogger("tokenspout.sessions")
_message_decoder = msgspec.json.Decoder(ChatMessage)

REQUEUE_WAIT_S = 10.0
"""How long a submit waits for Redis to take the request of a generation it has written."""
STATELESS_TTL_S = 600
"""Lifetime of the throwaway session behind one stateless API request."""
BUSY_RETRY_AFTER_S = 1
"""``Retry-After`` of a 409 ``generation_running``: a hint only (a reply may run for minutes;
a client that follows the session's stream knows exactly when it ends)."""


class SessionMeta(msgspec.Struct, frozen=True):
    """What a turn needs of its session: the model (checked live), who owns it and the
    conversation's settings."""

    model: str
    owner: str | None
    """The owner's digest (None: made without an owner cookie)."""
    settings: ConversationSettings
    by_owner: bool
    """Authorised by the owner's cookie (not the session's token)."""
    tenant: Tenant
    """Whom its turns serve (the key that made it): gateway/core/tenancy.py."""


class CreatedSession(msgspec.Struct, frozen=True):
    session_id: str
    token: str
    model: str | None = None
    """None: no worker was alive to pick the default model; the first message picks it."""


class Submitted(msgspec.Struct, frozen=True):
    generation_id: str
    session_id: str
    queued_event_id: str | None
    """None when an Idempotency-Key matched an earlier submission."""
    choices: list[str] = []
    """With ``n`` > 1: every choice's generation id, in choice order (the first is
    ``generation_id``)."""


@dataclass(frozen=True, slots=True)
class Turn:
    """A session turn on its way to the queue: its model, the tenant it serves, and the
    generation id of each of its choices (the first is the turn's own)."""

    session_id: str
    model: str
    tenant: Tenant
    generation_ids: list[str]
    kind: str = ""
    """How it changes the history first: "" a new message, ``edit <i>``, ``regenerate``,
    ``continue`` (wire/lua/submit.lua)."""
    system: str = ""
    """The conversation's system prompt, sent to the engine first."""


class CancelOutcome(msgspec.Struct, frozen=True):
    generation_id: str
    state: str
    """``cancelled``, ``done`` or ``error`` when final; ``cancelling`` while the worker aborts."""
    final: FinalEvent | None = None


class StoreObserver(TenantObserver, Protocol):
    """Told when a generation is queued or a cancel is sent, and of each key's admissions
    and refusals (gateway/server/metrics.py)."""

    def submitted(
        self, session_id: str, generation_id: str, queued_event_id: str, model: str
    ) -> None: ...

    def cancel_sent(self, session_id: str, generation_id: str, began: float) -> None: ...

    def cancel_stopped(self, generation_id: str, seconds: float) -> None: ...


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _bad_token() -> Forbidden:
    return Forbidden(
        "a valid session token is required (X-Session-Token, Authorization: Bearer or "
        "?token=, as POST /v1/sessions gave it)",
        code="bad_session_token",
    )


def unknown_generation(generation_id: str) -> NotFound:
    return NotFound(
        f"generation_id {generation_id!r} names no generation of this session",
        code="unknown_generation",
        field="generation_id",
    )


def _unknown_session(session_id: str) -> NotFound:
    return NotFound(
        f"no session {session_id!r}: it never existed, it expired (TOKENSPOUT_SESSION_TTL_S "
        "after its last message), or Redis lost it; create a new one (POST /v1/sessions)",
        code="unknown_session",
    )


def _conversation(system: str, history: list[ChatMessage]) -> list[ChatMessage]:
    """What the engine gets: the conversation's system prompt, then its history."""
    return [ChatMessage("system", system), *history] if system else history


def _check_credentials(
    session_id: str,
    stored_token: str | None,
    stored_owner: str | None,
    token: str | None,
    owner: str | None,
) -> bool:
    """404 for a session with no token stored (none), 403 unless ``token`` is its token or,
    with no token given, ``owner`` is its owner's secret (a token given is what counts: a
    wrong one is refused whatever cookie comes with it). Returns whether the owner's
    secret was what matched."""
    if stored_token is None:
        raise _unknown_session(session_id)
    if token is not None:
        if hmac.compare_digest(stored_token, _digest(token)):
            return False
    elif owner and stored_owner and hmac.compare_digest(stored_owner, _digest(owner)):
        return True
    raise _bad_token()


class SessionStore:
    def __init__(
        self, redis: aioredis.Redis, settings: Settings, observer: StoreObserver | None = None
    ) -> None:
        self.redis = redis
        self.settings = settings
        self.observer = observer
        self.keys = Keys(settings.key_prefix)
        self.models = ModelDirectory(redis, self.keys, settings)
        self.tenants = TenantGate(redis, self.keys, tenant_directory(redis, settings), observer)
        """Whom each generation serves, and its key's limits (gateway/core/tenancy.py)."""
        self._submit = scripts.Submit(redis, self.keys)
        self._cancel = scripts.Cancel(redis, self.keys)
        self._usage = UsageCounter(redis, self.keys)
        self.queue = GenerationQueue(redis, self.keys, settings, self.models)
        self.queue.weight_of = self.tenants.weight_of  # each key's share of a model's engine
        self.conversations = Conversations(redis, self.keys, settings)

    # --- sessions ------------------------------------------------------------------------

    async def create_session(
        self,
        model: str | None = None,
        owner: str | None = None,
        settings: ConversationSettings | None = None,
        title: str | None = None,
    ) -> CreatedSession:
        """A session bound to ``model`` (a name or alias; None: the default model) until a
        change of its settings, serving (and billed to) the key of the request that makes
        it; ``owner``: the owner cookie's secret, whose conversations it joins (the least
        recently updated one leaves them past ``TOKENSPOUT_MAX_CONVERSATIONS``)."""
        tenant = self.tenants.caller_tenant()
        owner_digest = _digest(owner) if owner else None
        if model:
            resolved = await self.models.resolve(model)
        else:
            try:
                resolved = await self.models.resolve(None)
            except Unavailable as exc:
                if exc.code != "no_worker":
                    raise
                resolved = ""  # no worker yet: the first message picks the default
        if resolved:
            self.tenants.check_model(tenant, model or resolved, resolved)
        session_id, token, now = new_id("s"), token_urlsafe(32), time.time()
        meta = self.keys.meta(session_id)
        fields: dict[str, Any] = {
            "token": _digest(token),
            "created": now,
            "model": resolved,
            "tenant": tenant.id,
        }
        fields.update(settings.fields() if settings else {})
        if owner_digest:
            fields["owner"] = owner_digest
        if title:
            fields["title"] = title
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(meta, mapping=fields)  # type: ignore[arg-type]
            pipe.expire(meta, self.settings.session_ttl_s)
            await pipe.execute()
        if owner_digest:
            await self.conversations.record(session_id, owner_digest, now)
        return CreatedSession(session_id, token, resolved or None)

    @staticmethod
    def owner_digest(owner: str) -> str:
        """What Redis keeps of an owner's secret (its conversations' index is named by it)."""
        return _digest(owner)

    async def session_meta(
        self, session_id: str, token: str | None, owner: str | None = None
    ) -> SessionMeta:
        """What a turn needs of the session, authorised as ``authorise`` does; its model
        checked live (then the model's own errors): a session created while no worker was
        alive takes the default model now, for good; the tenant its turns serve (401 once
        its key is revoked, 403 when the key may not use the model)."""
        meta = self.keys.meta(session_id)
        fields = ["token", "owner", "model", "tenant", "system", "temperature", "max_tokens"]
        row = [None if v is None else wire.text(v) for v in await self.redis.hmget(meta, fields)]
        stored_token, stored_owner, stored_model, tenant_id = row[:4]
        by_owner = _check_credentials(session_id, stored_token, stored_owner, token, owner)
        settings = ConversationSettings.of(dict(zip(fields[4:], row[4:], strict=True)))
        tenant = self.tenants.of_session(tenant_id)
        if stored_model:
            model = await self.models.resolve(stored_model)
        else:
            model = await self.models.resolve(None)
            await self.redis.hset(meta, "model", model)
        self.tenants.check_model(tenant, model, model)
        return SessionMeta(model, stored_owner, settings, by_owner, tenant)

    async def authorise(
        self, session_id: str, token: str | None, owner: str | None = None
    ) -> str | None:
        """404 for an unknown session, 403 unless the session's token or its owner's
        cookie (``owner``) is given. Returns the session's owner digest (None: none)."""
        stored_token, stored_owner = await self.redis.hmget(
            self.keys.meta(session_id), ["token", "owner"]
        )
        expected = None if stored_token is None else wire.text(stored_token)
        owner_digest = None if stored_owner is None else wire.text(stored_owner)
        _check_credentials(session_id, expected, owner_digest, token, owner)
        return owner_digest

    async def change(
        self,
        session_id: str,
        token: str | None,
        owner: str | None,
        fields: dict[str, str | None],
    ) -> Conversation:
        """Set a conversation's title or settings (``fields``: meta field -> value, None to
        clear it; a ``model`` must be served: its own errors else)."""
        owner_digest = await self.authorise(session_id, token, owner)
        model = fields.get("model")
        if model is not None:
            fields = {**fields, "model": await self.models.resolve(model)}
        set_fields = {name: value for name, value in fields.items() if value is not None}
        unset = [name for name, value in fields.items() if value is None and name != "model"]
        await self.conversations.change(session_id, owner_digest, set_fields, unset)
        return await self.conversations.read(session_id)

    async def delete(self, session_id: str, token: str | None, owner: str | None) -> None:
        """Delete a session: its running generation is stopped first (its worker's events
        are refused from then on: its generation's hash goes too)."""
        owner_digest = await self.authorise(session_id, token, owner)
        active = await self.redis.get(self.keys.active(session_id))
        running = [wire.text(active)] if active is not None else []
        for generation_id in running:
            await self.cancel(session_id, generation_id)
        await self.conversations.forget(session_id, owner_digest, running)

    async def history(self, session_id: str) -> list[ChatMessage]:
        raw = await self.redis.lrange(self.keys.history(session_id), 0, -1)
        return [_message_decoder.decode(item) for item in raw]

    # --- generations ---------------------------------------------------------------------

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
        first. Authorises like ``authorise``, by ``token`` or the ``owner``'s cookie (404,
        then 403).
        """
        message = ask.message
        if message is not None:
            self._check_content(message.content)
        meta = await self.session_meta(session_id, token, owner)
        params = self._with_settings(ask.sampling, meta.settings, ask.given)
        # Checked again in the script. No token never matches: a digest is never "-"; an
        # owner's cookie was checked just now (an owner never changes).
        digest = "" if meta.by_owner else _digest(token) if token is not None else "-"
        ids = [new_id("g") for _ in range(ask.n)]
        turn = Turn(session_id, meta.model, meta.tenant, ids, ask.turn, meta.settings.system)
        submitted = await self._submit_to_session(turn, message, params, idempotency_key, digest)
        if submitted.queued_event_id is not None:
            content = message.content if message is not None else ""
            await self.conversations.touched(session_id, meta.owner, content)
        return submitted

    def _with_settings(
        self, params: SamplingParams, settings: ConversationSettings, given: frozenset[str]
    ) -> SamplingParams:
        """``params`` with the conversation's temperature and max tokens where the request
        left them to it (a lowered ``TOKENSPOUT_MAX_TOKENS_LIMIT`` still caps them)."""
        changes: dict[str, Any] = {}
        if settings.temperature is not None and "temperature" not in given:
            changes["temperature"] = settings.temperature
        if settings.max_tokens is not None and "max_tokens" not in given:
            changes["max_tokens"] = min(settings.max_tokens, self.settings.max_tokens_limit)
            changes["min_tokens"] = min(params.min_tokens, changes["max_tokens"])
        return msgspec.structs.replace(params, **changes) if changes else params

    async def submit_stateless(
        self,
        ask: GenerationAsk,
        session_id: str | None = None,
        kept: KeptSession | None = None,
        choice: int = 0,
    ) -> Submitted:
        """Queue one generation in a throwaway session (the OpenAI/TGI/OIP adapters) for
        ``ask.model`` (a name or alias; None: the default model), serving the key of the
        request being served (gateway/core/tenancy.py): on one Redis in one round trip,
        SUBMIT admitting it (the capacity, the key's limits), making the session and its
        generation and queueing the request; elsewhere the checks come first.
        ``session_id``: the new session's id, when the caller subscribed to it first.
        ``kept``: a session that outlives its request (a stored response): its TTL, meta
        fields and whether it runs on with no reader. ``choice``: which of a request's
        ``n`` choices it is (only the first counts as a request and bills the prompt)."""
        tenant = self.tenants.caller_tenant()
        queue = await self.models.resolve(ask.model)
        self.tenants.check_model(tenant, ask.model or queue, queue)
        for message in ask.messages or []:
            self._check_content(message.content, allow_empty=True)
        if ask.prompt is not None:
            self._check_content(ask.prompt)
        ttl_s = kept.ttl_s if kept is not None else STATELESS_TTL_S
        session_id, generation_id = session_id or new_id("s"), new_id("g")
        request = msgspec.structs.replace(
            self._request(
                session_id, generation_id, ask.sampling, ask.messages or [], ask.prompt, ttl_s
            ),
            tools=ask.tools,
            task=ask.task,
            token_ids=ask.token_ids or [],
            tenant=tenant.id,
            choice=choice,
        )
        new = self._new_session(request, ttl_s, tenant)
        in_submit = kept is None and not is_cluster(self.redis)
        admitted = False
        if not in_submit:
            admitted = await self.tenants.admit(
                tenant, [generation_id], session_id=session_id, count_request=not choice
            )
        try:
            reply = await self._create_stateless(
                queue, new, request, kept, tenant if in_submit else None, not choice
            )
        except BaseException:
            if admitted:
                await self._give_back(tenant, [generation_id], count_request=not choice)
            raise
        if is_cluster(self.redis):
            await self.queue.enqueue(queue, request)
        if self.observer is not None:
            self.observer.submitted(session_id, generation_id, reply.queued_id, queue)
        return Submitted(generation_id, session_id, reply.queued_id)

    def _new_session(
        self, request: GenerationRequest, ttl_s: int, tenant: Tenant
    ) -> scripts.NewSession:
        """The stateless session SUBMIT makes for ``request``: its tenant billed its prompt
        and completion (another choice of a request: its completion; tokenize: nothing),
        and what its end keeps for the tenant's limits."""
        task, choice = request.task, request.choice
        bill: Bill = "none" if task != "generate" else "completion" if choice else "all"
        return scripts.NewSession(
            request.session_id,
            request.generation_id,
            self.settings.events_maxlen,
            ttl_s,
            self.watch_ttl_s,
            self._billed(tenant),
            bill,
            tenant.limits,
        )

    def _billed(self, tenant: Tenant) -> str:
        """Whom a generation's final event counts the usage of ("": nobody): its tenant's
        key; a request with no key only with ``TOKENSPOUT_ANONYMOUS_USAGE`` (else it pays
        for no bookkeeping)."""
        anonymous = tenant.id == ANONYMOUS_ID and not self.settings.anonymous_usage
        return "" if anonymous else tenant.id

    async def _create_stateless(
        self,
        queue: str,
        new: scripts.NewSession,
        request: GenerationRequest,
        kept: KeptSession | None,
        tenant: Tenant | None,
        count_request: bool,
    ) -> script.Accepted:
        """Make a stateless session with its generation and (on one Redis) queue its
        request; 429 past the capacity. On a cluster its caller queues the request.
        ``tenant``: the key whose limits SUBMIT admits too (None: admitted before)."""
        # On one Redis the SUBMIT script admits the request, makes its session and its
        # generation, and queues it: one call, every key on that node. A session kept
        # past its request is made by commands after the script, in the same pipeline,
        # which would run on a refusal too: it is admitted first, as on a cluster.
        in_order = not is_cluster(self.redis)
        if in_order and kept is None:
            limits = self.tenants.in_submit(tenant) if tenant is not None else None
            admission = await self.queue.admission(queue, request, limits, count_request)
            reply = await self._submit.create_admitted(new, admission)
            if tenant is not None and not isinstance(reply, script.OverCapacity):
                admitting = script.Admitted | script.Limited
                counts = reply.counts if isinstance(reply, admitting) else None
                self.tenants.settle(tenant, counts, count_request=count_request)  # 429?
                if isinstance(reply, script.Admitted):
                    reply = script.Accepted(reply.queued_id, [])
        else:
            await self.queue.guard_capacity(queue)
            # Admitted before, the request goes after the script: on one Redis in the same
            # pipeline (a fresh session cannot refuse it, and one Redis runs a pipeline in
            # order: no worker can take the request before its generation exists). A
            # cluster runs each node's part at once: a worker could take the request (on
            # its queue's shard) before the generation (on the session's) is written, and
            # skip it as ended, leaving its client waiting. There it goes in after the
            # reply.

            def fill(pipe: Any) -> None:
                self._submit.create_in(pipe, new)
                if kept is not None:
                    self._keep_in(pipe, new.session_id, kept)
                if in_order:
                    # Sent twice after a restarted Redis's NOSCRIPT: the first copy, with
                    # no generation to claim, is skipped by the worker that takes it.
                    self.queue.enqueue_in(pipe, queue, request)

            reply = scripts.Submit.replied((await self._run_submitting(fill, queue))[0])
        if isinstance(reply, script.OverCapacity):
            raise self.queue.overloaded(reply, queue)
        if not isinstance(reply, script.Accepted):
            raise Unavailable(f"queueing a stateless generation failed: {reply!r}")
        return reply

    def _keep_in(self, pipe: Any, session_id: str, kept: KeptSession) -> None:
        meta = self.keys.meta(session_id)
        pipe.hset(meta, mapping=kept.meta)
        pipe.expire(meta, kept.ttl_s)
        if kept.background:
            pipe.set(self.keys.keep(session_id), 1, ex=kept.ttl_s)

    async def meta_field(self, session_id: str, field: str) -> str | None:
        """One field of a session's meta hash (None: no such session or field)."""
        raw = await self.redis.hget(self.keys.meta(session_id), field)
        return None if raw is None else wire.text(raw)

    async def has_generation(self, session_id: str, generation_id: str) -> bool:
        return bool(await self.redis.exists(self.keys.generation(session_id, generation_id)))

    async def forget(self, session_id: str, generation_id: str) -> None:
        """Delete a one-generation session's keys (a deleted or unstored response)."""
        keys = self.keys
        await self.redis.delete(
            keys.meta(session_id),
            keys.history(session_id),
            keys.events(session_id),
            keys.generation(session_id, generation_id),
            keys.active(session_id),
            keys.watch(session_id),
            keys.keep(session_id),
        )

    async def _submit_to_session(
        self,
        turn: Turn,
        user_message: ChatMessage | None,
        params: SamplingParams,
        idempotency_key: str | None,
        token_digest: str,
    ) -> Submitted:
        session_id, model, generation_id = turn.session_id, turn.model, turn.generation_ids[0]
        admitted = await self._admit_turn(turn, idempotency_key)
        request = msgspec.structs.replace(
            self._request(session_id, generation_id, params, [], None, self.settings.session_ttl_s),
            tenant=turn.tenant.id,
            continue_final_message=turn.kind == "continue",
        )
        note = wire.encode(request)  # its messages: the history the script returns
        try:
            reply = await self._submit_noted(
                model,
                note,
                session_id=session_id,
                generation_id=generation_id,
                user_message=user_message,
                token_digest=token_digest,
                idempotency_key=idempotency_key,
                maxlen=self.settings.events_maxlen,
                ttl_s=self.settings.session_ttl_s,
                max_history=self.settings.max_history_messages,
                watch_ttl_s=self.watch_ttl_s,
                tenant=self._billed(turn.tenant),
                turn=turn.kind,
                limits=turn.tenant.limits,
            )
            accepted = self._accepted(turn, reply)
        except BaseException:
            if admitted:
                await self._give_back(turn.tenant, turn.generation_ids)
            raise
        if isinstance(accepted, str):  # a resend: no new generation
            if admitted:
                await self._give_back(turn.tenant, turn.generation_ids)
            await self._requeue_if_lost(session_id, model, accepted, params)
            return Submitted(accepted, session_id, None)
        request = msgspec.structs.replace(
            request, messages=_conversation(turn.system, accepted.history)
        )
        await self._enqueue_written(model, request, note)
        if self.observer is not None:
            self.observer.submitted(session_id, generation_id, accepted.queued_id, model)
        for choice in range(1, len(turn.generation_ids)):
            await self._submit_choice(turn, request, choice)
        choices = turn.generation_ids if len(turn.generation_ids) > 1 else []
        return Submitted(generation_id, session_id, accepted.queued_id, choices)

    async def _admit_turn(self, turn: Turn, idempotency_key: str | None) -> bool:
        """Room for every choice of the turn (the capacity checks count each other), then
        the admission of its key (``TenantGate.admit``): whether the key's counts took it."""
        idem = self.keys.idempotency(turn.session_id, idempotency_key) if idempotency_key else ""
        try:
            for _ in turn.generation_ids:
                await self.queue.guard_capacity(turn.model)
            return await self.tenants.admit(
                turn.tenant, turn.generation_ids, session_id=turn.session_id
            )
        except Overloaded:  # the capacity, or a limit of the key (RateLimited)
            # A retried POST whose generation exists takes no new capacity: it must get
            # that generation back (from the script, after the token check), not a 429.
            if not (idem and await self.redis.exists(idem)):
                raise
            return False

    def _accepted(self, turn: Turn, reply: script.SubmitReply) -> script.Accepted | str:
        """SUBMIT's answer to a turn: accepted, or the generation an Idempotency-Key made
        before (its id); every other answer as the gateway's error (``_refusal``)."""
        match reply:
            case script.Accepted():
                return reply
            case script.Duplicate(generation_id=earlier):
                return earlier
        raise self._refusal(reply, turn.session_id, turn.model)

    def _refusal(self, reply: script.SubmitReply, session_id: str, model: str) -> GatewayError:
        """What a client is told when SUBMIT refused a session turn."""
        match reply:
            case script.SessionMissing():
                return _unknown_session(session_id)
            case script.Forbidden():
                return _bad_token()
            case script.Busy(generation_id=running):
                return Conflict(
                    f"generation {running} is still running in this session",
                    code="generation_running",
                    retry_after_s=BUSY_RETRY_AFTER_S,
                )
            case script.HistoryFull():
                return BadRequest(
                    f"the session holds {self.settings.max_history_messages} messages, the "
                    "limit set by TOKENSPOUT_MAX_HISTORY_MESSAGES; start a new session",
                    code="history_full",
                )
            case script.OverCapacity():  # not asked to admit here (guard_capacity did)
                return self.queue.overloaded(reply, model)
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

    async def _give_back(
        self, tenant: Tenant, generation_ids: list[str], *, count_request: bool = True
    ) -> None:
        """What the key's admission took, for generations that were not queued after all;
        given back even when the request is being cancelled (its client left)."""
        with anyio.CancelScope(shield=True):
            await self.tenants.release(tenant, generation_ids, count_request=count_request)

    async def _submit_choice(self, turn: Turn, first: GenerationRequest, choice: int) -> None:
        """Queue another choice of the turn ``first`` began: the same conversation, its
        own seed; it is not the session's running generation and never joins the history,
        and its prompt is billed with the first choice's."""
        session_id, generation_id = turn.session_id, turn.generation_ids[choice]
        request = msgspec.structs.replace(
            first,
            generation_id=generation_id,
            params=first.params.for_choice(choice),
            choice=choice,
            enqueued_at=time.time(),
        )
        note = wire.encode(msgspec.structs.replace(request, messages=[]))
        reply = await self._submit_noted(
            turn.model,
            note,
            session_id=session_id,
            generation_id=generation_id,
            user_message=None,
            token_digest="",
            idempotency_key=None,
            maxlen=self.settings.events_maxlen,
            ttl_s=self.settings.session_ttl_s,
            max_history=self.settings.max_history_messages,
            watch_ttl_s=self.watch_ttl_s,
            choice=choice,
            tenant=self._billed(turn.tenant),
            bill="completion",
            limits=turn.tenant.limits,
        )
        if not isinstance(reply, script.Accepted):  # the session was there a moment ago
            await self._give_back(turn.tenant, [generation_id], count_request=False)
            raise Unavailable(f"queueing choice {choice} failed: {reply!r}")
        await self._enqueue_written(turn.model, request, note)
        if self.observer is not None:
            self.observer.submitted(session_id, generation_id, reply.queued_id, turn.model)

    async def _submit_noted(self, model: str, note: bytes, **submit: Any) -> script.SubmitReply:
        """The SUBMIT script (``submit``: its arguments), after a note that the turn's
        request is on its way to ``model``'s queue (``RequestQueue.note_submitting``): should
        this process die before queueing it, the reaper does (``queue_stranded``). One
        Redis runs them as one pipeline, the note first. A cluster runs a pipeline's nodes
        at once, so there the note is a round trip of its own, before."""
        queue = self.queue.of(model)
        submit = {**submit, "note": note, "queue": model}  # kept with the generation too
        if is_cluster(self.redis):
            await queue.note_submitting(note)
            return await self._submit(**submit)

        def fill(pipe: Any) -> None:
            queue.note_submitting_in(pipe, note)
            self._submit.submit_in(pipe, **submit)

        return scripts.Submit.replied((await self._run_submitting(fill))[-1])

    async def _run_submitting(
        self, fill: Callable[[Any], None], enqueuing: str | None = None
    ) -> list[Any]:
        """Run a pipeline that ``fill`` fills, a bare SUBMIT among its commands (and the
        queue's submit to model ``enqueuing``'s queue, if it names one). A Redis that lost
        its scripts (a restart) gets them loaded and the pipeline again: the other commands
        of the first one ran, and run again, so they must not mind."""
        for attempt in (1, 2):
            try:
                async with self.redis.pipeline(transaction=False) as pipe:
                    fill(pipe)
                    return list(await pipe.execute())
            except NoScriptError:
                if attempt == 2:
                    raise
                await self._submit.load()
                if enqueuing is not None:
                    await self.queue.load_scripts(enqueuing)
        raise AssertionError("unreachable")

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
                retry_after_s=1,
            ) from None

    async def _requeue_if_lost(
        self, session_id: str, model: str, generation_id: str, params: SamplingParams
    ) -> None:
        """A message sent again with its Idempotency-Key: if its generation is still
        waiting for a worker, its request may never have reached the queue (the gateway
        died, or Redis went away, between the two round trips of the first send), so it is
        queued again; a second copy runs once. One round trip more, on retries only."""
        if not await self.still_queued(session_id, generation_id):
            return
        request = self._request(
            session_id, generation_id, params, [], None, self.settings.session_ttl_s
        )
        await self._enqueue_written(model, await self.with_turn(request))

    async def still_queued(self, session_id: str, generation_id: str) -> bool:
        state = await self.redis.hget(self.keys.generation(session_id, generation_id), "state")
        return state is not None and wire.text(state) == "queued"

    async def with_turn(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` with the conversation its turn answers: the session's history up to
        its last user message (another choice of the turn may have added its reply since),
        or all of it for a turn that continues the last message; its system prompt first."""
        history = await self.history(request.session_id)
        if not request.continue_final_message:
            last_user = max((i for i, m in enumerate(history) if m.role == "user"), default=-1)
            history = history[: last_user + 1]
        system = await self.meta_field(request.session_id, "system")
        return msgspec.structs.replace(request, messages=_conversation(system or "", history))

    def _request(
        self,
        session_id: str,
        generation_id: str,
        params: SamplingParams,
        messages: list[ChatMessage],
        prompt: str | None,
        ttl_s: int,
    ) -> GenerationRequest:
        """What the engine gets: the conversation (or prompt) to continue, and how."""
        return GenerationRequest(
            generation_id=generation_id,
            session_id=session_id,
            params=params,
            messages=messages,
            prompt=prompt,
            enqueued_at=time.time(),
            session_ttl_s=ttl_s,
            events_maxlen=self.settings.events_maxlen,
        )

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

    async def cancel(
        self, session_id: str, generation_id: str, reason: CancelReason = "user"
    ) -> CancelOutcome:
        """Stop a generation wherever it runs; idempotent (a final one reports its end)."""
        began = time.monotonic()
        reply = await self._cancel(
            session_id=session_id,
            generation_id=generation_id,
            reason=reason,
            maxlen=self.settings.events_maxlen,
            ttl_s=self.settings.session_ttl_s,
        )
        match reply:
            case script.UnknownGeneration():
                raise unknown_generation(generation_id)
            case script.EndedBefore(final=final):
                return CancelOutcome(generation_id, wire.final_state(final), final)
            case script.CancelledQueued(final=final):
                await self._usage.after_final(session_id, generation_id)  # a cluster's
                if self.observer is not None:
                    self.observer.cancel_stopped(generation_id, time.monotonic() - began)
                # Its usage: zero, or what it streamed before a takeover queued it again.
                return CancelOutcome(generation_id, "cancelled", final)
        if self.observer is not None:
            self.observer.cancel_sent(session_id, generation_id, began)
        await self.queue.signal_cancel(CancelSignal(generation_id, session_id, reason))
        return CancelOutcome(generation_id, "cancelling")

    async def generation_end(self, session_id: str, generation_id: str) -> tuple[str, str | None]:
        """The generation's state, and the id of its final event (None while it runs); 404
        for a generation the session does not have."""
        key = self.keys.generation(session_id, generation_id)
        state, final_id = await self.redis.hmget(key, "state", "final_id")
        if state is None:
            raise unknown_generation(generation_id)
        return wire.text(state), None if final_id is None else wire.text(final_id)

    @property
    def watch_ttl_s(self) -> int:
        """Lifetime of a session's watch mark: the grace plus the refresh interval (a third
        of it), so a generation is abandoned no sooner than the grace after its last reader
        left, and no later than 4/3 of it (plus a worker's 1 s check)."""
        return math.ceil(self.settings.abandon_grace_s * 4 / 3)

    async def mark_watched(self, session_ids: list[str]) -> None:
        """Tell workers these sessions have a reader (see abandonment in engine/worker.py)."""
        ttl = self.watch_ttl_s
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id in session_ids:
                pipe.set(self.keys.watch(session_id), 1, ex=ttl)
            await pipe.execute()
