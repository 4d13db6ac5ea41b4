"""A model's generation queue: its ``requests`` stream and the consumer group on it.

The one owner of the consumer group's commands, for everyone who uses it: gateways add
requests (and read the queue's depth), workers take, acknowledge and give back, the
gateways' reaper claims what a lost worker left pending and puts it on the queue again.
Beside it, the notes of session turns on their way to it (``note_submitting``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError, ResponseError

from wire.connect import on_key_node
from wire.keys import CONSUMER_GROUP, SHARED_KEY_TTL_S, Keys
from wire.replies import StreamEntry, entries_of, read_entries, text

Fields = Mapping[bytes, bytes] | Mapping[str, bytes]


def _missing(exc: RedisError) -> bool:
    """The stream or its group does not exist (nothing queued yet, or Redis lost it)."""
    message = str(exc).lower()
    return "no such key" in message or "nogroup" in message


@dataclass(frozen=True, slots=True)
class QueueLook:
    """What the reaper's pass found in one queue: whether each of its duties has anything
    to do there. ``True`` also when a reply could not tell (the duty reads for itself)."""

    pending: bool
    """Requests taken and not acknowledged (a lost worker's, maybe)."""
    waiting: bool
    """Requests no worker took yet (past their deadline, maybe)."""
    noted: bool
    """Session turns noted on their way here long enough ago (stranded, maybe)."""


def _some_pending(summary: object) -> bool:
    if isinstance(summary, RedisError):
        return not _missing(summary)
    return not isinstance(summary, dict) or bool(summary.get("pending"))


def _workers_group(groups: object) -> dict[str, Any] | None:
    """The workers' consumer group in an XINFO GROUPS reply (None: not created yet)."""
    for group in groups if isinstance(groups, list) else []:
        if text(group["name"]) == CONSUMER_GROUP:
            return cast(dict[str, Any], group)
    return None


def _none_waiting(group: dict[str, Any]) -> bool:
    """Every request was delivered: the group's lag, entries not yet delivered, is 0 (nil
    when Redis cannot tell, after a trim)."""
    return group.get("lag") == 0


def _some_waiting(groups: object) -> bool:
    """As ``RequestQueue.waiting_after`` sees it: a stream with no group yet has only
    waiting requests."""
    if isinstance(groups, RedisError):
        return not _missing(groups)
    group = _workers_group(groups)
    return group is None or not _none_waiting(group)


class RequestQueue:
    def __init__(self, redis: aioredis.Redis, keys: Keys, model: str) -> None:
        self.redis = redis
        self.model = model
        self.key = keys.requests(model)
        self.submitting_key = keys.submitting(model)

    # --- gateways and the reaper ---------------------------------------------------------

    async def add(
        self, fields: Fields, *, maxlen: int | None = None, submitted: bytes | None = None
    ) -> None:
        """Queue a request (capped at about ``maxlen``), renewing the stream's TTL in the
        same round trip (``SHARED_KEY_TTL_S``); ``submitted``: the note ``note_submitting``
        made of it, crossed off after it (on the same node, in order: a request is never
        crossed off without being queued)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(self.key, fields, maxlen=maxlen, approximate=True)  # type: ignore[arg-type]
            pipe.expire(self.key, SHARED_KEY_TTL_S)
            if submitted is not None:
                pipe.zrem(self.submitting_key, submitted)
            await pipe.execute()

    def add_in(self, pipe: Pipeline, fields: Fields, *, maxlen: int | None = None) -> None:
        """``add`` queued in ``pipe``: after what the caller queued there first on one
        Redis; on a cluster each node's part runs at once, so not after anything there."""
        pipe.xadd(self.key, fields, maxlen=maxlen, approximate=True)  # type: ignore[arg-type]
        pipe.expire(self.key, SHARED_KEY_TTL_S)

    def note_submitting_in(self, pipe: Pipeline, note: bytes) -> None:
        """Note in ``pipe`` a session turn whose request is on its way here: its gateway
        writes the generation, then queues the request; ``add`` crosses the note off. A
        note left over (the gateway died between the two) is the reaper's to queue."""
        pipe.zadd(self.submitting_key, {note: time.time()})
        pipe.expire(self.submitting_key, SHARED_KEY_TTL_S)

    async def note_submitting(self, note: bytes) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            self.note_submitting_in(pipe, note)
            await pipe.execute()

    async def submitting_since(self, before_s: float, count: int) -> list[bytes]:
        """Notes made before ``before_s`` (unix seconds) and not crossed off, oldest first."""
        notes = await self.redis.zrangebyscore(self.submitting_key, "-inf", before_s, 0, count)
        return [note if isinstance(note, bytes) else text(note).encode() for note in notes]

    async def cross_off(self, note: bytes) -> None:
        await self.redis.zrem(self.submitting_key, note)

    async def pending_consumers(self) -> list[str]:
        """The consumers that hold unacknowledged requests."""
        try:
            summary = await self.redis.xpending(self.key, CONSUMER_GROUP)
        except RedisError as exc:
            if _missing(exc):
                return []
            raise
        if not summary["pending"]:
            return []
        return [text(consumer["name"]) for consumer in summary["consumers"]]

    async def pending_of(self, consumer: str, idle_ms: int | None = None) -> list[tuple[str, int]]:
        """(entry id, ms since delivered) of what ``consumer`` holds (idle that long, if
        given), up to 500."""
        pending = await self.redis.xpending_range(
            self.key,
            CONSUMER_GROUP,
            min="-",
            max="+",
            count=500,
            consumername=consumer,
            idle=idle_ms,
        )
        return [(text(p["message_id"]), int(p["time_since_delivered"])) for p in pending]

    async def claim(self, consumer: str, idle_ms: int, entry_id: str) -> list[StreamEntry]:
        """Take an entry over for ``consumer`` if it is still idle ``idle_ms``."""
        reply = await self.redis.xclaim(self.key, CONSUMER_GROUP, consumer, idle_ms, [entry_id])
        return entries_of(reply)

    async def forget_consumer(self, consumer: str) -> None:
        await self.redis.xgroup_delconsumer(self.key, CONSUMER_GROUP, consumer)

    async def waiting_after(self) -> str | None:
        """Where the requests no worker took yet begin: the group's last-delivered id (""
        if there is no group: the whole stream); None when none waits (no stream, or the
        group's lag is 0: the reaper's idle pass reads no further)."""
        try:
            groups = await self.redis.xinfo_groups(self.key)
        except ResponseError as exc:
            if "no such key" in str(exc).lower():
                return None
            raise
        group = _workers_group(groups)
        if group is None:
            return ""
        return None if _none_waiting(group) else text(group["last-delivered-id"])

    async def read_after(self, after_id: str, count: int) -> list[StreamEntry]:
        """Entries after ``after_id`` ("": from the first), delivered or not."""
        start = f"({after_id}" if after_id else "-"
        return entries_of(await self.redis.xrange(self.key, min=start, count=count))

    # --- workers -------------------------------------------------------------------------

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream) unless it exists."""
        try:
            await self.redis.xgroup_create(self.key, CONSUMER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        # MKSTREAM made a key without a TTL; workers' heartbeats refresh it from now on.
        await self.redis.expire(self.key, SHARED_KEY_TTL_S)

    async def take(self, consumer: str, count: int, block_ms: int) -> list[StreamEntry]:
        """Up to ``count`` new requests for ``consumer``, waiting up to ``block_ms``;
        raises ``ResponseError`` (NOGROUP) when the group is gone."""
        reply = await on_key_node(
            self.redis,
            self.key,
            *("XREADGROUP", "GROUP", CONSUMER_GROUP, consumer, "COUNT", count),
            *("BLOCK", block_ms, "STREAMS", self.key, ">"),
        )
        return read_entries(reply)

    async def ack(self, *entry_ids: bytes | str) -> None:
        await self.redis.xack(self.key, CONSUMER_GROUP, *entry_ids)

    async def requeue(self, entries: Sequence[tuple[bytes, Fields]]) -> None:
        """Put taken requests back for the others (as new entries) and acknowledge the
        taken ones, in one transaction."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for entry_id, fields in entries:
                pipe.xadd(self.key, fields)  # type: ignore[arg-type]
                pipe.xack(self.key, CONSUMER_GROUP, entry_id)
            await pipe.execute()


