"""How gateway and engine connect to Redis (wire/connect.py), read off a real socket."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.live import PlainLive
from stack.redis_server import EmbeddedRedis
from tests.support.reset_proxy import ResettingProxy
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


class RelayThroughProxy:
    """The relay's pub/sub source (``PlainLive``) on a connection through a resetting proxy,
    with every subscription it reports: what the three tests below break and watch."""

    def __init__(self, proxy: ResettingProxy) -> None:
        self.proxy = proxy
        self.client = connect(proxy.url)
        self.reports: list[tuple[str, bool]] = []
        self.lost = asyncio.Event()
        self.live = PlainLive(
            self.client, lambda _c, _d: None, self.report, self.lost.set
        )  # the reader is not started: tests start it when they want one

    def report(self, channel: str, ok: bool) -> None:
        self.reports.append((channel, ok))

    async def until_confirmed(self, *channels: str) -> None:
        async with asyncio.timeout(10):
            while not {(channel, True) for channel in channels} <= set(self.reports):
                await asyncio.sleep(0.01)

    async def close(self) -> None:
        await self.live.close()
        await self.client.aclose()


@contextlib.asynccontextmanager
async def relay_through_proxy(redis_server: EmbeddedRedis) -> AsyncIterator[RelayThroughProxy]:
    async with ResettingProxy(redis_server.port) as proxy:
        relay = RelayThroughProxy(proxy)
        try:
            yield relay
        finally:
            await relay.close()


def test_a_pubsub_connection_reset_while_nobody_reads_it_is_a_lost_connection(
    redis_server: EmbeddedRedis,
) -> None:
    """Under uvloop (the gateway's loop) a write on a connection reset while nobody read it
    raised ``RuntimeError: ... the handler is closed`` out of redis-py: the relay's
    unsubscribe at a request's end then answered it 500 (the chaos soak, a Redis restart).
    It is a lost connection: a Redis ``ConnectionError``, which the relay handles."""

    async def reset_between_commands() -> None:
        async with relay_through_proxy(redis_server) as relay:
            await relay.live.subscribe("a")  # no reader started: nobody reads the connection
            relay.proxy.reset_clients()
            await asyncio.sleep(0.2)  # the loop sees the reset and closes the transport
            with pytest.raises(RedisConnectionError):
                await relay.live.unsubscribe("a")

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(reset_between_commands())


async def test_a_channel_subscribed_while_the_relay_reconnects_is_reported_lost_then_back(
    redis_server: EmbeddedRedis,
) -> None:
    """A request that subscribes while the relay's reader waits to reconnect sends its
    SUBSCRIBE on the connection being dropped. Its feed must hear of the loss before the
    reader's fresh connection confirms it: else a new session's feed waits for a first
    live event that may have come and gone (the chaos soak: a request that hung)."""
    async with relay_through_proxy(redis_server) as relay:
        await relay.live.start()
        await relay.live.subscribe("a")
        await relay.until_confirmed("a")
        relay.proxy.reset_clients()
        await relay.lost.wait()  # the reader saw the loss and waits before reconnecting
        await relay.live.subscribe("b")
        await relay.until_confirmed("b")
        assert [ok for channel, ok in relay.reports if channel == "b"] == [False, True]


async def test_only_the_relays_reader_reconnects_a_lost_pubsub_connection(
    redis_server: EmbeddedRedis,
) -> None:
    """redis-py reconnects a failed pub/sub connection inside whichever task failed and reads
    the server's handshake there: a request's (un)subscribe then read while the relay's
    reader waited on the same connection (``RuntimeError: read() called while another
    coroutine is already waiting``, a 500 in the chaos soak). A request's command on a lost
    connection now opens nothing; the reader opens a fresh one, with every channel on it."""
    async with relay_through_proxy(redis_server) as relay:
        await relay.live.subscribe("a")  # the reader is not started: nobody reads
        relay.proxy.reset_clients()
        await asyncio.sleep(0.2)
        for _ in range(3):  # the first send finds the connection lost and drops it
            await relay.live.subscribe("b")
            await relay.live.unsubscribe("b")
        await relay.live.subscribe("c")
        assert relay.proxy.accepted == 1  # no request reconnected
        await relay.live.start()
        await relay.until_confirmed("a", "c")
        assert relay.proxy.accepted == 2  # the reader's fresh connection
        assert ("a", False) in relay.reports and ("c", False) in relay.reports
        assert ("b", True) not in relay.reports
