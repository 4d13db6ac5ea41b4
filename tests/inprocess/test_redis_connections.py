"""How gateway and engine connect to Redis (wire/connect.py), read off a real socket."""

from __future__ import annotations

import socket

from stack.redis_server import EmbeddedRedis
from wire.connect import TCP_LIVENESS, connect


async def test_a_tcp_connection_checks_liveness_and_has_no_command_timeout(
    redis_server: EmbeddedRedis,
) -> None:
    """No command timeout (redis-py 8's 5 s one cost every command a task on Python 3.11);
    a dead server is found by TCP instead: keepalive probes after 4 s idle and
    ``TCP_USER_TIMEOUT`` on unanswered writes, set on the connection's own socket."""
    client = connect(redis_server.url, max_connections=2, timeout=5)
    try:
        assert await client.ping()
        connection = await client.connection_pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            assert connection.socket_timeout is None
            sock = connection._writer.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            for option, value in TCP_LIVENESS.items():
                assert sock.getsockopt(socket.IPPROTO_TCP, option) == value
            assert socket.TCP_USER_TIMEOUT in TCP_LIVENESS  # Linux, where this runs
        finally:
            await client.connection_pool.release(connection)
    finally:
        await client.aclose()
        await client.connection_pool.disconnect()


async def test_a_new_connection_sends_nothing_that_fails(redis_server: EmbeddedRedis) -> None:
    """redis-py 8 asks every new TCP connection for Redis Enterprise's maintenance
    notifications, which Redis and Valkey refuse: a failed round trip per connection, and
    a read inside a reconnect that raced a pub/sub reader after a Redis restart (the chaos
    soak: a RuntimeError, a 500). Off: a fresh connection's handshake leaves no error."""
    for options in ({}, {"max_connections": 2}):
        client = connect(redis_server.url, **options)
        try:
            await client.config_resetstat()
            fresh = connect(redis_server.url, **options)
            assert await fresh.ping()
            await fresh.aclose()
            await fresh.connection_pool.disconnect()
            assert await client.info("errorstats") == {}
        finally:
            await client.aclose()
            await client.connection_pool.disconnect()
