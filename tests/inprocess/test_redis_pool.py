"""wire/pool.py: redis-py's pools with a fast path for an idle connection, on a real Redis.

Each path the fast one leaves to redis-py is driven here: a connection holding a reply
nobody read, a connection whose server closed it, requests waiting for a connection of a
full blocking pool, a command cancelled halfway."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from stack.redis_server import EmbeddedRedis
from wire.connect import connect
from wire.pool import LeanBlockingConnectionPool, LeanConnectionPool


@pytest.fixture
async def gateway_client(redis_server: EmbeddedRedis) -> AsyncIterator[Redis]:
    client = connect(
        redis_server.url, max_connections=2, client_name=f"pool-{secrets.token_hex(4)}"
    )
    yield client
    await client.aclose()
    await client.connection_pool.disconnect()


async def test_both_kinds_of_client_use_the_lean_pools(redis_server: EmbeddedRedis) -> None:
    engine, gateway = connect(redis_server.url), connect(redis_server.url, max_connections=4)
    try:
        assert type(engine.connection_pool) is LeanConnectionPool
        assert type(gateway.connection_pool) is LeanBlockingConnectionPool
        assert gateway.connection_pool.max_connections == 4
    finally:
        await engine.aclose()
        await gateway.aclose()
        await gateway.connection_pool.disconnect()


async def test_commands_reuse_one_idle_connection(gateway_client: Redis) -> None:
    for i in range(20):
        await gateway_client.set("k", i)
        assert await gateway_client.get("k") == str(i).encode()
    assert len(await clients_of(gateway_client)) == 1


async def test_a_connection_holding_an_unread_reply_is_reconnected_first(
    gateway_client: Redis,
) -> None:
    """A reply left on an idle connection would answer the next command with it."""
    pool = gateway_client.connection_pool
    await gateway_client.set("k", "right")
    connection = await pool.get_connection()
    await connection.send_command("ECHO", "stale")  # its reply is never read
    await pool.release(connection)
    await asyncio.sleep(0.05)  # the reply arrives in the connection's buffer
    assert await gateway_client.get("k") == b"right"


async def test_a_connection_its_server_closed_is_reconnected_first(
    gateway_client: Redis,
) -> None:
    await gateway_client.set("k", "v")
    own_id = await gateway_client.client_id()  # of its one connection, idle after this
    await kill_beside(gateway_client, own_id)
    await asyncio.sleep(0.05)  # the close reaches the idle connection
    assert await gateway_client.get("k") == b"v"


async def test_requests_waiting_for_a_full_pool_are_each_served(gateway_client: Redis) -> None:
    """Two connections, ten blocking reads at once: eight wait in redis-py's pool and are
    woken as connections come back."""
    blocked = [gateway_client.blpop([f"list{i}"], timeout=5) for i in range(10)]
    reads = asyncio.gather(*blocked)
    await asyncio.sleep(0.1)
    for i in range(10):
        await push_beside(gateway_client, f"list{i}")
    async with asyncio.timeout(10):
        results = await reads
    assert [r[0] for r in results] == [f"list{i}".encode() for i in range(10)]
    assert len(await clients_of(gateway_client)) <= 2


async def test_a_command_cancelled_halfway_leaves_no_reply_for_the_next(
    gateway_client: Redis,
) -> None:
    await gateway_client.set("k", "right")
    waiting = asyncio.create_task(gateway_client.blpop(["never"], timeout=0.3))
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.sleep(0.4)  # the BLPOP's nil reply would be there by now
    for _ in range(3):
        assert await gateway_client.get("k") == b"right"


async def clients_of(client: Redis) -> list[dict[str, str]]:
    """The server's connections of ``client`` (by its name), as another client sees them."""
    own = client.connection_pool.connection_kwargs
    async with Redis(host=own["host"], port=own["port"]) as other:
        return [c for c in await other.client_list() if c["name"] == own["client_name"]]


async def kill_beside(client: Redis, client_id: int) -> None:
    own = client.connection_pool.connection_kwargs
    async with Redis(host=own["host"], port=own["port"]) as other:
        assert await other.client_kill_filter(_id=client_id) == 1


async def push_beside(client: Redis, key: str) -> None:
    own = client.connection_pool.connection_kwargs
    async with Redis(host=own["host"], port=own["port"]) as other:
        await other.rpush(key, "x")
