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
from engine.metrics import WorkerMetrics
from engine.policies import CacheAffinity
from wire import ChatMessage, GenerationRequest, Keys, SamplingParams, prefixes
from wire.queue import RequestQueue, ServedTokens

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
    names = prefixes.asked(queue.model, request)
    await queue.submit(
        queue.waiting(wire.encode(request), estimate=10, tenant="", weight=1, names=names)
    )


async def take(queue: RequestQueue, worker: str, count: int = 4, block_ms: int = 10) -> list[str]:
    taken = await queue.take(worker, count, block_ms, ServedTokens(), affinity_ms=WAIT_MS)
    return [msgspec.json.decode(f[b"r"], type=GenerationRequest).generation_id for _, f in taken]


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
    assert await take(queue, "wb", block_ms=5_000) == ["t2", "t3"]  # the wait ran out
    assert WAIT_MS / 1000 * 0.8 <= time.monotonic() - began < 2.0
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


async def test_replies_ending_together_are_told_held_in_a_few_calls(
    redis: aioredis.Redis,
) -> None:
    """300 replies of a worker end at once: each waits until its names are held, and they
    go in a few calls (one each would ask the client's pool, 100 connections, for 300)."""
    queue = await fresh_queue(redis)
    policy = CacheAffinity(queue, "wa", ServedTokens(), wait_ms=WAIT_MS, metrics=WorkerMetrics())
    requests = [chat(f"t{n}", f"conversation {n}") for n in range(300)]
    await asyncio.gather(*(policy.ran(request, "a reply") for request in requests))
    for request in requests:
        for name in prefixes.held(queue.model, request, "a reply"):
            assert await redis.smembers(f"{queue.fair.base}:h:{name}") == {b"wa"}
