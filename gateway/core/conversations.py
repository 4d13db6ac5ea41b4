"""A person's conversations: the sessions one owner made, listed, renamed, set, deleted.

The owner is a browser: the gateway gives it a random secret in an HttpOnly cookie when it
creates a session for a request that has none (gateway/apis/sessions/routes.py) and keeps
only the secret's digest, on each session it creates (meta ``owner``) and as the name of
the owner's index (wire/keys.py ``owner``: session id -> last update). A conversation's
title and settings (model, system prompt, temperature, max tokens) are fields of its meta
hash; its messages are the session's history, as for any session.

Beside its history, a conversation keeps its record (wire/keys.py ``replies``, ``versions``,
written by the scripts that queue a turn and end a reply): how each reply ended, what a
regenerate or an edit replaced, and where the running reply's events begin, so a page
opened anywhere shows a conversation as the tab that watched it did (``ConversationRecord``).

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
from redis.exceptions import ResponseError

import wire
from gateway.core.errors import BadRequest
from gateway.core.settings import Settings
from wire import ChatMessage, FinalEvent, Keys, entry_ms
from wire.library import lost_scripts
from wire.scripts import Touch

TITLE_MAX_CHARS = 120
"""The longest title a conversation takes (PATCH); longer ones are refused (422)."""
AUTO_TITLE_CHARS = 60
"""A conversation without a title takes the start of its first message, this long at most."""
SETTINGS_FIELDS = ("system", "temperature", "max_tokens")
NAMED = "named"
"""The meta field that says a person gave the title (at creation, or a rename): it no
longer follows the first message (wire/lua/touch.lua reads it too)."""
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


class ReplyRecord(msgspec.Struct, frozen=True):
    """How one reply of the conversation ended, kept with it."""

    at: int
    """Its message's index in ``messages`` (``len(messages)``: it left no message, as a
    reply that failed or was stopped before its first token)."""
    generation_id: str
    model: str
    final: FinalEvent
    """Its final event: ``done`` (with ``finish_reason``: ``length`` means it reached its
    token limit, and ``continue`` extends it), ``cancelled`` (with ``reason``) or ``error``."""
    turn: str = ""
    """What made it: "" a message, ``edit <i>``, ``regenerate``, ``continue``."""
    takeovers: int = 0
    """How many times another engine worker took it over."""
    seconds: float = 0.0
    """From its ``queued`` event to its final one."""


class Version(msgspec.Struct, frozen=True):
    """What a regenerate or an edit replaced: the history from message ``at`` on, as it was."""

    at: int
    turn: str
    messages: list[ChatMessage]
    replies: list[ReplyRecord]


class RunningReply(msgspec.Struct, frozen=True):
    """The reply running now, and where its events begin: a reader that opens the event
    stream after ``after`` (from its beginning when None) gets all of it."""

    generation_id: str
    turn: str
    after: str | None


class ConversationRecord(msgspec.Struct, frozen=True):
    """A conversation as one read of Redis saw it: its messages and their replies' endings,
    the earlier versions, the reply running (its message not in ``messages`` yet: a
    continue's is its last one, still short), and the stream's last event then."""

    messages: list[ChatMessage]
    replies: list[ReplyRecord]
    versions: list[Version]
    running: RunningReply | None
    last_event_id: str | None


class _StoredReply(msgspec.Struct, frozen=True):
    """A ``replies`` entry as wire/lua/emit_core.lua writes it."""

    generation_id: str
    model: str
    final: FinalEvent
    queued_id: str = ""
    final_id: str = ""
    turn: str = ""
    takeovers: int = 0

    def at(self, index: int) -> ReplyRecord:
        took = (entry_ms(self.final_id) - entry_ms(self.queued_id)) / 1000 if self.queued_id else 0
        return ReplyRecord(
            index, self.generation_id, self.model, self.final, self.turn, self.takeovers, took
        )


class _StoredVersion(msgspec.Struct, frozen=True):
    """A ``versions`` entry as wire/lua/submit.lua writes it (its ``versions``: those of
    the branch it cut, kept, not shown)."""

    at: int
    turn: str
    messages: list[ChatMessage]
    replies: dict[str, _StoredReply]

    def shown(self) -> Version:
        return Version(self.at, self.turn, self.messages, _replies(self.replies))


_stored_reply = msgspec.json.Decoder(_StoredReply)
_stored_version = msgspec.json.Decoder(_StoredVersion)
_message = msgspec.json.Decoder(ChatMessage)


def _replies(stored: dict[str, _StoredReply]) -> list[ReplyRecord]:
    return sorted((reply.at(int(at)) for at, reply in stored.items()), key=lambda r: r.at)


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
        self._touch = Touch(redis, keys)

    async def record(self, session_id: str, owner: str, at: float) -> None:
        """``session_id`` joins its owner's index (its meta names the owner already), and
        the least recently updated beyond ``TOKENSPOUT_MAX_CONVERSATIONS`` leave it."""
        index = self.keys.owner(owner)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zadd(index, {session_id: at})
            pipe.zremrangebyrank(index, 0, -self.settings.max_conversations - 1)
            pipe.expire(index, self.settings.session_ttl_s)
            await pipe.execute()

    async def touched(
        self, session_id: str, owner: str | None, content: str, *, first: bool = False
    ) -> None:
        """A turn was queued: the conversation moves to the top of its owner's list, and
        takes its first message's start as its title if it has none; ``first``: the turn
        replaced the first message, whose start the title follows unless a person gave it."""
        now = time.time()
        title = auto_title(content) if content else ""
        for last_try in (False, True):
            async with self.redis.pipeline(transaction=False) as pipe:
                # Not the meta of a session Redis lost since (its readers are told so); its
                # owner's list keeps the id until the next list drops it.
                await self._touch(
                    session_id=session_id, now=now, title=title, follows=first, pipe=pipe
                )
                if owner:
                    pipe.zadd(self.keys.owner(owner), {session_id: now})
                    pipe.expire(self.keys.owner(owner), self.settings.session_ttl_s)
                try:
                    await pipe.execute()
                    return
                except ResponseError as exc:  # Redis lost its scripts (a restart): load, again
                    if last_try or not lost_scripts(exc):
                        raise
                    await self._touch.load()

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
        named = {NAMED: 1} if "title" in set_fields else {}
        async with self.redis.pipeline(transaction=False) as pipe:
            mapping: dict[Any, Any] = {**set_fields, **named, "updated": now}
            pipe.hset(meta, mapping=mapping)
            if unset:
                pipe.hdel(meta, *unset)
            if owner:
                pipe.zadd(self.keys.owner(owner), {session_id: now})
            await pipe.execute()

    async def record_of(self, session_id: str) -> ConversationRecord:
        """Its messages, record and running reply, read together (one transaction: a reply
        that ends meanwhile is either in the messages or running, never both nor neither)."""
        keys = self.keys
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.lrange(keys.history(session_id), 0, -1)
            pipe.hgetall(keys.replies(session_id))
            pipe.lrange(keys.versions(session_id), 0, -1)
            pipe.get(keys.active(session_id))
            pipe.xrevrange(keys.events(session_id), count=1)
            history, replies, versions, active, last = await pipe.execute()
        stored = {wire.text(at): _stored_reply.decode(raw) for at, raw in replies.items()}
        last_entries = wire.entries_of(last)
        return ConversationRecord(
            [_message.decode(raw) for raw in history],
            _replies(stored),
            [_stored_version.decode(raw).shown() for raw in versions],
            await self._running(session_id, wire.text(active)) if active else None,
            last_entries[0][0].decode() if last_entries else None,
        )

    async def _running(self, session_id: str, generation_id: str) -> RunningReply:
        """The running reply, and the event id just before its ``queued`` event (one still
        kept: a reader resuming there finds no gap)."""
        gen = self.keys.generation(session_id, generation_id)
        queued_id, turn = await self.redis.hmget(gen, ["queued_id", "turn"])
        after = None
        if queued_id is not None:
            before = await self.redis.xrevrange(
                self.keys.events(session_id), max=f"({wire.text(queued_id)}", min="-", count=1
            )
            entries = wire.entries_of(before)
            after = entries[0][0].decode() if entries else None
        return RunningReply(generation_id, wire.text(turn) if turn else "", after)

    async def forget(self, session_id: str, owner: str | None, running: list[str]) -> None:
        """Delete a conversation's keys and its ``running`` generations' (so their workers'
        events are refused). Its ended generations' hashes and idempotency keys end with
        their TTL: no one can reach them without the session."""
        keys = self.keys
        await self.redis.delete(
            keys.meta(session_id),
            keys.history(session_id),
            keys.replies(session_id),
            keys.versions(session_id),
            keys.events(session_id),
            keys.active(session_id),
            keys.watch(session_id),
            keys.keep(session_id),
            *(keys.generation(session_id, generation_id) for generation_id in running),
        )
        if owner:
            await self.redis.zrem(keys.owner(owner), session_id)
