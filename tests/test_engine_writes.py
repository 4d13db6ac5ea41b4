"""The engine's writes survive retries, against the real Redis server.

- EMIT is idempotent per generation: an event whose sequence number is already written is
  not written again, so a write resent after a connection loss duplicates nothing.
- EMIT sees lost writes: an event whose sequence number skips some (Redis lost them in a
  failover) ends the generation with ``error`` ``events_lost`` instead of a silent gap.
- A failed acknowledgement is counted, logged and retried, so the request does not stay
  "in flight" (gateway/core/store/sessions.py counts pending requests) for the life of the worker.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError

import wire
from engine import publisher as publisher_module
from engine.backends.synthetic import SyntheticBackend
from engine.publisher import Publisher
from engine.worker import Worker
from tests.support.cluster import check_reply
from tests.support.http import create_session, follow, send
from tests.support.redis_probes import async_client
from tests.support.stack import Stack
from wire import Done, Keys, Started, Token, Usage
from wire.emit_step import EmitStep, StepCall
from wire.generations import Generations
from wire.outcomes import NotStarted, TakenOver, TakeoverReply
from wire.queue import RequestQueue
from wire.scripts import Emit, Takeover

pytestmark = pytest.mark.timeout(60)


async def queued_generation(redis: aioredis.Redis, keys: Keys) -> tuple[str, str]:
    """A generation as the gateway's submit leaves it: its hash in state ``queued``."""
    sid, gid = f"s_{secrets.token_hex(4)}", f"g_{secrets.token_hex(4)}"
    await redis.hset(keys.generation(sid, gid), mapping={"state": "queued"})
    await redis.expire(keys.generation(sid, gid), 600)
    return sid, gid


async def test_an_event_after_a_step_goes_out_live_at_once(redis: aioredis.Redis) -> None:
    """A step's call holds its session's events to publish them as one message; the next
    call (here an event of its own, as a gateway's cancel writes it) publishes at once.
    Redis keeps a library's state between calls (wire/library.py): this fails if a call
    does not start afresh (begin_call)."""
    keys = Keys(f"t-{secrets.token_hex(4)}")
    sid, gid = await queued_generation(redis, keys)
    other_sid, other_gid = await queued_generation(redis, keys)
    step, emit = EmitStep(redis, keys), Emit(redis, keys)
    listener = redis.pubsub()
    await listener.subscribe(keys.live_channel(sid), keys.live_channel(other_sid))
    try:
        call = StepCall("w1")
        target = step.target(sid, gid, epoch=0, maxlen=100, ttl_s=600)
        call.add(target, 1, "started", wire.encode(Started(gid, "m", 1)))
        call.add(target, 2, "token", wire.encode(Token(gid, "a", 1)))
        assert all(await step.send(call))
        written = await emit(
            session_id=other_sid, event=Started(other_gid, "m", 1), maxlen=100, ttl_s=600
        )
        assert written is not None
        lines: list[str] = []
        async with asyncio.timeout(5):
            while len(lines) < 3:
                message = await listener.get_message(ignore_subscribe_messages=True, timeout=1)
                if message is not None:
                    lines += wire.text(message["data"]).split("\n")
    finally:
        await listener.aclose()
    kinds = [line.split(" ", 3)[1:3] for line in lines]
    assert kinds == [["started", gid], ["token", gid], ["started", other_gid]], lines


async def test_emit_writes_each_sequence_number_once(redis: aioredis.Redis) -> None:
    keys = Keys(f"t-{secrets.token_hex(4)}")
    sid, gid = await queued_generation(redis, keys)
    emit = Emit(redis, keys)
    events = [Started(gid, "m", 3), Token(gid, "a", 1), Token(gid, "b", 2)]

    async def write_all() -> list[str | None]:
        return [
            await emit(session_id=sid, event=event, maxlen=100, ttl_s=600, seq=seq)
            for seq, event in enumerate(events, start=1)
        ]

    first = await write_all()
    again = await write_all()
    assert all(first) and all(again), "a repeated write is not a refusal"
    assert await redis.xlen(keys.events(sid)) == 3
    assert again[-1] == first[-1]  # a repeat answers with the latest id written


