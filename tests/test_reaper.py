"""The gateway's background loops outlive any failure of one pass, and two of them never
hand one lost reply on twice (gateway/recovery/reaper.py, gateway/recovery/takeover.py)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

import wire
from gateway.core.settings import Settings
from gateway.recovery import reaper
from gateway.recovery.reaper import Reaper, RepeatedFailures
from gateway.recovery.takeover import REAPER_PREFIX
from stack.redis_server import free_port
from wire import CONSUMER_GROUP, GenerationRequest, Keys, SamplingParams, Started, Token
from wire.generations import Generations
from wire.queue import RequestQueue

pytestmark = pytest.mark.timeout(30)


class CountingRedis(aioredis.Redis):
    """A client on the same pool that notes each command it sends and each pipeline it
    makes: a round trip each."""

    sent: list[str]

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        self.sent.append(str(args[0]).upper())
        return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        self.sent.append("PIPELINE")
        return super().pipeline(transaction, shard_hint)


def reaper_of(redis: aioredis.Redis, keys: Keys, queue_timeout_s: float = 120.0) -> Reaper:
    """A reaper whose workers are lost after 2 s silent, its sessions' events capped at 100."""
    generations = Generations(redis, keys, events_maxlen=100, ttl_s=600)
    return Reaper(generations, Settings(worker_timeout_s=2.0, queue_timeout_s=queue_timeout_s))


def counting(redis: aioredis.Redis) -> CountingRedis:
    client = CountingRedis(connection_pool=redis.connection_pool)
    client.sent = []
    return client


