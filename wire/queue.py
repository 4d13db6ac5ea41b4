"""A model's generation queue: its ``requests`` stream, the consumer group on it, and the
tenants' waiting lists in front of it.

The one owner of the queue's commands, for everyone who uses it: gateways submit requests
(and read the queue's depth), workers take, acknowledge and give back, the gateways' reaper
claims what a lost worker left pending and puts it on the queue again. Beside it, the notes
of session turns on their way to it (``note_submitting``).

A new request waits in its tenant's list; a worker with free slots takes from the stream
first (work admitted before: a reply taken over, a request given back) and then the
tenants' requests, the tenant served least (tokens served / weight) first: the Virtual
Token Counter (docs/tenants.md). The worker tells what it served with its takes
(``ServedTokens``). A worker with nothing to take waits on the queue's bell, which every
submit and every request put straight into the stream rings, and on its own, which a
request whose prefix it holds rings (cache affinity: docs/affinity.md).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError, ResponseError

from wire.connect import is_cluster, on_key_node
from wire.keys import CONSUMER_GROUP, SHARED_KEY_TTL_S, FairNames, Keys, tenant_slot
from wire.library import lost_scripts
from wire.messages import GenerationRequest
from wire.prefixes import Prefix
from wire.replies import StreamEntry, entries_of, text
from wire.scripts import (
    NO_AFFINITY,
    AffinityWait,
    FairCharge,
    FairEnqueue,
    FairExpire,
    FairHold,
    FairPreempt,
    FairTake,
    Locate,
    Taken,
    WaitingRequest,
)

Fields = Mapping[bytes, bytes] | Mapping[str, bytes]
PENDING_LOOK = 1000
"""The most of a queue's taken, unacknowledged requests read for one generation's (every
worker's slots, in any deployment this gateway serves)."""
HELD_TTL_S = 300
"""How long a worker is taken to hold a prefix it served (unless it serves it again): about
how long an engine under load keeps an idle conversation's blocks. A wrong guess costs a
request the wait for affinity or a prefill, never a reply."""
DEFAULT_STREAM_CAP = 5_120
"""The requests stream's cap when the taker names none (approximate, whole nodes): it holds
what workers took and have not acknowledged, and what waits for a worker in it."""


@dataclass(frozen=True, slots=True)
class _Taking:
    """What one take asks for (``RequestQueue.take``)."""

    consumer: str
    count: int
    maxlen: int | None
    affinity: AffinityWait
    charges: list[tuple[str, int]]


def _missing(exc: RedisError) -> bool:
    """The stream or its group does not exist (nothing queued yet, or Redis lost it)."""
    message = str(exc).lower()
    return "no such key" in message or "nogroup" in message


def estimated_tokens(request: GenerationRequest) -> int:
    """What a request's prompt is charged when it leaves its tenant's list, before anyone
    knows its tokens: a quarter of its text, and a few tokens a message for the chat
    template's markers (the worker charges the difference once it has the prompt's tokens)."""
    text = sum(len(message.content) for message in request.messages) + len(request.prompt or "")
    return text // 4 + 4 * len(request.messages)


class ServedTokens:
    """Tokens a worker served, per tenant, until it next tells its queue (``take``,
    ``charge``): one script call carries them all. Counted by tenant id as served (once
    per engine step), named by their queue slots once per drain."""

    __slots__ = ("_served",)

    def __init__(self) -> None:
        self._served: dict[str, int] = {}

    def add(self, tenant: str, tokens: int) -> None:
        self._served[tenant] = self._served.get(tenant, 0) + tokens

    def drain(self) -> list[tuple[str, int]]:
        """What was served since the last drain, by tenant slot (nothing: an empty list)."""
        served, self._served = self._served, {}
        slots: dict[str, int] = {}
        for tenant, tokens in served.items():
            slot = tenant_slot(tenant)
            slots[slot] = slots.get(slot, 0) + tokens
        return [(slot, tokens) for slot, tokens in slots.items() if tokens]

    def give_back(self, served: list[tuple[str, int]]) -> None:
        """A drain whose script call failed: told again with the next one."""
        for tenant, tokens in served:
            self.add(tenant, tokens)


@dataclass(frozen=True, slots=True)
class QueueLook:
    """What the reaper's pass found in one queue: whether each of its duties has anything
    to do there. ``True`` also when a reply could not tell (the duty reads for itself)."""

    pending: bool
    """Requests taken and not acknowledged (a lost worker's, maybe)."""
    waiting: bool
    """Requests in the stream no worker took yet (past their deadline, maybe)."""
    waiting_fair: bool
    """Requests in the tenants' lists (past their deadline, maybe)."""
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
    def __init__(
        self, redis: aioredis.Redis, keys: Keys, model: str, *, offers_free: bool = True
    ) -> None:
        """``offers_free``: a worker's takes record its free slots, for a new request to
        go straight into the stream while one is free; a preempting worker's do not (a
        request then waits in a list, where its preemption chooses from)."""
        self.redis = redis
        self.model = model
        self.offers_free = offers_free
        self.key = keys.requests(model)
        self.submitting_key = keys.submitting(model)
        self.fair = FairNames(keys.fair(model))
        self._enqueue = FairEnqueue(redis, keys)
        self._take = FairTake(redis, keys)
        self._preempt = FairPreempt(redis, keys)
        self._charge = FairCharge(redis, keys)
        self._expire = FairExpire(redis, keys)
        self._locate = Locate(redis, keys)
        self._hold = FairHold(redis, keys)
        self._drained = False
        """This worker's last take found fewer requests than it asked for: its next waits
        for a bell first."""
        self._tenants_wait = True
        """Its last take left requests in the tenants' lists: its next tells what it
        served (a first take tells, to be sure)."""
        self._soonest_ms = 0
        """Its last take passed over a request that waits for another worker holding its
        prefix: its next wait ends when that wait does (0: none)."""

    # --- gateways and the reaper ---------------------------------------------------------

    def waiting(
        self,
        request: bytes,
        *,
        estimate: int,
        tenant: str,
        weight: float,
        submitted: bytes | None = None,
        prefixes: Sequence[Prefix] = (),
    ) -> WaitingRequest:
        """A new request for ``tenant``'s list, whose share of the engine follows
        ``weight``, its prompt guessed at ``estimate`` tokens (``estimated_tokens``);
        ``submitted``: the note ``note_submitting`` made of it, crossed off with it (a
        request is never crossed off without being queued)."""
        return WaitingRequest(
            self.fair.base,
            self.submitting_key,
            tenant_slot(tenant),
            weight,
            request,
            estimate,
            submitted or b"",
            prefixes,
        )

    async def submit(self, waiting: WaitingRequest) -> None:
        """Queue a new request in its tenant's list (one script call)."""
        await self._enqueue(waiting)

    def submit_in(self, pipe: Pipeline, waiting: WaitingRequest) -> None:
        """``submit`` queued in ``pipe``: after what the caller queued there first on one
        Redis; on a cluster each node's part runs at once, so not after anything there.
        Its bare call: on ``lost_scripts`` the caller calls ``load_scripts`` and sends the
        pipeline again."""
        self._enqueue.enqueue_in(pipe, waiting)

    async def load_scripts(self) -> None:
        """Load the submit's script (a Redis that restarted lost it)."""
        await self._enqueue.load()

    async def add(
        self, fields: Fields, *, maxlen: int | None = None, submitted: bytes | None = None
    ) -> None:
        """Queue a request straight into the stream, ahead of the tenants' lists (a reply
        taken over, a request that waited its turn already), capped at about ``maxlen``,
        renewing the stream's TTL in the same round trip (``SHARED_KEY_TTL_S``);
        ``submitted``: the note to cross off after it (as ``submit``)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            self.add_in(pipe, fields, maxlen=maxlen)
            if submitted is not None:
                pipe.zrem(self.submitting_key, submitted)
            await pipe.execute()

    def add_in(self, pipe: Pipeline, fields: Fields, *, maxlen: int | None = None) -> None:
        """``add`` queued in ``pipe`` (the same order as ``submit_in``)."""
        pipe.xadd(self.key, fields, maxlen=maxlen, approximate=True)  # type: ignore[arg-type]
        pipe.expire(self.key, SHARED_KEY_TTL_S)
        self._ring_in(pipe)

    def _ring_in(self, pipe: Pipeline) -> None:
        """Wake an idle worker: the bell holds at most one ring (fair_core.lua's fair_ring)."""
        pipe.rpush(self.fair.bell, 1)
        pipe.ltrim(self.fair.bell, 0, 0)
        pipe.expire(self.fair.bell, SHARED_KEY_TTL_S)

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

    async def look_again_later(self, note: bytes) -> None:
        """Date ``note`` now, if it is still there: ``submitting_since`` finds it again
        that much later (its gateway may cross it off meanwhile)."""
        await self.redis.zadd(self.submitting_key, {note: time.time()}, xx=True)

    async def fair_waiting(self) -> int:
        """Requests waiting in the tenants' lists."""
        return int(await self.redis.hget(self.fair.base, "waiting") or 0)

    async def expire_waiting(self, deadline_s: float, most: int) -> list[bytes]:
        """Take out of the tenants' lists the requests queued before ``deadline_s`` (unix
        seconds), up to ``most``, for the caller to end (wire/lua/fair_expire.lua)."""
        return await self._expire(base=self.fair.base, deadline_s=deadline_s, most=most)

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

    async def locate(self, generation_id: str) -> Literal["noted", "waiting", "taken"] | None:
        """Where a request of ``generation_id`` may be, read at one moment: ``noted`` on its
        way here, ``waiting`` (some request waits in the stream or the tenants' lists: it
        may be one of them), ``taken`` by a worker and not acknowledged; None: none of
        these (wire/lua/locate.lua)."""
        return await self._locate(
            stream=self.key,
            base=self.fair.base,
            submitting=self.submitting_key,
            generation_id=generation_id,
            most_pending=PENDING_LOOK,
        )

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

    async def forget_consumer(self, consumer: str) -> bool:
        """Drop ``consumer`` from the group once it holds nothing pending; whether it was.
        Deleting a consumer deletes what it holds with it (``XGROUP DELCONSUMER``): a
        request the reaper claimed and could not hand on yet (Redis refused its TAKEOVER)
        would be pending under no one, its reply left running for ever."""
        if await self.pending_of(consumer):
            return False
        await self.redis.xgroup_delconsumer(self.key, CONSUMER_GROUP, consumer)
        return True

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

    async def take(
        self,
        consumer: str,
        count: int,
        block_ms: int,
        served: ServedTokens,
        maxlen: int | None = None,
        affinity: AffinityWait | None = None,
    ) -> list[StreamEntry]:
        """Up to ``count`` requests for ``consumer`` (the stream's first, then the tenants'
        in VTC order; with ``affinity``, those whose prefix it holds first and those another
        worker holds only after their wait: docs/affinity.md). After a take that
        found fewer than it asked for (nothing else waited then), it first waits up to
        ``block_ms`` (or until a passed-over request's wait ends) for the model's bell,
        which every request queued since has rung, or its own (a request whose prefix it
        holds): on one Redis the wait and the take go in one pipeline, the take run as a
        bell rings (or the wait ends), one round trip as a blocking read of the stream is.
        What the worker ``served`` since it last told goes with a take while tenants wait
        in lists (their counters order them), else with its heartbeat's ``charge``. Raises
        ``ResponseError`` (NOGROUP) when the group is gone."""
        charges = served.drain() if self._tenants_wait else []
        taking = _Taking(consumer, count, maxlen, affinity or NO_AFFINITY, charges)
        try:
            if not self._drained:
                taken = await self._take_charged(taking)
            else:
                taken = await self._take_at_ring(taking, self._wait_ms(block_ms))
        except BaseException:
            served.give_back(charges)
            raise
        self._drained = len(taken.entries) < count
        self._tenants_wait, self._soonest_ms = taken.tenants_waiting > 0, taken.soonest_ms
        return taken.entries

    def _wait_ms(self, block_ms: int) -> int:
        """The wait for a bell before a take: ``block_ms``, or less when a request passed
        over for its holder may go anywhere sooner."""
        soonest = self._soonest_ms
        return max(1, min(block_ms, soonest) if soonest > 0 else block_ms)

    async def _take_at_ring(self, taking: _Taking, wait_ms: int) -> Taken:
        """The bells' wait, then the take (rung or not, it looks once after the wait): in
        one pipeline on one Redis."""
        bells = [self.fair.bell]
        if taking.affinity.most_ms:
            bells.append(self.fair.own_bell(taking.consumer))
        if is_cluster(self.redis):
            await on_key_node(self.redis, self.fair.bell, "BLPOP", *bells, str(wait_ms / 1000))
            return await self._take_charged(taking)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.blpop(bells, wait_ms / 1000)
            await self._take_charged(taking, pipe)
            _, reply = await pipe.execute(raise_on_error=False)
        if lost_scripts(reply):  # Redis restarted
            await self._take.load()
            return await self._take_charged(taking)
        if isinstance(reply, Exception):
            raise reply
        return FairTake.taken(reply)

    async def _take_charged(self, taking: _Taking, pipe: Pipeline | None = None) -> Taken:
        return await self._take(
            stream=self.key,
            base=self.fair.base,
            consumer=taking.consumer,
            count=taking.count,
            maxlen=taking.maxlen or DEFAULT_STREAM_CAP,
            affinity=taking.affinity,
            served=taking.charges,
            offers_free=self.offers_free,
            pipe=pipe,
        )

    async def hold(self, worker: str, names: Sequence[str]) -> None:
        """``worker`` holds the prefixes ``names`` (what a request it ran left in its
        engine's cache): requests that name one are taken by it first."""
        if names:
            await self._hold(base=self.fair.base, worker=worker, names=names, ttl_s=HELD_TTL_S)

    async def newcomer(self, block_ms: int) -> bool:
        """Wait up to ``block_ms`` for a tenant that had nothing waiting to queue a request
        (True: one did, since the last ring was taken)."""
        rung = await on_key_node(
            self.redis, self.fair.newcomer, "BLPOP", self.fair.newcomer, str(block_ms / 1000)
        )
        return bool(rung)

    async def preempt_for(
        self,
        consumer: str,
        yielding: Sequence[str],
        others: Sequence[str] = (),
        maxlen: int | None = None,
    ) -> tuple[str, StreamEntry] | None:
        """For a worker whose replies of the tenants ``yielding`` (one name per reply) may
        give way, beside replies of ``others``: a waiting tenant's request, taken for
        ``consumer``, and the tenant (its slot name) that gives way; None when none is owed
        (wire/lua/fair_preempt.lua), ``tenants_wait`` saying whether any could be."""
        found = await self._preempt(
            stream=self.key,
            base=self.fair.base,
            consumer=consumer,
            maxlen=maxlen or DEFAULT_STREAM_CAP,
            yielding=[tenant_slot(tenant) for tenant in yielding],
            others=[tenant_slot(tenant) for tenant in others],
        )
        if isinstance(found, bool):
            self._tenants_wait = found
            return None
        self._tenants_wait = True
        return found

    @property
    def tenants_wait(self) -> bool:
        """Whether this worker's last take or look (``preempt_for``) left tenants waiting
        in their lists."""
        return self._tenants_wait

    async def ring_newcomer(self) -> None:
        """Ring the newcomer bell again (at most one ring waits): the worker that took a
        ring owes none of the tenants waiting, another full worker may."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.rpush(self.fair.newcomer, 1)
            pipe.ltrim(self.fair.newcomer, 0, 0)
            pipe.expire(self.fair.newcomer, SHARED_KEY_TTL_S)
            await pipe.execute()

    async def charge(self, served: ServedTokens) -> None:
        """Tell what was served since the last take (a worker with no free slot takes
        nothing for a while; its tenants' counters must still grow)."""
        charges = served.drain()
        if not charges:
            return
        try:
            await self._charge(base=self.fair.base, served=charges)
        except BaseException:
            served.give_back(charges)
            raise

    async def ack(self, *entry_ids: bytes | str) -> None:
        await self.redis.xack(self.key, CONSUMER_GROUP, *entry_ids)

    async def requeue(self, entries: Sequence[tuple[bytes, Fields]]) -> None:
        """Put taken requests back for the others (as new entries of the stream: their
        turn came already) and acknowledge the taken ones, in one transaction."""
        async with self.redis.pipeline(transaction=True) as pipe:
            for entry_id, fields in entries:
                pipe.xadd(self.key, fields)  # type: ignore[arg-type]
                pipe.xack(self.key, CONSUMER_GROUP, entry_id)
            self._ring_in(pipe)
            await pipe.execute()


async def count_all(redis: aioredis.Redis, queues: list[RequestQueue]) -> list[tuple[int, int]]:
    """(queued, running) of each of ``queues``, in one round trip: requests no worker took
    yet (in the stream or the tenants' lists), and taken but not acknowledged."""
    async with redis.pipeline(transaction=False) as pipe:
        for queue in queues:
            pipe.xinfo_groups(queue.key)
            pipe.xlen(queue.key)
            pipe.hget(queue.fair.base, "waiting")
        replies = await pipe.execute(raise_on_error=False)
    return [
        _counted(groups, length, fair_waiting)
        for groups, length, fair_waiting in zip(
            replies[0::3], replies[1::3], replies[2::3], strict=True
        )
    ]


def _counted(groups: object, length: object, fair_waiting: object) -> tuple[int, int]:
    if isinstance(fair_waiting, RedisError):
        raise fair_waiting
    in_lists = int(cast(bytes, fair_waiting) or 0)
    if isinstance(groups, RedisError):
        if _missing(groups):
            return in_lists, 0
        raise groups
    if isinstance(length, RedisError):
        raise length
    group = _workers_group(groups)
    if group is None:
        return int(cast(int, length)) + in_lists, 0
    return int(group.get("lag") or 0) + in_lists, int(group["pending"])


async def look_at(
    redis: aioredis.Redis, queues: list[RequestQueue], noted_before_s: float
) -> list[QueueLook]:
    """One look at each of ``queues``, in one round trip, for the reaper's pass: the
    pending summary, the group's lag, the tenants' waiting count, the notes made before
    ``noted_before_s`` (unix seconds). A reply that cannot tell says there is something to
    do."""
    async with redis.pipeline(transaction=False) as pipe:
        for queue in queues:
            pipe.xpending(queue.key, CONSUMER_GROUP)
            pipe.xinfo_groups(queue.key)
            pipe.hget(queue.fair.base, "waiting")
            pipe.zcount(queue.submitting_key, "-inf", noted_before_s)
        replies = await pipe.execute(raise_on_error=False)
    return [
        QueueLook(
            pending=_some_pending(summary),
            waiting=_some_waiting(groups),
            waiting_fair=_some_in_lists(fair_waiting),
            noted=noted != 0,
        )
        for summary, groups, fair_waiting, noted in zip(
            replies[0::4], replies[1::4], replies[2::4], replies[3::4], strict=True
        )
    ]


def _some_in_lists(fair_waiting: object) -> bool:
    if isinstance(fair_waiting, RedisError):
        return True
    return int(cast(bytes | None, fair_waiting) or 0) > 0
