"""A one-shot request's SUBMIT (wire/lua/submit.lua, wire/lua/fair_core.lua ``fair_submit``)
against the session's real Redis: straight into the requests stream while a worker has a free
slot for it and no list holds a request, into its tenant's list once anything waits (so the
fair share orders it), and always into the list when only preempting workers serve (they
offer no free slot), and into the list when a free worker holds its prompt's prefix while
another does not (cache affinity: its holder takes it first); a tenant served straight
raises the floor a tenant that starts waiting is lifted to. And what its final event's script
counts for its key (wire/lua/usage_core.lua): nothing but its usage for a key without
limits, the running set and the minute's tokens for a key with those limits."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

import wire
from tests.support.submit import MODEL, Gateway, gateway, tenant_of
from wire import ChatMessage, Done, GenerationRequest, SamplingParams, Usage, prefixes
from wire.limits import Limits
from wire.outcomes import Admitted, Duplicate
from wire.queue import RequestQueue, ServedTokens
from wire.scripts import AffinityWait, Emit

pytestmark = pytest.mark.timeout(60)


async def idle_worker(g: Gateway, slots: int) -> None:
    """A worker with ``slots`` free has looked at the queue (its take records them)."""
    assert await g.queue.take("w", slots, 10, ServedTokens()) == []


async def test_a_request_goes_straight_in_while_a_slot_is_free_for_it_and_else_waits(
    redis: aioredis.Redis,
) -> None:
    g = await gateway(redis)
    await g.send("a")  # no worker has said it has a free slot: it waits in a's list
    assert await g.straight() == [] and await g.queue.fair_waiting() == 1
    assert await take_tenants(g, 1) == ["a"]  # the take records the worker's free slots: 0

    await idle_worker(g, 1)
    await g.send("a")
    assert await g.straight() == ["a"] and await g.queue.fair_waiting() == 0
    assert await redis.lrange(g.queue.fair.bell, 0, -1) == [b"1"]  # the idle worker is woken
    await g.send("a")  # the one free slot is the first's: this one waits in a's list
    await g.send("b")
    assert await g.straight() == ["a"] and await g.queue.fair_waiting() == 2
    taken = await g.queue.take("w", 3, 10, ServedTokens())
    # The stream's first, then the lists by counter: b was served nothing yet.
    assert [tenant_of(fields) for _, fields in taken] == ["a", "b", "a"]
    assert b"e" not in taken[0][1]  # straight in: no estimate charged, the worker charges
    await idle_worker(g, 2)
    await g.send("b")  # every request taken, a slot free: straight in again
    await g.send("b")  # and the second slot
    assert (await g.straight())[-2:] == ["b", "b"] and await g.queue.fair_waiting() == 0


async def take_tenants(g: Gateway, count: int) -> list[str]:
    return [tenant_of(fields) for _, fields in await g.queue.take("w", count, 10, ServedTokens())]


async def test_another_tenant_waiting_in_a_list_keeps_the_next_request_in_its_list(
    redis: aioredis.Redis,
) -> None:
    g = await gateway(redis)
    await idle_worker(g, 1)
    await g.send("a")
    await g.send("b")  # behind a's request, the one slot: into b's list
    assert await take_tenants(g, 1) == ["a"]
    # Another worker has slots free, but b still waits: a's request waits in a's list.
    await redis.hset(g.queue.fair.free, "w2", f"4 {int(time.time()) + 60} 1")
    await g.send("a")
    assert await g.straight() == ["a"] and await g.queue.fair_waiting() == 2


async def test_a_lapsed_record_of_free_slots_counts_none_and_is_dropped(
    redis: aioredis.Redis,
) -> None:
    g = await gateway(redis)
    await redis.hset(g.queue.fair.free, "lost", f"4 {int(time.time()) - 1} 1")
    await g.send("a")
    assert await g.straight() == [] and await g.queue.fair_waiting() == 1
    assert not await redis.hexists(g.queue.fair.free, "lost")


async def test_a_preempting_worker_offers_no_free_slot_so_every_request_waits_in_a_list(
    redis: aioredis.Redis,
) -> None:
    g = await gateway(redis)
    preempting = RequestQueue(redis, g.keys, MODEL, offers_free=False)
    assert await preempting.take("p", 4, 10, ServedTokens()) == []  # idle, 4 slots free
    await g.send("a")
    assert await g.straight() == [] and await g.queue.fair_waiting() == 1


async def test_a_tenant_served_straight_raises_the_floor_a_returning_tenant_is_lifted_to(
    redis: aioredis.Redis,
) -> None:
    """Served alone, straight in, busy's counter grows with what the worker charges; a
    tenant that then starts waiting is lifted to it (banks no credit from the time busy was
    served alone), and a weight given straight in is the one its charge divides by."""
    g = await gateway(redis)
    await idle_worker(g, 1)
    await g.send("busy", weight=2.0)
    served = ServedTokens()
    assert len(await g.queue.take("w", 1, 10, served)) == 1
    served.add("busy", 1_000)
    await g.queue.charge(served)
    assert float(await redis.hget(g.queue.fair.vtc, "busy") or 0) == 500  # 1,000 / weight 2
    assert float(await redis.hget(g.queue.fair.base, "floor") or 0) == 500
    await g.send("back")  # no slot free (the take took its one): back waits, lifted
    assert float(await redis.hget(g.queue.fair.vtc, "back") or 0) == 500


STORY = ("tell me a story", "once upon a time", "and then?")


async def affine_worker(g: Gateway, worker: str, holds: bool) -> RequestQueue:
    """A worker taking with cache affinity, idle with 2 slots free; ``holds``: it ran
    STORY's first turn, so its engine holds the next turn's prefix."""
    queue = RequestQueue(g.redis, g.keys, MODEL)
    if holds:
        first = GenerationRequest(
            "t1", "s-t1", SamplingParams(), messages=[ChatMessage("user", STORY[0])]
        )
        await queue.hold(worker, prefixes.held(MODEL, first, STORY[1]))
    assert await queue.take(worker, 2, 10, ServedTokens(), affinity=AffinityWait(5_000)) == []
    return queue


async def affine_take(queue: RequestQueue, worker: str) -> list[bytes | None]:
    """What ``worker`` takes at once: each entry's affinity outcome."""
    taken = await queue.take(worker, 2, 10, ServedTokens(), affinity=AffinityWait(5_000))
    return [fields.get(b"a") for _, fields in taken]


