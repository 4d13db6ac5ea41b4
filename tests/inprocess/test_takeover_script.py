"""TAKEOVER (wire/lua/takeover.lua) of a generation whose cancel was asked, against a real
Redis: the reaper, which ends it cancelled for a worker it thinks lost, takes it from that
worker first, so a token the worker (alive after all: its lease connection was reset) writes
after the reaper read what was streamed is refused instead of reaching clients unbilled; the
worker may still end it itself. A worker stopping a reply of its own (a drain) keeps it."""

from __future__ import annotations

import json

import redis.asyncio as aioredis

from tests.support.submit import Gateway, gateway
from wire import Cancelled, GenerationRequest, SessionEvent, Started, Token, Usage
from wire.generations import Generations
from wire.outcomes import CancelAsked, NotStarted, SignalWorker, TakenOver
from wire.scripts import Cancel, Emit, Takeover

WORKER = "w"


async def worker_writes(
    g: Gateway, request: GenerationRequest, event: SessionEvent, seq: int, final: bool = False
) -> str | None:
    """``WORKER``'s write of ``event``, its ``seq``-th of this generation (None: refused)."""
    emit = Emit(g.redis, g.keys)
    return await emit(
        session_id=request.session_id,
        event=event,
        writer=WORKER,
        seq=seq,
        final=final,
        ttl_s=60,
        maxlen=100,
    )


async def running_with_cancel_asked(g: Gateway) -> GenerationRequest:
    """A generation claimed by ``WORKER``, one token written, then a cancel asked."""
    request = await g.send("t")
    sid, gid = request.session_id, request.generation_id
    assert await worker_writes(g, request, Started(gid, "m", 2), 1)
    assert await worker_writes(g, request, Token(gid, "a", 1), 2)
    cancel = Cancel(g.redis, g.keys)
    asked = await cancel(session_id=sid, generation_id=gid, reason="user", maxlen=100, ttl_s=60)
    assert asked == SignalWorker(WORKER)
    return request


async def take_over(g: Gateway, request: GenerationRequest, *, lost: bool) -> object:
    takeover = Takeover(g.redis, g.keys)
    return await takeover(
        session_id=request.session_id,
        generation_id=request.generation_id,
        worker=WORKER,
        max_takeovers=3,
        lost=lost,
    )


async def test_a_cancelled_reply_the_reaper_ends_refuses_its_workers_later_tokens(
    redis: aioredis.Redis,
) -> None:
    g = await gateway(redis)
    request = await running_with_cancel_asked(g)
    assert await take_over(g, request, lost=True) == CancelAsked("user")
    late = Token(request.generation_id, "b", 2)
    assert await worker_writes(g, request, late, 3) is None


async def test_the_worker_may_still_end_a_cancelled_reply_the_reaper_took(
    redis: aioredis.Redis,
) -> None:
    g = await gateway(redis)
    request = await running_with_cancel_asked(g)
    assert await take_over(g, request, lost=True) == CancelAsked("user")
    end = Cancelled(request.generation_id, "user", Usage(2, 1))
    assert await worker_writes(g, request, end, 3, final=True)


async def test_a_worker_stopping_its_own_cancelled_reply_keeps_it(redis: aioredis.Redis) -> None:
    g = await gateway(redis)
    request = await running_with_cancel_asked(g)
    assert await take_over(g, request, lost=False) == CancelAsked("user")
    more = Token(request.generation_id, "b", 2)
    assert await worker_writes(g, request, more, 3)


async def test_a_writer_refused_can_say_where_its_generation_stands(
    redis: aioredis.Redis,
) -> None:
    """What a worker logs when its event is refused (wire/generations.py ``standing``)."""
    g = await gateway(redis)
    request = await running_with_cancel_asked(g)
    generations = Generations(redis, g.keys)
    sid, gid = request.session_id, request.generation_id
    assert await generations.standing(sid, gid) == f"state=running worker={WORKER} cancel=user"
    assert await take_over(g, request, lost=True) == CancelAsked("user")
    assert await generations.standing(sid, gid) == "state=queued cancel=user"
    assert await generations.standing(sid, "g_none") == "gone"


async def test_a_takeover_sent_again_after_its_reply_was_lost_is_the_same_takeover(
    redis: aioredis.Redis,
) -> None:
    """The client sends a command again when the connection drops before its reply: the
    second TAKEOVER of a worker stopping its own reply finds it queued from that worker.
    That is the takeover the worker asked for, not a reply someone else queued (answered
    "queued", the worker dropped it and queued no continuation: queued for ever)."""
    g = await gateway(redis)
    request = await g.send("t")
    sid, gid = request.session_id, request.generation_id
    assert await worker_writes(g, request, Started(gid, "m", 2), 1)
    generations = Generations(redis, g.keys)
    stop = {"worker": WORKER, "max_takeovers": 3, "preempted": True}
    first = await generations.take_over(sid, gid, **stop)  # type: ignore[arg-type]
    again = await generations.take_over(sid, gid, **stop)  # type: ignore[arg-type]
    assert first == again == TakenOver(1, WORKER)
    other = await generations.take_over(sid, gid, worker="another", max_takeovers=3)
    assert other == NotStarted(1, WORKER)  # queued from WORKER: not this caller's


async def test_an_events_lost_end_after_a_takeover_bills_what_was_streamed_before_it(
    redis: aioredis.Redis,
) -> None:
    """Sentinel, seed 3: a failover lost a worker's claim of its reply's next epoch (a
    preemption's TAKEOVER and what followed it); the reaper took the reply over again, and
    the worker's next write, numbered past the next one, ended it ``events_lost``. That end
    billed 0 tokens while the stream held the 3 its clients had read: with none of the
    epoch's writes kept, the takeover's record of what was streamed is what is billed."""
    g = await gateway(redis)
    request = await g.send("t")
    sid, gid = request.session_id, request.generation_id
    assert await worker_writes(g, request, Started(gid, "m", 2), 1)
    for count in (1, 2, 3):
        assert await worker_writes(g, request, Token(gid, "x", count), count + 1)
    generations = Generations(redis, g.keys)
    taken = await generations.take_over(sid, gid, worker=WORKER, max_takeovers=3, usage=Usage(2, 3))
    assert taken == TakenOver(1, WORKER)
    emit = Emit(g.redis, g.keys)  # the worker's 4th write of epoch 1; Redis kept none before
    late = Token(gid, "y", 5)
    assert (
        await emit(session_id=sid, event=late, writer=WORKER, seq=4, epoch=1, ttl_s=60, maxlen=100)
        is None
    )
    final = await redis.hget(g.keys.generation(sid, gid), "final")
    assert final is not None
    ended = json.loads(final)
    assert (ended["type"], ended["code"]) == ("error", "events_lost")
    assert ended["usage"] == {"prompt_tokens": 2, "completion_tokens": 3}
