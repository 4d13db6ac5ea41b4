"""engine/publisher.py against the session's real Redis: a generation's tokens that gather
while a write is under way (Redis a step or more behind) become one event, numbered so
that EMIT's retry and lost-write checks still hold; when Redis keeps up, every token is an
event of its own, written at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from engine.publisher import Publisher, joined
from wire import Done, Keys, Started, Token, Usage
from wire.emit_step import EmitTarget
from wire.generations import Generations
from wire.queue import HELD_TTL_S, RequestQueue

pytestmark = pytest.mark.timeout(30)


class Generation:
    def __init__(self, redis: aioredis.Redis, join_tokens: bool = True) -> None:
        self.redis = redis
        self.keys = Keys(f"t-{secrets.token_hex(4)}")
        self.sid, self.gid = f"s_{secrets.token_hex(4)}", f"g_{secrets.token_hex(4)}"
        self.rejected: list[str] = []
        self.publisher = Publisher(
            Generations(redis, self.keys),
            queue=RequestQueue(redis, self.keys, "m"),
            writer="w-1",
            on_rejected=lambda gid, epoch: self.rejected.append(gid),
            join_tokens=join_tokens,
        )
        self.target: EmitTarget = self.publisher.generations.target(
            self.sid, self.gid, epoch=0, ttl_s=600, maxlen=1000
        )

    async def claim(self) -> None:
        """Queued as the gateway leaves it, then claimed by the writer (event 1)."""
        gen = self.keys.generation(self.sid, self.gid)
        await self.redis.hset(gen, mapping={"state": "queued"})
        await self.redis.expire(gen, 600)
        assert await self.publisher.emit_waited(self.target, Started(self.gid, "m", 3), 1)

    def token(self, text: str, count: int) -> Token:
        return Token(self.gid, text, count, [count], [-0.1 * count])

    async def events(self) -> list[dict[str, object]]:
        entries = await self.redis.xrange(self.keys.events(self.sid))
        return [json.loads(fields[b"d"]) for _, fields in entries]


@contextlib.asynccontextmanager
async def publishing(generation: Generation) -> AsyncIterator[Generation]:
    """Its publisher running, the generation claimed."""
    running = asyncio.create_task(generation.publisher.run_forever())
    try:
        await generation.claim()
        yield generation
    finally:
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running


@pytest.fixture
async def generation(redis: aioredis.Redis) -> AsyncIterator[Generation]:
    async with publishing(Generation(redis)) as made:
        yield made


async def until_writing(publisher: Publisher) -> None:
    async with asyncio.timeout(10):
        while not publisher.writing:
            await asyncio.sleep(0)


async def test_tokens_that_gather_behind_a_write_become_one_event(generation: Generation) -> None:
    publisher = generation.publisher
    assert publisher.emit(generation.target, generation.token("a", 1), 2) == 2
    await until_writing(publisher)
    # The write of "a" is under way (it needs a turn of the event loop to end): the next
    # three tokens gather for the next write and join into one event, number 3.
    seqs = [
        publisher.emit(generation.target, generation.token(t, n), 3)
        for t, n in (("b", 2), ("c", 3), ("d", 4))
    ]
    assert seqs == [3, 3, 3]
    done = Done(generation.gid, "length", Usage(3, 4))
    assert await publisher.emit_waited(generation.target, done, 4, final=True)

    events = await generation.events()
    assert [e["type"] for e in events] == ["started", "token", "token", "done"]
    assert events[1] == {
        "type": "token",
        "generation_id": generation.gid,
        "text": "a",
        "count": 1,
        "token_ids": [1],
        "logprobs": [-0.1],
    }
    assert events[2]["text"] == "bcd" and events[2]["count"] == 4
    assert events[2]["token_ids"] == [2, 3, 4]
    assert events[2]["logprobs"] == pytest.approx([-0.2, -0.3, -0.4])
    assert generation.rejected == []  # numbered 1-4 with no gap: no events_lost


async def test_when_redis_keeps_up_each_token_is_its_own_event(generation: Generation) -> None:
    publisher = generation.publisher
    for count, text in enumerate("abc", start=1):
        assert publisher.emit(generation.target, generation.token(text, count), count + 1) == (
            count + 1
        )
        await publisher.written()
    events = await generation.events()
    assert [e["text"] for e in events if e["type"] == "token"] == ["a", "b", "c"]


async def test_an_event_after_a_token_keeps_it_apart(generation: Generation) -> None:
    """A final event (or any waited one) closes the token before it: a token after it is a
    new event, so the order of events stays the order they were emitted in."""
    publisher = generation.publisher
    publisher.emit(generation.target, generation.token("a", 1), 2)
    await until_writing(publisher)
    assert publisher.emit(generation.target, generation.token("b", 2), 3) == 3
    final = publisher.emit_waited(
        generation.target, Done(generation.gid, "stop", Usage(3, 2)), 4, final=True
    )
    assert publisher.emit(generation.target, generation.token("late", 3), 5) == 5
    assert await final
    await publisher.written()
    events = await generation.events()
    assert [e["type"] for e in events] == ["started", "token", "token", "done"]
    assert generation.rejected == [generation.gid]  # the token after the final: refused


def test_joined_tokens_keep_text_ids_and_logprobs_in_order() -> None:
    first, then = Token("g", "Hel", 2, [7, 8]), Token("g", "lo", 3, [9])
    assert joined(first, then) == Token("g", "Hello", 3, [7, 8, 9], None)
    with_logprobs = joined(Token("g", "a", 1, [1], [-1.0]), Token("g", "b", 2, [2], [-2.0]))
    assert with_logprobs.logprobs == [-1.0, -2.0]


async def test_without_join_tokens_every_token_stays_its_own_event(redis: aioredis.Redis) -> None:
    """The default: a reply late behind a slow Redis keeps one event per token."""
    async with publishing(Generation(redis, join_tokens=False)) as generation:
        publisher = generation.publisher
        publisher.emit(generation.target, generation.token("a", 1), 2)
        await until_writing(publisher)
        seqs = [
            publisher.emit(generation.target, generation.token(t, n), n + 1)
            for t, n in (("b", 2), ("c", 3))
        ]
        assert seqs == [3, 4]
        await publisher.written()
    events = await generation.events()
    assert [e["text"] for e in events if e["type"] == "token"] == ["a", "b", "c"]


async def test_a_reply_ends_in_the_call_of_its_last_token_holding_its_prefixes(
    generation: Generation,
) -> None:
    """A final event with the prefixes its reply left in the engine (``held``) goes in the
    same call as the step's last token, and the writer holds them by the time it is
    written: the client's next turn finds its holder (on one Redis, in the same round
    trip)."""
    publisher, redis = generation.publisher, generation.redis
    base = publisher.queue.fair.base
    calls = publisher.pipelines
    publisher.emit(generation.target, generation.token("a", 1), 2)
    done = Done(generation.gid, "length", Usage(3, 1))
    held = ["0a1b2c3d4e5f6071", "8192a3b4c5d6e7f8"]
    assert await publisher.emit_waited(generation.target, done, 3, final=True, held=held)
    assert publisher.pipelines - calls == 1  # the token, the end and the names in one call
    assert [event["type"] for event in await generation.events()] == ["started", "token", "done"]
    for name in held:
        assert await redis.smembers(f"{base}:h:{name}") == {b"w-1"}
        assert 0 < await redis.ttl(f"{base}:h:{name}") <= HELD_TTL_S


async def test_replies_ending_in_one_step_hold_their_prefixes_in_its_one_call(
    redis: aioredis.Redis,
) -> None:
    """300 replies of a worker end in one engine step: their final events and the names of
    every prefix they left go in one call (a call each would ask the client's pool, 100
    connections, for 300), each name held by the writer once it is written."""
    async with publishing(Generation(redis)) as generation:
        publisher, keys = generation.publisher, generation.keys
        ending = [(f"s_{n}", f"g_{n:04d}") for n in range(300)]
        targets = [
            publisher.generations.target(sid, gid, epoch=0, ttl_s=600, maxlen=1000)
            for sid, gid in ending
        ]
        for sid, gid in ending:
            await redis.hset(keys.generation(sid, gid), mapping={"state": "queued"})
        claims = [
            publisher.emit_waited(target, Started(target.generation_id, "m", 3), 1)
            for target in targets
        ]
        assert all(await asyncio.gather(*claims))
        calls = publisher.pipelines
        names = {gid: [f"{n:04x}{gid[2:]}aaaaaaaa" for n in range(3)] for _, gid in ending}
        finals = [
            publisher.emit_waited(
                target,
                Done(target.generation_id, "stop", Usage(3, 0)),
                2,
                final=True,
                held=names[target.generation_id],
            )
            for target in targets
        ]
        assert all(await asyncio.gather(*finals))
        assert publisher.pipelines - calls == 1
        base = publisher.queue.fair.base
        for name in (name for held in names.values() for name in held):
            assert await redis.smembers(f"{base}:h:{name}") == {b"w-1"}