async def test_a_request_a_free_worker_holds_waits_in_its_list_while_another_is_free(
    redis: aioredis.Redis,
) -> None:
    """Straight into the stream, whichever free worker read it first; so while a free
    worker that does not hold its prefix could, it waits in its list for its holder."""
    g = await gateway(redis)
    holder = await affine_worker(g, "wa", holds=True)
    other = await affine_worker(g, "wb", holds=False)
    await g.send("", chat=STORY)
    assert await g.straight() == [] and await g.queue.fair_waiting() == 1
    assert await redis.lrange(g.queue.fair.own_bell("wa"), 0, -1) == [b"1"]
    assert await affine_take(other, "wb") == []  # it waits for wa, free
    assert await affine_take(holder, "wa") == [b"hit"]


async def test_a_request_every_free_worker_holds_or_none_goes_straight_in(
    redis: aioredis.Redis,
) -> None:
    """Held by every free worker (a shared opening), it is a hit wherever it goes; held by
    no free worker (its holder full), nothing would wait for it: straight in, both."""
    g = await gateway(redis)
    await affine_worker(g, "wa", holds=True)
    other = await affine_worker(g, "wb", holds=True)
    await g.send("", chat=STORY)
    assert await g.straight() == [""] and await g.queue.fair_waiting() == 0
    assert await affine_take(other, "wb") == [b"hit"]
    for holder in ("wa", "wb"):  # both full now
        await redis.hset(g.queue.fair.free, holder, f"0 {int(time.time()) + 60} 1")
    third = await affine_worker(g, "wc", holds=False)
    await g.send("", chat=STORY)
    assert await g.straight() == ["", ""] and await g.queue.fair_waiting() == 0
    assert await affine_take(third, "wc") == [None]