async def count_all(redis: aioredis.Redis, queues: list[RequestQueue]) -> list[tuple[int, int]]:
    """(queued, running) of each of ``queues``, in one round trip: requests no worker took
    yet, and taken but not acknowledged."""
    async with redis.pipeline(transaction=False) as pipe:
        for queue in queues:
            pipe.xinfo_groups(queue.key)
            pipe.xlen(queue.key)
        replies = await pipe.execute(raise_on_error=False)
    return [_counted(replies[2 * i], replies[2 * i + 1]) for i in range(len(queues))]


def _counted(groups: object, length: object) -> tuple[int, int]:
    if isinstance(groups, RedisError):
        if _missing(groups):
            return 0, 0
        raise groups
    if isinstance(length, RedisError):
        raise length
    group = _workers_group(groups)
    if group is None:
        return int(cast(int, length)), 0
    return int(group.get("lag") or 0), int(group["pending"])


async def look_at(
    redis: aioredis.Redis, queues: list[RequestQueue], noted_before_s: float
) -> list[QueueLook]:
    """One look at each of ``queues``, in one round trip, for the reaper's pass: the
    pending summary, the group's lag, the notes made before ``noted_before_s`` (unix
    seconds). A reply that cannot tell says there is something to do."""
    async with redis.pipeline(transaction=False) as pipe:
        for queue in queues:
            pipe.xpending(queue.key, CONSUMER_GROUP)
            pipe.xinfo_groups(queue.key)
            pipe.zcount(queue.submitting_key, "-inf", noted_before_s)
        replies = await pipe.execute(raise_on_error=False)
    return [
        QueueLook(pending=_some_pending(summary), waiting=_some_waiting(groups), noted=noted != 0)
        for summary, groups, noted in zip(replies[0::3], replies[1::3], replies[2::3], strict=True)
    ]
