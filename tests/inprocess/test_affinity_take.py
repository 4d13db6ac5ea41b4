"""The queue's placement by cache affinity (wire/lua/fair_take.lua, fair_hold.lua; docs/
affinity.md), against the session's real Redis: "workers" here are consumer names taking
through ``RequestQueue.take`` with a wait for affinity."""

from __future__ import annotations

import asyncio
import secrets
import time

import msgspec
import pytest
import redis.asyncio as aioredis

import wire
from engine.policies import HELD_RETOLD_S, PrefillRate, ToldNames
from wire import ChatMessage, GenerationRequest, Keys, SamplingParams, prefixes
from wire.queue import HELD_TTL_S, RequestQueue, ServedTokens
from wire.replies import StreamEntry
from wire.scripts import AffinityWait

pytestmark = pytest.mark.timeout(30)

WAIT_MS = 300


async def fresh_queue(redis: aioredis.Redis) -> RequestQueue:
    queue = RequestQueue(redis, Keys(f"aff-{secrets.token_hex(3)}"), "m")
    await queue.ensure_group()
    return queue


def chat(gid: str, *contents: str) -> GenerationRequest:
    roles = ("user", "assistant")
    messages = [ChatMessage(roles[i % 2], text) for i, text in enumerate(contents)]
    return GenerationRequest(gid, f"s-{gid}", SamplingParams(), messages=messages)


async def submit(queue: RequestQueue, request: GenerationRequest) -> None:
    named = prefixes.asked(queue.model, request)
    await queue.submit(
        queue.waiting(wire.encode(request), estimate=10, tenant="", weight=1, prefixes=named)
    )


async def take_entries(
    queue: RequestQueue,
    worker: str,
    count: int = 4,
    block_ms: int = 10,
    prefill: float = 0,
    most_ms: int = WAIT_MS,
) -> list[StreamEntry]:
    wait = AffinityWait(most_ms, prefill)
    return await queue.take(worker, count, block_ms, ServedTokens(), affinity=wait)


async def next_taken(
    queue: RequestQueue, worker: str, prefill: float = 0, most_ms: int = WAIT_MS
) -> list[StreamEntry]:
    """What ``worker`` takes first, however many looks that takes (a look that wakes as a
    wait ends may come a moment before it)."""
    while not (entries := await take_entries(queue, worker, 4, 5_000, prefill, most_ms)):
        pass
    return entries


def generation_ids(entries: list[StreamEntry]) -> list[str]:
    return [msgspec.json.decode(f[b"r"], type=GenerationRequest).generation_id for _, f in entries]


async def take(queue: RequestQueue, worker: str, count: int = 4, block_ms: int = 10) -> list[str]:
    return generation_ids(await take_entries(queue, worker, count, block_ms))


async def ran(queue: RequestQueue, worker: str, request: GenerationRequest, reply: str) -> None:
    await queue.hold(worker, prefixes.held(queue.model, request, reply))


async def test_a_next_turn_waits_for_its_free_holder_and_goes_to_it(redis: aioredis.Redis) -> None:
    """Turn 2 names turn 1's prompt and reply: the worker that ran turn 1 takes it; another
    idle worker passes it over (and takes what nobody holds, in the queue's order)."""
    queue = await fresh_queue(redis)
    first = chat("t1", "tell me a story")
    await ran(queue, "wa", first, "once upon a time")
    assert await take(queue, "wa", 1) == []  # says it has a free slot
    await submit(queue, chat("t2", "tell me a story", "once upon a time", "and then?"))
    await submit(queue, chat("x1", "something else"))
    assert await take(queue, "wb") == ["x1"]
    assert await take(queue, "wa") == ["t2"]


async def test_a_holder_that_is_full_or_gone_holds_nothing(redis: aioredis.Redis) -> None:
    """A holder that said it has no free slot left is passed over at once; one that took
    nothing for the wait (busy, gone) loses the request to any worker after it."""
    queue = await fresh_queue(redis)
    await ran(queue, "wa", chat("t1", "hello"), "hi")
    assert await take(queue, "wa", 1) == []
    await submit(queue, chat("t2", "hello", "hi", "how are you?"))
    await submit(queue, chat("t3", "hello", "hi", "and you?"))
    assert await take(queue, "wb") == []  # waiting for wa, free
    began = time.monotonic()
    taken = await take(queue, "wb", block_ms=5_000)  # the wait ran out
    assert time.monotonic() - began >= WAIT_MS / 1000 * 0.8
    while len(taken) < 2:  # t3 came a moment after t2: on a busy machine its wait ends later
        taken += await take(queue, "wb", block_ms=5_000)
    assert taken == ["t2", "t3"]
    assert time.monotonic() - began < 2.0
    await submit(queue, chat("t4", "hello", "hi", "bye"))
    assert await take(queue, "wa", 1) == ["t4"]  # wa now full: nobody waits for it
    await submit(queue, chat("t5", "hello", "hi", "bye again"))
    assert await take(queue, "wb") == ["t5"]


