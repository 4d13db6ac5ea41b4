"""A person's conversations: the sessions one owner made, listed, renamed, set, deleted.

The owner is a browser: the gateway gives it a random secret in an HttpOnly cookie when it
creates a session for a request that has none (gateway/apis/sessions/routes.py) and keeps
only the secret's digest, on each session it creates (meta ``owner``) and as the name of
the owner's index (wire/keys.py ``owner``: session id -> last update). A conversation's
title and settings (model, system prompt, temperature, max tokens) are fields of its meta
hash; its messages are the session's history, as for any session.

The index is bounded (``TOKENSPOUT_MAX_CONVERSATIONS``): past it, the conversation updated
least recently leaves the list (its session lives on until its TTL, reachable by its id and
token). Never a refusal: a program whose HTTP client keeps cookies (httpx, requests'
Session) is an owner too, and its thousandth session must not fail. The index lives as long
as a session does; a session that expired leaves its id in the index until the owner's
next list drops it.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import redis.asyncio as aioredis

import wire
from gateway.core.errors import BadRequest
from gateway.core.settings import Settings
from wire import Keys

TITLE_MAX_CHARS = 120
"""The longest title a conversation takes (PATCH); longer ones are refused (422)."""
AUTO_TITLE_CHARS = 60
"""A conversation without a title takes the start of its first message, this long at most."""
SETTINGS_FIELDS = ("system", "temperature", "max_tokens")
_FIELDS = ["title", "model", "created", "updated", *SETTINGS_FIELDS]


class Conversation(msgspec.Struct, frozen=True):
    """What a list or a read shows of one conversation (never its token)."""

    session_id: str
    title: str
    model: str | None
    created: float
    updated: float
    system: str = ""
    """Its system prompt ("" for none): the engine gets it before the messages."""
    temperature: float | None = None
    """None: each message's own, else the gateway's default."""
    max_tokens: int | None = None


class ConversationSettings(msgspec.Struct, frozen=True):
    """The settings a conversation applies to every turn a request leaves them to."""

    system: str = ""
    temperature: float | None = None
    max_tokens: int | None = None

    @classmethod
    def of(cls, fields: dict[str, str | None]) -> ConversationSettings:
        temperature, max_tokens = fields.get("temperature"), fields.get("max_tokens")
        return cls(
            fields.get("system") or "",
            float(temperature) if temperature else None,
            int(max_tokens) if max_tokens else None,
        )

    def fields(self) -> dict[str, str]:
        """As meta hash fields (the ones set; an unset one is deleted)."""
        values = {"system": self.system, "temperature": self.temperature}
        values["max_tokens"] = self.max_tokens
        return {name: str(value) for name, value in values.items() if value not in (None, "")}


def auto_title(content: str) -> str:
    """A title from a first message: its first line, cut at a word near ``AUTO_TITLE_CHARS``."""
    line = next((line.strip() for line in content.splitlines() if line.strip()), "")
    if len(line) <= AUTO_TITLE_CHARS:
        return line
    cut = line[:AUTO_TITLE_CHARS].rsplit(" ", 1)[0] or line[:AUTO_TITLE_CHARS]
    return cut.rstrip(" ,.;:") + "…"


def check_title(title: str) -> str:
    title = title.strip()
    if not title or len(title) > TITLE_MAX_CHARS:
        raise BadRequest(
            f"title must be 1 to {TITLE_MAX_CHARS} characters (it has {len(title)})",
            code="bad_title",
            field="title",
        )
    return title


class Conversations:
    """The owners' indexes and a conversation's own fields; ``Sessions`` authorises."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, settings: Settings) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings

    async def record(self, session_id: str, owner: str, at: float) -> None:
        """``session_id`` joins its owner's index (its meta names the owner already), and
        the least recently updated beyond ``TOKENSPOUT_MAX_CONVERSATIONS`` leave it."""
        index = self.keys.owner(owner)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(index, {session_id: at})
            pipe.zremrangebyrank(index, 0, -self.settings.max_conversations - 1)
            pipe.expire(index, self.settings.session_ttl_s)
            await pipe.execute()

    async def touched(self, session_id: str, owner: str | None, content: str) -> None:
        """A turn was queued: the conversation moves to the top of its owner's list, and
        takes its first message's start as its title if it has none."""
        now = time.time()
        meta = self.keys.meta(session_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(meta, "updated", now)
            if content:
                pipe.hsetnx(meta, "title", auto_title(content))
            if owner:
                pipe.zadd(self.keys.owner(owner), {session_id: now})
                pipe.expire(self.keys.owner(owner), self.settings.session_ttl_s)
            await pipe.execute()

    async def of_owner(self, owner: str) -> list[Conversation]:
        """The owner's conversations that still exist, the latest updated first."""
        index = self.keys.owner(owner)
        ids = [wire.text(raw) for raw in await self.redis.zrevrange(index, 0, -1)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hmget(self.keys.meta(session_id), _FIELDS)
            rows = await pipe.execute()
        found, gone = [], []
        for session_id, row in zip(ids, rows, strict=True):
            if row[2] is None:  # no ``created``: expired or deleted
                gone.append(session_id)
            else:
                found.append(self.conversation(session_id, row))
        if gone:
            await self.redis.zrem(index, *gone)
        return found

    def conversation(self, session_id: str, row: list[Any]) -> Conversation:
        """A conversation from its meta fields (``_FIELDS``, in order)."""
        fields = dict(zip(_FIELDS, (None if v is None else wire.text(v) for v in row), strict=True))
        settings = ConversationSettings.of(fields)
        created = float(fields["created"] or 0)
        return Conversation(
            session_id,
            fields["title"] or "",
            fields["model"] or None,
            created,
            float(fields["updated"] or created),
            settings.system,
            settings.temperature,
            settings.max_tokens,
        )

    async def read(self, session_id: str) -> Conversation:
        return self.conversation(
            session_id, await self.redis.hmget(self.keys.meta(session_id), _FIELDS)
        )

    async def change(
        self,
        session_id: str,
        owner: str | None,
        set_fields: dict[str, str],
        unset: list[str],
    ) -> None:
        """Set and delete fields of a conversation (it exists: the caller authorised it)."""
        meta, now = self.keys.meta(session_id), time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            mapping: dict[Any, Any] = {**set_fields, "updated": now}
            pipe.hset(meta, mapping=mapping)
            if unset:
                pipe.hdel(meta, *unset)
            if owner:
                pipe.zadd(self.keys.owner(owner), {session_id: now})
            await pipe.execute()

    async def forget(self, session_id: str, owner: str | None, running: list[str]) -> None:
        """Delete a conversation's keys and its ``running`` generations' (so their workers'
        events are refused). Its ended generations' hashes and idempotency keys end with
        their TTL: no one can reach them without the session."""
        keys = self.keys
        await self.redis.delete(
            keys.meta(session_id),
            keys.history(session_id),
            keys.events(session_id),
            keys.active(session_id),
            keys.watch(session_id),
            keys.keep(session_id),
            *(keys.generation(session_id, generation_id) for generation_id in running),
        )
        if owner:
            await self.redis.zrem(keys.owner(owner), session_id)
