"""Sessions in Redis: create one, authorise a request for it, read its history, change
or forget its conversation.

``Sessions`` owns a session's own keys (its meta, history, events' reading, watch marks);
what is submitted to a session and cancelled in it is the submitter's
(gateway/core/store/submitter.py), whose turns ask here what a turn needs (``session_meta``) and
the conversation it answers (``with_turn``).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from typing import Any

import msgspec
import redis.asyncio as aioredis

import wire
from gateway.core.conversations import (
    NAMED,
    Conversation,
    Conversations,
    ConversationSettings,
)
from gateway.core.errors import Forbidden, NotFound, Unavailable
from gateway.core.ids import new_id, token_urlsafe
from gateway.core.settings import Settings
from gateway.core.store.admission import Admission
from gateway.core.store.models import ModelDirectory
from gateway.tenants.caller import Caller
from gateway.tenants.records import Tenant
from wire import ChatMessage, GenerationRequest, Keys

_message_decoder = msgspec.json.Decoder(ChatMessage)


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
    """Whom its turns serve (the key that made it): gateway/core/store/admission.py."""


class CreatedSession(msgspec.Struct, frozen=True):
    session_id: str
    token: str
    model: str | None = None
    """None: no worker was alive to pick the default model; the first message picks it."""


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bad_token() -> Forbidden:
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


def unknown_session(session_id: str) -> NotFound:
    return NotFound(
        f"no session {session_id!r}: it never existed, it expired (TOKENSPOUT_SESSION_TTL_S "
        "after its last message), or Redis lost it; create a new one (POST /v1/sessions)",
        code="unknown_session",
    )


def conversation(system: str, history: list[ChatMessage]) -> list[ChatMessage]:
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
        raise unknown_session(session_id)
    if token is not None:
        if hmac.compare_digest(stored_token, digest(token)):
            return False
    elif owner and stored_owner and hmac.compare_digest(stored_owner, digest(owner)):
        return True
    raise bad_token()


class Sessions:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: Settings,
        models: ModelDirectory,
        admission: Admission,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.models = models
        self.admission = admission
        """Whom a session serves, and whether its key may use the model."""
        self.conversations = Conversations(redis, keys, settings)

    async def create_session(
        self,
        caller: Caller,
        model: str | None = None,
        owner: str | None = None,
        settings: ConversationSettings | None = None,
        title: str | None = None,
    ) -> CreatedSession:
        """A session bound to ``model`` (a name or alias; None: the default model) until a
        change of its settings, serving (and billed to) ``caller``'s key; ``owner``: the
        owner cookie's secret, whose conversations it joins (the least recently updated
        one leaves them past ``TOKENSPOUT_MAX_CONVERSATIONS``)."""
        tenant = caller.tenant
        owner_digest = digest(owner) if owner else None
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
            self.admission.check_model(tenant, model or resolved, resolved)
        session_id, token, now = new_id("s"), token_urlsafe(32), time.time()
        meta = self.keys.meta(session_id)
        fields: dict[str, Any] = {
            "token": digest(token),
            "created": now,
            "model": resolved,
            "tenant": tenant.id,
        }
        fields.update(settings.fields() if settings else {})
        if owner_digest:
            fields["owner"] = owner_digest
        if title:
            fields["title"] = title
            fields[NAMED] = 1
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
        return digest(owner)

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
        tenant = self.admission.of_session(tenant_id)
        if stored_model:
            model = await self.models.resolve(stored_model)
        else:
            model = await self.models.resolve(None)
            await self.redis.hset(meta, "model", model)
        self.admission.check_model(tenant, model, model)
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

    async def running(self, session_id: str) -> list[str]:
        """The generation that runs in the session now (none, or one)."""
        active = await self.redis.get(self.keys.active(session_id))
        return [wire.text(active)] if active is not None else []

    async def history(self, session_id: str) -> list[ChatMessage]:
        raw = await self.redis.lrange(self.keys.history(session_id), 0, -1)
        return [_message_decoder.decode(item) for item in raw]

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

    async def generation_state(self, session_id: str, generation_id: str) -> str | None:
        """Its state (``queued``, ``running``, ...); None while no such generation exists."""
        state = await self.redis.hget(self.keys.generation(session_id, generation_id), "state")
        return None if state is None else wire.text(state)

    async def with_turn(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` with the conversation its turn answers: the session's history up to
        its last user message (another choice of the turn may have added its reply since),
        or all of it for a turn that continues the last message; its system prompt first."""
        history = await self.history(request.session_id)
        if not request.continue_final_message:
            last_user = max((i for i, m in enumerate(history) if m.role == "user"), default=-1)
            history = history[: last_user + 1]
        system = await self.meta_field(request.session_id, "system")
        return msgspec.structs.replace(request, messages=conversation(system or "", history))

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