WRITES = ["one call", "several calls"]
"""How a publisher's write goes: one EMIT_STEP call alone, or several (more events than
``MAX_EVENTS_PER_CALL``) in a pipeline."""


def publisher_writing(
    redis: aioredis.Redis, keys: Keys, write: str, monkeypatch: pytest.MonkeyPatch
) -> Publisher:
    if write == "several calls":
        monkeypatch.setattr(publisher_module, "MAX_EVENTS_PER_CALL", 3)
    return Publisher(
        Generations(redis, keys),
        queue=RequestQueue(redis, keys, "m"),
        writer="",
        on_rejected=lambda gid, epoch: None,
    )


@pytest.mark.parametrize("write", WRITES)
async def test_a_write_resent_after_a_connection_loss_writes_nothing_twice(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    """The first write runs in Redis, then its reply is lost: the publisher sends it
    again. Events with sequence numbers land once; the control generation (no sequence
    numbers, as before this guarantee) shows the fault does duplicate otherwise."""
    keys = Keys(f"t-{secrets.token_hex(4)}")
    sid, gid = await queued_generation(redis, keys)
    control_sid, control_gid = await queued_generation(redis, keys)
    executions = 0

    def losing_the_first_reply(run: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        async def run_then_lose_the_reply(*args: Any, **kwargs: Any) -> Any:
            nonlocal executions
            result = await run(*args, **kwargs)
            executions += 1
            if executions == 1:
                raise RedisConnectionError("connection lost after the write ran")
            return result

        return run_then_lose_the_reply

    publisher = publisher_writing(redis, keys, write, monkeypatch)
    if write == "one call":
        run_command = redis.execute_command
        lose_a_script_reply = losing_the_first_reply(run_command)

        async def command(*args: Any, **kwargs: Any) -> Any:
            if args[0] in ("FCALL", "EVALSHA"):  # the script's call: not its load
                return await lose_a_script_reply(*args, **kwargs)
            return await run_command(*args, **kwargs)

        monkeypatch.setattr(redis, "execute_command", command)
    else:
        monkeypatch.setattr(Pipeline, "execute", losing_the_first_reply(Pipeline.execute))
    target = publisher.generations.target(sid, gid, epoch=0, ttl_s=600, maxlen=100)
    control_target = publisher.generations.target(
        control_sid, control_gid, epoch=0, ttl_s=600, maxlen=100
    )
    running = asyncio.create_task(publisher.run_forever())
    try:
        futures = []
        for seq, text in enumerate(["", "a", "b", "c"], start=1):
            event = Started(gid, "m", 1) if seq == 1 else Token(gid, text, seq - 1)
            futures.append(publisher.emit_waited(target, event, seq))
            control = Started(control_gid, "m", 1) if seq == 1 else Token(control_gid, text, 1)
            futures.append(publisher.emit_waited(control_target, control, 0))
        ids = await asyncio.wait_for(asyncio.gather(*futures), 10)
    finally:
        running.cancel()
    assert executions == 2, "the fault was not injected"
    assert publisher.pipelines == 1
    assert all(ids[0::2])
    assert await redis.xlen(keys.events(sid)) == 4
    # The control's tokens land twice; its second `started` is refused (a claim needs a
    # queued generation), so 7 events, not 8.
    assert ids[1::2].count(None) == 1
    assert await redis.xlen(keys.events(control_sid)) == 7


@pytest.mark.parametrize("write", WRITES)
async def test_a_final_event_acknowledges_its_request_in_the_same_write(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch, write: str
) -> None:
    """A generation's end and its request's acknowledgement are one write (one round
    trip), the acknowledgement after every event of it: the request is in flight until
    its end is in Redis, and not a moment longer."""
    keys = Keys(f"t-{secrets.token_hex(4)}")
    publisher = publisher_writing(redis, keys, write, monkeypatch)
    await publisher.queue.ensure_group()
    targets, acks = [], []
    for _ in range(2):
        sid, gid = await queued_generation(redis, keys)
        acks.append(await redis.xadd(publisher.queue.key, {"r": b"{}"}))
        targets.append(publisher.generations.target(sid, gid, epoch=0, ttl_s=600, maxlen=100))
    await redis.xreadgroup(wire.CONSUMER_GROUP, "w", {publisher.queue.key: ">"})
    assert (await redis.xpending(publisher.queue.key, wire.CONSUMER_GROUP))["pending"] == 2
    running = asyncio.create_task(publisher.run_forever())
    try:
        futures = []
        for target, entry_id in zip(targets, acks, strict=True):
            gid = target.generation_id
            futures.append(publisher.emit_waited(target, Started(gid, "m", 1), 1))
            futures.append(publisher.emit_waited(target, Token(gid, "a", 1), 2))
            done = Done(gid, "stop", Usage(1, 1))
            futures.append(publisher.emit_waited(target, done, 3, final=True, ack=entry_id))
        ids = await asyncio.wait_for(asyncio.gather(*futures), 10)
    finally:
        running.cancel()
    assert all(ids)
    assert publisher.pipelines == 1, "the events and the acknowledgements took one write"
    assert (await redis.xpending(publisher.queue.key, wire.CONSUMER_GROUP))["pending"] == 0
    for target in targets:
        assert await redis.xlen(keys.events(target.session_id)) == 3


async def test_a_failed_ack_is_counted_and_retried(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = Keys(f"t-{secrets.token_hex(4)}")
    worker = Worker(redis, SyntheticBackend(), keys=keys, worker_id="w-ack")
    queue = worker.requests_key
    await redis.xgroup_create(queue, wire.CONSUMER_GROUP, id="0", mkstream=True)
    entry_id = await redis.xadd(queue, {"r": b"{}"})
    await redis.xreadgroup(wire.CONSUMER_GROUP, "w-ack", {queue: ">"})
    xack = redis.xack

    async def lost(*args: Any) -> int:
        raise RedisConnectionError("connection lost")

    monkeypatch.setattr(redis, "xack", lost)
    worker.jobs.add(entry_id, {b"r": b"{}"})  # unreadable: dropped, its request acknowledged
    async with asyncio.timeout(10):
        while worker.jobs.busy:
            await asyncio.sleep(0.01)
    assert (await redis.xpending(queue, wire.CONSUMER_GROUP))["pending"] == 1
    errors = worker.metrics.registry.get_sample_value(
        "tokenspout_engine_redis_errors_total", {"where": "ack"}
    )
    assert errors == 1
    monkeypatch.setattr(redis, "xack", xack)
    await worker.jobs.retry_acks()  # what the next heartbeat does
    assert (await redis.xpending(queue, wire.CONSUMER_GROUP))["pending"] == 0
    assert not worker.jobs.unacked


async def test_after_a_takeover_only_the_new_epochs_writer_writes(redis: aioredis.Redis) -> None:
    """EMIT checks the writer (worker and epoch): once TAKEOVER moved the generation on,
    the old worker's events are refused, also from the same worker; the continuation
    claims it with `resumed` and writes; a second claim is refused."""
    keys = Keys(f"t-{secrets.token_hex(4)}")
    sid, gid = await queued_generation(redis, keys)
    emit = Emit(redis, keys)
    takeover = Takeover(redis, keys)

    async def write(event: wire.SessionEvent, writer: str, epoch: int) -> str | None:
        return await emit(
            session_id=sid, event=event, maxlen=100, ttl_s=600, writer=writer, epoch=epoch
        )

    async def take_from(worker: str) -> TakeoverReply:
        return await takeover(session_id=sid, generation_id=gid, worker=worker, max_takeovers=3)

    assert await write(Started(gid, "m", 3), "w1", 0)
    assert await write(Token(gid, "a", 1, [7]), "w1", 0)
    assert await write(Token(gid, "b", 2, [8]), "w2", 0) is None  # not the owner
    assert await take_from("w1") == TakenOver(takeovers=1, from_worker="w1")
    assert isinstance(await take_from("w1"), NotStarted)  # a second reaper hands nothing on anew
    assert await write(Token(gid, "b", 2, [8]), "w1", 0) is None  # the old run
    assert await write(Token(gid, "b", 2, [8]), "w1", 1) is None  # not claimed yet
    resumed = wire.Resumed(gid, "w1", "w1", 1, 1)
    assert await write(resumed, "w1", 1)  # the same worker may continue it, as epoch 1
    assert await write(Token(gid, "b", 2, [8]), "w1", 0) is None  # ... but not as epoch 0
    assert await write(Token(gid, "b", 2, [8]), "w1", 1)
    assert await write(wire.Resumed(gid, "w1", "w2", 2, 1), "w2", 1) is None
    kinds = [f[b"t"] for _id, f in await redis.xrange(keys.events(sid))]
    assert kinds == [b"started", b"token", b"resumed", b"token"]


async def test_a_write_that_skips_sequence_numbers_ends_the_generation_events_lost(
    redis: aioredis.Redis,
) -> None:
    """As a failover to a replica that lacked the last writes leaves it: the stream and the
    generation's seq rewound. The writer's next event is refused and the generation ends
    with ``error`` ``events_lost``; a lost claim (the generation still ``queued``) too; a
    writer that does not own the generation ends nothing."""
    keys = Keys(f"t-{secrets.token_hex(4)}")
    emit = Emit(redis, keys)

    async def write(sid: str, event: wire.SessionEvent, seq: int, epoch: int = 0) -> str | None:
        return await emit(
            session_id=sid, event=event, maxlen=100, ttl_s=600, writer="w1", seq=seq, epoch=epoch
        )

    async def events(sid: str) -> list[tuple[bytes, dict[str, Any]]]:
        return [(f[b"t"], json.loads(f[b"d"])) for _id, f in await redis.xrange(keys.events(sid))]

    sid, gid = await queued_generation(redis, keys)
    started = await write(sid, Started(gid, "m", 3), 1)
    assert await write(sid, Token(gid, "a", 1), 2)
    assert await write(sid, Token(gid, "b", 2), 3)
    # The failover: the new primary had the stream up to `started`.
    await redis.xdel(keys.events(sid), *[i for i, _f in await redis.xrange(keys.events(sid))][1:])
    await redis.hset(keys.generation(sid, gid), mapping={"seq": 1, "seq_id": started or ""})
    assert await write(sid, Token(gid, "c", 3), 4) is None
    kinds = await events(sid)
    assert [kind for kind, _data in kinds] == [b"started", b"error"]
    assert kinds[-1][1]["code"] == "events_lost" and kinds[-1][1]["generation_id"] == gid
    # It bills what a reader can still read: the prompt, none of the lost tokens.
    assert kinds[-1][1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 0}
    assert await redis.hget(keys.generation(sid, gid), "state") == b"error"
    assert await write(sid, Token(gid, "d", 4), 5) is None  # ended: nothing after
    assert await write(sid, Started(gid, "m", 3), 1) == started  # a retry is still a retry

    lost_claim_sid, lost_claim_gid = await queued_generation(redis, keys)
    assert await write(lost_claim_sid, Token(lost_claim_gid, "a", 1), 2) is None
    ((kind, lost_claim),) = await events(lost_claim_sid)
    assert kind == b"error" and lost_claim["usage"] == {"prompt_tokens": 0, "completion_tokens": 0}

    # Redis kept some of its tokens: their count is billed.
    kept_sid, kept_gid = await queued_generation(redis, keys)
    await write(kept_sid, Started(kept_gid, "m", 5), 1)
    await write(kept_sid, Token(kept_gid, "a", 1), 2)
    await write(kept_sid, Token(kept_gid, "bc", 3, token_ids=[7, 8]), 3)
    await redis.hset(keys.generation(kept_sid, kept_gid), "seq", 2)  # as if one more came
    assert await write(kept_sid, Token(kept_gid, "d", 5), 5) is None
    _kind, kept = (await events(kept_sid))[-1]
    assert kept["code"] == "events_lost"
    assert kept["usage"] == {"prompt_tokens": 5, "completion_tokens": 3}

    taken_sid, taken_gid = await queued_generation(redis, keys)
    await redis.hset(keys.generation(taken_sid, taken_gid), "takeovers", 1)  # epoch 1 now
    assert await write(taken_sid, Token(taken_gid, "a", 9), 10, epoch=0) is None
    assert await events(taken_sid) == []
    assert await redis.hget(keys.generation(taken_sid, taken_gid), "state") == b"queued"


async def test_a_reply_whose_events_redis_lost_ends_with_a_clear_error(stack: Stack) -> None:
    """Through a gateway and a worker: the generation's seq rewound mid-reply (as a failover
    would leave it) ends that reply with ``error`` ``events_lost``, every token before it
    once and in order; another reply on the same worker goes on whole."""
    stack.synthetic(50)
    gateway = stack.gateway()
    keys = Keys(stack.prefix)
    content, max_tokens = "lose my writes", 150
    async with httpx.AsyncClient(timeout=60) as client:
        sessions = [await create_session(client, gateway.url) for _ in range(2)]
        gids = [await send(client, s, content, max_tokens=max_tokens) for s in sessions]
        followers = [follow(client, s, g) for s, g in zip(sessions, gids, strict=True)]
        for follower in followers:
            await follower.until_tokens(10)
        rewind = async_client(stack.redis_url)
        try:
            await rewind.hset(keys.generation(sessions[0].session_id, gids[0]), "seq", 2)
        finally:
            await rewind.aclose()
        await asyncio.wait_for(asyncio.gather(*(f.task for f in followers if f.task)), 60)
    lost = check_reply(followers[0].reading.events, gids[0], content, max_tokens)
    assert lost["code"] == "events_lost", lost
    streamed = [e.json() for e in followers[0].reading.of(gids[0]) if e.event == "token"]
    assert lost["usage"]["completion_tokens"] == streamed[-1]["count"] > 0, lost
    assert lost["usage"]["prompt_tokens"] > 0, lost
    assert check_reply(followers[1].reading.events, gids[1], content, max_tokens)["usage"]


@pytest.mark.parametrize("join", [True, False], ids=["join-tokens", "default"])
async def test_a_reply_behind_a_paused_redis_loses_nothing_and_joins_only_if_asked(
    stack: Stack, join: bool
) -> None:
    """Redis holds writes for 1 s mid-reply (``CLIENT PAUSE 1000 WRITE``) while the engine
    makes 200 tokens a second. With ``--join-tokens`` the tokens that waited go as one
    event (the reply catches up in fewer events); by default each stays an event of its
    own. Either way every token arrives once, in order, the text whole."""
    stack.synthetic(200, *(["--join-tokens"] if join else []))
    gateway = stack.gateway()
    content, max_tokens = "wait for redis", 400
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, gateway.url)
        gid = await send(client, session, content, max_tokens=max_tokens)
        follower = follow(client, session, gid)
        await follower.until_tokens(5)
        pause = async_client(stack.redis_url)
        try:
            await pause.execute_command("CLIENT", "PAUSE", 1000, "WRITE")
        finally:
            await pause.aclose()
        await follower.until_end(60)
    final = check_reply(follower.reading.events, gid, content, max_tokens)
    events = sum(1 for e in follower.reading.of(gid) if e.event == "token")
    if join:
        # The engine goes on while Redis holds: whatever it made meanwhile (up to 200
        # tokens) joins into one event; 40 fewer events need only 41 of them.
        assert events < max_tokens - 40, events
    else:
        assert events == max_tokens
    assert final["usage"]["completion_tokens"] == max_tokens