async def test_the_holder_is_woken_by_its_own_bell(redis: aioredis.Redis) -> None:
    """An idle holder waiting on the queue's bells wakes for a request it holds."""
    queue = await fresh_queue(redis)
    await ran(queue, "wa", chat("t1", "hello"), "hi")
    assert await take(queue, "wa", 1) == []
    waiting = asyncio.create_task(take(queue, "wa", block_ms=5_000))
    await asyncio.sleep(0.05)
    began = time.monotonic()
    await submit(queue, chat("t2", "hello", "hi", "more"))
    assert await waiting == ["t2"]
    assert time.monotonic() - began < WAIT_MS / 1000


async def test_a_request_waits_no_longer_than_its_held_prefix_takes_to_prefill(
    redis: aioredis.Redis,
) -> None:
    """The wait is bounded by the taker's prefill rate: a short history (about 100 tokens
    at 1,000 tokens/s: 100 ms) goes to the idle non-holder well before the bound (2 s), a
    long one (about 3,000 tokens: 3 s) only at the bound; each taken entry says how long it
    was queued, and a request its holder takes is a hit."""
    queue = await fresh_queue(redis)
    short = ("hello " * 40, "hi, " * 40)
    long = ("x" * 12_000, "a long answer")
    await ran(queue, "wa", chat("s1", short[0]), short[1])
    await ran(queue, "wa", chat("l1", long[0]), long[1])
    assert await take(queue, "wa", 1) == []  # wa has a free slot: requests wait for it
    await submit(queue, chat("l2", *long, "and then?"))
    await submit(queue, chat("s2", *short, "tell me more"))
    began = time.monotonic()
    entries = await next_taken(queue, "wb", prefill=1_000, most_ms=2_000)
    short_wait = time.monotonic() - began
    assert generation_ids(entries) == ["s2"]
    assert short_wait < 1.0, short_wait
    assert entries[0][1][b"a"] == b"miss" and 100 <= int(entries[0][1][b"w"]) < 1_000
    entries = await next_taken(queue, "wb", prefill=1_000, most_ms=2_000)
    assert generation_ids(entries) == ["l2"]
    assert time.monotonic() - began >= 1.8
    assert entries[0][1][b"a"] == b"miss" and int(entries[0][1][b"w"]) >= 2_000
    await submit(queue, chat("s3", *short, "and more"))
    entries = await take_entries(queue, "wa", prefill=1_000)
    assert generation_ids(entries) == ["s3"] and entries[0][1][b"a"] == b"hit"


async def test_a_taker_that_measured_no_prefill_yet_waits_the_bound(
    redis: aioredis.Redis,
) -> None:
    queue = await fresh_queue(redis)
    await ran(queue, "wa", chat("s1", "hello there"), "hi")
    assert await take(queue, "wa", 1) == []
    await submit(queue, chat("s2", "hello there", "hi", "more"))
    began = time.monotonic()
    assert generation_ids(await next_taken(queue, "wb")) == ["s2"]
    assert time.monotonic() - began >= WAIT_MS / 1000 * 0.9


def test_the_prefill_rate_is_a_recent_mean_of_runs_long_enough_to_tell() -> None:
    rate = PrefillRate()
    rate.observe(10, 0.001)  # too short to tell the prefill from the step
    assert rate.tokens_per_s == 0
    rate.observe(1_000, 0.5)
    assert rate.tokens_per_s == 2_000
    rate.observe(1_000, 1.0)
    assert rate.tokens_per_s == pytest.approx(2_000 - PrefillRate.WEIGHT * 1_000)


def test_a_prefix_told_held_is_told_again_only_a_minute_later() -> None:
    """A worker says a prefix it holds once per ``HELD_RETOLD_S`` (its holders live five
    times that long after a saying), however many replies leave it; past ``most`` names
    remembered, the oldest is forgotten and told again at its next reply."""
    told = ToldNames(most=3)
    assert told.due(["sys", "a"], now=0.0) == ["sys", "a"]
    assert told.due(["sys", "b"], now=1.0) == ["b"]
    assert told.due(["sys"], now=HELD_RETOLD_S - 0.1) == []
    assert told.due(["sys", "a"], now=HELD_RETOLD_S) == ["sys", "a"]
    assert HELD_RETOLD_S * 5 <= HELD_TTL_S
    told.due(["c"], now=HELD_RETOLD_S + 1)  # four names: "b" (told longest ago) is forgotten
    assert told.due(["b", "c"], now=HELD_RETOLD_S + 2) == ["b"]