async def test_a_reaper_pass_that_raises_is_logged_and_the_reaper_goes_on(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Not only Redis errors: any exception of one pass (a bug, a malformed entry) is
    logged with its traceback, and both duties keep running."""
    reaper = reaper_of(redis, Keys(f"t-{secrets.token_hex(4)}"))
    passes = {"reap_once": 0, "expire_queued": 0}

    async def reap_once(queues: list[RequestQueue]) -> int:
        passes["reap_once"] += 1
        if passes["reap_once"] == 1:
            raise ValueError("a malformed pending entry")
        return 0

    async def expire_queued(queues: list[RequestQueue]) -> int:
        passes["expire_queued"] += 1
        raise KeyError("b'r'")

    monkeypatch.setattr(reaper, "reap_once", reap_once)
    monkeypatch.setattr(reaper, "expire_queued", expire_queued)
    caplog.set_level(logging.WARNING, "tokenspout.watchdog")
    task = asyncio.create_task(reaper.run_forever(interval_s=0.01))
    try:
        while min(passes.values()) < 3:
            await asyncio.sleep(0.01)
            assert not task.done(), "the reaper loop ended"
    finally:
        task.cancel()
    assert "a malformed pending entry" in caplog.text
    assert "expire_queued failed" in caplog.text
    assert any(record.exc_info for record in caplog.records), "no traceback logged"


async def test_two_reapers_racing_hand_a_lost_workers_reply_on_once(
    redis: aioredis.Redis,
) -> None:
    """Two gateways' reapers (the lock lapsed) see the same lost worker at once: the reply
    is queued again once, with what it streamed, and nothing is left pending."""
    keys = Keys(f"t-{secrets.token_hex(4)}")
    sid, gid = "s_race", "g_race"
    request = GenerationRequest(gid, sid, SamplingParams(max_tokens=10), prompt="hi there")
    queue = keys.requests("m")
    await redis.hset(keys.models, "m", "m")  # as the lost worker's heartbeat registered it
    await redis.xgroup_create(queue, CONSUMER_GROUP, id="0", mkstream=True)
    await redis.xadd(queue, {"r": wire.encode(request)})
    await redis.xreadgroup(CONSUMER_GROUP, "lost", {queue: ">"})
    gen = keys.generation(sid, gid)
    await redis.hset(gen, mapping={"state": "running", "worker": "lost"})
    for event in (Started(gid, "m", 2), Token(gid, "You", 1, [1]), Token(gid, " said:", 2, [2])):
        data = wire.encode(event)
        await redis.xadd(keys.events(sid), {"t": wire.event_type(event), "g": gid, "d": data})
    reapers = [reaper_of(redis, keys) for _ in range(2)]
    queues = [RequestQueue(redis, keys, "m")]
    await asyncio.gather(*(reaper.reap_once(queues) for reaper in reapers))
    entries = wire.entries_of(await redis.xrange(queue))
    queued = [msgspec.json.decode(f[b"r"], type=GenerationRequest) for _id, f in entries[1:]]
    assert len(queued) == 1
    resume = queued[0].resume
    assert resume is not None and resume.takeover == 1 and resume.from_worker == "lost"
    assert (resume.text, resume.token_ids, resume.prompt_tokens) == ("You said:", [1, 2], 2)
    assert (await redis.xpending(queue, CONSUMER_GROUP))["pending"] == 0
    assert await redis.hget(gen, "state") == b"queued"


async def test_one_reaper_at_a_time_holds_the_lock_and_keeps_it(redis: aioredis.Redis) -> None:
    """The first takes the lock; the other's pass finds it held and does nothing else; the
    holder's next pass renews it; once it lapses (the holder stopped) the other takes it."""
    keys = Keys(f"t-{secrets.token_hex(4)}")
    holder, other = counting(redis), counting(redis)
    first, second = (reaper_of(client, keys) for client in (holder, other))
    await first.pass_once()
    owner = await redis.get(keys.reaper_lock)
    assert owner is not None and wire.text(owner).startswith(REAPER_PREFIX)

    await second.pass_once()
    assert other.sent == ["FCALL"], "a pass without the lock is its one round trip"
    assert await redis.get(keys.reaper_lock) == owner

    await redis.pexpire(keys.reaper_lock, 300)
    await first.pass_once()
    assert await redis.get(keys.reaper_lock) == owner
    assert await redis.pttl(keys.reaper_lock) > 1_000, "the holder's pass did not renew it"

    await redis.delete(keys.reaper_lock)  # lapsed
    await second.pass_once()
    taken = await redis.get(keys.reaper_lock)
    assert taken is not None and taken != owner


async def test_a_pass_at_rest_is_three_round_trips(redis: aioredis.Redis) -> None:
    """Holding the lock, a pass over one model's queue (no lost worker, nothing queued)
    is one round trip for the lock, one for the model list, one to look at the queues."""
    keys = Keys(f"t-{secrets.token_hex(4)}")
    await redis.hset(keys.models, "m", "m")
    await redis.xgroup_create(keys.requests("m"), CONSUMER_GROUP, id="0", mkstream=True)
    client = counting(redis)
    reaper = reaper_of(client, keys)
    await reaper.pass_once()  # takes the lock (and loads its script)
    client.sent.clear()
    await reaper.pass_once()
    # The lock, the model list, one look at every queue; nothing pending, nothing waiting,
    # no turn noted: no duty reads more.
    assert client.sent == ["FCALL", "HVALS", "PIPELINE"]


async def test_a_request_waiting_past_the_deadline_in_a_queue_workers_read_is_ended(
    redis: aioredis.Redis,
) -> None:
    """Every worker busy: the group exists and the request waits behind its last-delivered
    id (lag 1). The deadline ends it with ``queue_timeout``; a request already taken is
    not a waiting one."""
    keys = Keys(f"t-{secrets.token_hex(4)}")
    queue = keys.requests("m")
    await redis.hset(keys.models, "m", "m")
    await redis.xgroup_create(queue, CONSUMER_GROUP, id="0", mkstream=True)
    taken = GenerationRequest("g_taken", "s_taken", SamplingParams(max_tokens=5), prompt="a")
    await redis.hset(keys.generation("s_taken", "g_taken"), "state", "queued")  # not claimed yet
    await redis.xadd(queue, {"r": wire.encode(taken)})
    await redis.xreadgroup(CONSUMER_GROUP, "busy", {queue: ">"})
    waiting = GenerationRequest("g_wait", "s_wait", SamplingParams(max_tokens=5), prompt="b")
    await redis.hset(keys.generation("s_wait", "g_wait"), "state", "queued")
    await redis.xadd(queue, {"r": wire.encode(waiting)})
    reaper = reaper_of(redis, keys, queue_timeout_s=0.2)
    assert await reaper.expire_queued([RequestQueue(redis, keys, "m")]) == 0  # in time
    await asyncio.sleep(0.3)
    await reaper.pass_once()  # its look at the queue finds the request waiting
    final = await redis.hget(keys.generation("s_wait", "g_wait"), "final")
    assert final is not None and b"queue_timeout" in final
    assert await redis.hget(keys.generation("s_taken", "g_taken"), "final") is None


async def test_a_worker_heard_from_again_during_a_pass_keeps_what_it_holds(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pass judges a worker silent, then (as when its own writes wait out a Redis write
    pause) the worker heartbeats and reads a new request before the pass reads what it
    holds. The pass judges it again after that read: alive, it keeps both its running reply
    and the new request, and nothing is queued again. Before, the first verdict stood and
    the worker lost what it had just taken, over and over while its heartbeat lagged."""
    keys = Keys(f"t-{secrets.token_hex(4)}")
    queue_key = keys.requests("m")
    await redis.hset(keys.models, "m", "m")
    await redis.xgroup_create(queue_key, CONSUMER_GROUP, id="0", mkstream=True)
    running = GenerationRequest("g_run", "s_run", SamplingParams(max_tokens=10), prompt="hi")
    await redis.xadd(queue_key, {"r": wire.encode(running)})
    await redis.xreadgroup(CONSUMER_GROUP, "back", {queue_key: ">"})
    await redis.hset(
        keys.generation("s_run", "g_run"), mapping={"state": "running", "worker": "back"}
    )
    await redis.zadd(keys.workers, {"back": time.time() - 60})  # silent for a minute
    queue = RequestQueue(redis, keys, "m")
    read_pending = queue.pending_of

    async def heard_from_before_the_read(
        consumer: str, idle_ms: int | None = None
    ) -> list[tuple[str, int]]:
        await redis.zadd(keys.workers, {"back": time.time()})
        fresh = GenerationRequest("g_new", "s_new", SamplingParams(max_tokens=10), prompt="yo")
        await redis.xadd(queue_key, {"r": wire.encode(fresh)})
        await redis.xreadgroup(CONSUMER_GROUP, "back", {queue_key: ">"})
        return await read_pending(consumer, idle_ms)

    monkeypatch.setattr(queue, "pending_of", heard_from_before_the_read)
    await reaper_of(redis, keys).reap_once([queue])
    pending = await redis.xpending(queue_key, CONSUMER_GROUP)
    assert pending["pending"] == 2, pending
    assert [wire.text(c["name"]) for c in pending["consumers"]] == ["back"]
    assert await redis.xlen(queue_key) == 2, "a request was queued again"
    assert await redis.hget(keys.generation("s_run", "g_run"), "worker") == b"back"


async def test_a_reaper_that_cannot_reach_redis_warns_once_not_every_pass(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Nobody listens there; no retries, so that a pass fails at once.
    client = aioredis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))
    reaper = reaper_of(client, Keys(f"t-{secrets.token_hex(4)}"))
    caplog.set_level(logging.INFO, "tokenspout.watchdog")
    try:
        for _ in range(20):
            await reaper.pass_once()
    finally:
        await client.aclose()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "acquiring the reaper lock failed" in warnings[0], warnings


def test_a_failure_that_repeats_is_logged_once_per_interval_then_its_recovery(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr(reaper.time, "monotonic", lambda: now[0])
    caplog.set_level(logging.INFO, "tokenspout.watchdog")
    failures = RepeatedFailures(every_s=10)
    for _ in range(5):  # a pass every 0.1 s for half a second
        failures.failed("looking at the queues", ConnectionError("refused"))
        failures.worked("acquiring the reaper lock")  # another duty: no news
        now[0] += 0.1
    now[0] += 10
    failures.failed("looking at the queues", ConnectionError("refused"))
    failures.worked("looking at the queues")
    failures.worked("looking at the queues")
    assert [r.getMessage() for r in caplog.records] == [
        "reaper: looking at the queues failed: refused",
        "reaper: looking at the queues failed: refused (4 more like it unlogged)",
        "reaper: looking at the queues works again",
    ]
