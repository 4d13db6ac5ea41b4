"""wire/batched.py: a script's calls with one round trip under way at a time, on a real
Redis. A burst of calls through a gateway's small blocking pool, while Redis is held up,
no longer waits for connections (nor fails for want of one); each call gets its own reply
or error; a Redis that lost its scripts gets them again."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from stack.redis_server import EmbeddedRedis
from wire.batched import BatchedCalls
from wire.connect import connect

ECHO = "if ARGV[1] == 'fail' then return redis.error_reply('asked to fail') end return ARGV[1]"
ECHO_LIBRARY = (
    "#!lua name=batched_echo\n"
    f"redis.register_function('batched_echo', function(KEYS, ARGV) {ECHO} end)"
)
BURST = 200


@pytest.fixture
async def small_pool(redis_server: EmbeddedRedis) -> AsyncIterator[Redis]:
    """A gateway's kind of client: a blocking pool, here of 2 connections waiting 0.5 s."""
    client = connect(
        redis_server.url,
        max_connections=2,
        timeout=0.5,
        client_name=f"batched-{secrets.token_hex(4)}",
    )
    yield client
    await client.aclose()
    await client.connection_pool.disconnect()


@pytest.fixture(params=["EVALSHA", "FCALL"])
def kind(request: pytest.FixtureRequest) -> str:
    """How the script is called: EVALSHA (a cluster), a library's FCALL (one Redis)."""
    return str(request.param)


def batched(client: Redis, kind: str, loads: list[None] | None = None) -> BatchedCalls:
    async def load() -> None:
        if kind == "FCALL":
            await client.function_load(ECHO_LIBRARY, replace=True)
        else:
            await client.script_load(ECHO)
        if loads is not None:
            loads.append(None)

    name = "batched_echo" if kind == "FCALL" else client.register_script(ECHO).sha
    return BatchedCalls(client, (kind, name), load)


async def test_a_burst_while_redis_is_held_up_waits_for_no_connection(
    small_pool: Redis, redis: Redis, kind: str
) -> None:
    """Before (a call each): the 198 calls beyond the pool's 2 connections waited for one,
    and failed after 0.5 s ('No connection available') while Redis was paused for 1 s."""
    calls = batched(small_pool, kind)
    await redis.execute_command("CLIENT", "PAUSE", 1000, "ALL")
    replies = await asyncio.gather(*(calls([], [f"r{n}"]) for n in range(BURST)))
    assert replies == [f"r{n}".encode() for n in range(BURST)]


async def test_each_call_of_a_batch_gets_its_own_reply_or_error(
    small_pool: Redis, kind: str
) -> None:
    calls = batched(small_pool, kind)
    first = asyncio.ensure_future(calls([], ["lone"]))
    await asyncio.sleep(0)  # under way: the next ones gather into one pipeline
    asked = ["a", "fail", "b"]
    results = await asyncio.gather(*(calls([], [arg]) for arg in asked), return_exceptions=True)
    assert await first == b"lone"
    assert results[0] == b"a" and results[2] == b"b"
    assert isinstance(results[1], ResponseError) and "asked to fail" in str(results[1])
    with pytest.raises(ResponseError, match="asked to fail"):
        await calls([], ["fail"])  # a lone call's own error


async def test_a_redis_that_lost_its_scripts_gets_them_again(small_pool: Redis, kind: str) -> None:
    """A restarted Redis has no scripts: the first call of a burst is answered NOSCRIPT (or
    "Function not found"), loads the script once and goes again; the calls gathered
    meanwhile follow."""
    loads: list[None] = []
    calls = batched(small_pool, kind, loads)
    assert await calls([], ["loaded"]) == b"loaded"  # loaded here unless a test before did
    loads.clear()
    if kind == "FCALL":
        await small_pool.function_flush()
    else:
        await small_pool.script_flush()
    burst = await asyncio.gather(*(calls([], [f"b{n}"]) for n in range(20)))
    assert burst == [f"b{n}".encode() for n in range(20)]
    assert len(loads) == 1