async def final(g: Gateway, request: GenerationRequest, tokens: Usage) -> None:
    """The worker's final event of ``request`` (its claim first)."""
    emit = Emit(g.redis, g.keys)
    sid, gid = request.session_id, request.generation_id
    started = wire.Started(gid, MODEL, 0)
    assert await emit(session_id=sid, event=started, writer="w", ttl_s=60, maxlen=100)
    done = Done(gid, "stop", tokens)
    assert await emit(session_id=sid, event=done, writer="w", ttl_s=60, maxlen=100, final=True)


async def tenant_keys(g: Gateway, tenant: str) -> list[str]:
    found = await g.redis.keys(g.keys.tenant(tenant, "*"))
    return sorted(key.decode().rsplit("}:", 1)[1] for key in found)


async def test_a_generation_of_a_key_without_limits_counts_its_usage_and_nothing_else(
    redis: aioredis.Redis,
) -> None:
    g = await gateway(redis)
    await final(g, await g.send("anonymous", limits=Limits()), Usage(7, 3))
    day = await redis.time()
    kept = await tenant_keys(g, "anonymous")
    assert kept == [f"usage:day:{day[0] // 86_400}", f"usage:hour:{day[0] // 3_600}"], kept
    usage = await redis.hgetall(g.keys.tenant("anonymous", kept[0]))
    assert usage == {b"prompt_tokens": b"7", b"completion_tokens": b"3", b"generations": b"1"}
    assert 0 < await redis.ttl(g.keys.tenant("anonymous", kept[0])) <= 34_560_000


async def test_a_key_with_limits_has_its_running_set_and_minute_kept(
    redis: aioredis.Redis,
) -> None:
    g = await gateway(redis)
    limits = Limits(concurrent=5, tokens_per_minute=1_000, tokens_per_day=1_000)
    request = await g.send("k_limited", limits=limits)
    assert await redis.zcard(g.keys.tenant("k_limited", "running")) == 1
    await final(g, request, Usage(7, 3))
    assert await redis.zcard(g.keys.tenant("k_limited", "running")) == 0
    assert sum(map(int, (await redis.hgetall(g.keys.tenant("k_limited", "tpm"))).values())) == 10
    assert "tpm" in await tenant_keys(g, "k_limited")


async def test_a_submit_sent_again_after_its_reply_was_lost_makes_nothing_twice(
    redis: aioredis.Redis,
) -> None:
    """The gateway's Redis client sends a command again when its connection is lost before
    the reply: a SUBMIT that ran once is sent twice. The second is told it made that
    generation (``Duplicate``): one request queued, one ``queued`` event, its key admitted
    once. A session turn's resend was refused ``busy`` by its own generation (a WebSocket
    client told generation_running on a new session, ten-minute cluster soak, seed 1), and
    a one-shot request's was admitted and queued again."""
    g = await gateway(redis)
    await idle_worker(g, 2)
    request = GenerationRequest("g1", "s1", SamplingParams(), prompt="hello", tenant="a")
    new, admission = g.submit_of(request, "a", 1.0, Limits(concurrent=5))
    first = await g.submit.create_admitted(new, admission)
    assert isinstance(first, Admitted), first
    assert await g.submit.create_admitted(new, admission) == Duplicate("g1")
    assert await g.straight() == ["a"] and await g.queue.fair_waiting() == 0
    events = await redis.xrange(g.keys.events("s1"))
    assert [fields[b"t"] for _, fields in events] == [b"queued"]
    assert await redis.zcard(g.keys.tenant("a", "running")) == 1
