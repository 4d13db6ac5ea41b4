"""A queued turn notes itself on its session's meta (gateway/core/conversations.py
``touched``, wire/lua/touch.lua), against a real Redis: when and, if the conversation has
none, its title; never the meta of a session Redis lost since. Written back with only
these fields, such a meta made the session "exist" again with no token and no TTL: its
readers were not told it was lost, and a lost turn was submitted into it again (chaos soak,
one Redis, seed 2: a reply started over after the part its reader had)."""

from __future__ import annotations

import secrets

import redis.asyncio as aioredis

from gateway.core.conversations import Conversations
from gateway.core.settings import Settings
from wire import Keys

SESSION = "s_touched"


def conversations(redis: aioredis.Redis) -> tuple[Conversations, Keys]:
    settings = Settings(key_prefix=f"touch-{secrets.token_hex(4)}")
    keys = Keys(settings.key_prefix)
    return Conversations(redis, keys, settings), keys


async def test_a_queued_turn_dates_its_conversation_and_names_one_without_a_title(
    redis: aioredis.Redis,
) -> None:
    made, keys = conversations(redis)
    meta = keys.meta(SESSION)
    await redis.hset(meta, mapping={"token": "digest", "created": 1.0})
    await made.touched(SESSION, "owner", "tell me about tides\nand more")
    assert (await redis.hget(meta, "title")) == b"tell me about tides"
    updated = float(await redis.hget(meta, "updated") or 0)
    assert updated > 1.0
    await made.touched(SESSION, "owner", "another question")  # a title stays
    assert (await redis.hget(meta, "title")) == b"tell me about tides"
    await made.touched(SESSION, "owner", "an edited first message", first=True)
    assert (await redis.hget(meta, "title")) == b"an edited first message"
    assert await redis.zscore(keys.owner("owner"), SESSION) is not None


async def test_a_turn_queued_after_redis_lost_the_session_does_not_make_its_meta_again(
    redis: aioredis.Redis,
) -> None:
    made, keys = conversations(redis)
    await made.touched(SESSION, "owner", "hello", first=True)
    assert not await redis.exists(keys.meta(SESSION))


async def test_a_redis_that_lost_its_scripts_is_sent_the_touch_again(
    redis: aioredis.Redis,
) -> None:
    made, keys = conversations(redis)
    meta = keys.meta(SESSION)
    await redis.hset(meta, mapping={"token": "digest", "created": 1.0})
    await made.touched(SESSION, None, "first")
    await redis.script_flush()  # what a restart does
    await made.touched(SESSION, None, "second", first=True)
    assert (await redis.hget(meta, "title")) == b"second"
