"""On Sentinel (REDIS_URL=redis+sentinel://...): a primary, one replica and 3 Sentinels of
the test's own (stack/redis_sentinel.py), real gateways and synthetic engines.

A reply streams whole through a gateway and a worker that find the primary by asking the
Sentinels; and when the primary is killed mid-stream, the Sentinels promote the replica,
the gateway and the worker follow them to it, and the reader's stream pauses and goes on
with nothing lost or repeated (or ends with a clear error where the replica lacked writes),
never hangs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from stack.redis_sentinel import EmbeddedSentinel
from tests.support.cluster import check_reply, outage_s
from tests.support.http import create_session, follow, send
from tests.support.stack import Stack
from tests.support.tenants import ADMIN_KEY, keyed_session, make_key, usage_total
from wire import Keys
from wire.connect import connect

pytestmark = [pytest.mark.timeout(240), pytest.mark.sentinel]


async def test_a_reply_streams_whole_through_sentinel(sentinel_stack: Stack) -> None:
    """A key's session turn streams whole; its key's limits are admitted and its usage is
    counted on the primary, as on one Redis (in the scripts that admit and end it)."""
    stack = sentinel_stack
    stack.synthetic(200)
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY)
    content, max_tokens = "ask the sentinels", 60
    async with httpx.AsyncClient(timeout=60) as client:
        key = await make_key(client, gateway.url, "watched", limits={"requests_per_minute": 9})
        session = await keyed_session(client, gateway.url, key)
        gid = await send(client, session, content, max_tokens=max_tokens)
        follower = follow(client, session, gid)
        await follower.until_end(60)
        usage = check_reply(follower.reading.events, gid, content, max_tokens)["usage"]
        total = await usage_total(client, gateway.url, key.id)
    assert total["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0


async def test_a_submit_is_answered_once_a_replica_holds_it_when_asked(
    sentinel_stack: Stack, redis_sentinel: EmbeddedSentinel
) -> None:
    """``TOKENSPOUT_WAIT_REPLICAS=1``: a message is answered (202) once a replica holds its
    submit (``WAIT``), so a failover right after cannot lose what its client was told of.
    With the replica frozen for 1 s the 202 waits for it, and the replica then holds the
    generation; past ``TOKENSPOUT_WAIT_TIMEOUT_MS`` it is answered anyway (a replica that
    is down does not stop service); without the setting it is answered at once. (Runs
    before the failover below, which leaves no replica.)"""
    stack = sentinel_stack
    stack.synthetic(200)
    sides = [
        (stack.gateway(), True),
        (stack.gateway(TOKENSPOUT_WAIT_REPLICAS="1", TOKENSPOUT_WAIT_TIMEOUT_MS="5000"), False),
        (stack.gateway(TOKENSPOUT_WAIT_REPLICAS="1", TOKENSPOUT_WAIT_TIMEOUT_MS="200"), True),
    ]
    primary = redis_sentinel.primary_now()
    (replica,) = [server for server in redis_sentinel.servers if server is not primary]
    assert replica.process is not None
    async with httpx.AsyncClient(timeout=60) as client:
        for gateway, answered_at_once in sides:
            session = await create_session(client, gateway.url)
            os.kill(replica.process.pid, signal.SIGSTOP)
            try:
                sent = asyncio.create_task(send(client, session, "kept", max_tokens=3))
                await asyncio.sleep(1.0)
                answered_while_frozen = sent.done()
            finally:
                os.kill(replica.process.pid, signal.SIGCONT)
            gid = await sent
            assert answered_while_frozen is answered_at_once, gateway.url
            if not answered_at_once:
                key = Keys(stack.prefix).generation(session.session_id, gid)
                with redis_sentinel.client(replica) as on_replica:
                    assert on_replica.exists(key)


async def test_the_primary_killed_mid_stream_the_replica_promoted_the_stream_goes_on(
    sentinel_stack: Stack, redis_sentinel: EmbeddedSentinel
) -> None:
    """SIGKILL the primary while two readers (on two gateways) follow a reply: the
    Sentinels promote the replica; both readers get every event once, in order, with the
    whole text (or a clear error if the replica lacked writes), within seconds."""
    stack = sentinel_stack
    stack.synthetic(20)
    first, second = stack.gateway(), stack.gateway()
    content, max_tokens = "survive the sentinel failover", 200
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, first.url)
        gid = await send(client, session, content, max_tokens=max_tokens)
        readers = [
            follow(client, session, gid),
            follow(client, type(session)(second.url, session.session_id, session.token), gid),
        ]
        for reader in readers:
            await reader.until_tokens(20)
        victim = redis_sentinel.primary_now()
        victim.kill()
        killed_at = time.monotonic()
        promoted = await asyncio.to_thread(redis_sentinel.wait_promoted, victim)
        promoted_s = time.monotonic() - killed_at
        await asyncio.wait_for(asyncio.gather(*(r.task for r in readers if r.task)), 120)
    assert promoted in redis_sentinel.replicas
    for reader in readers:
        final = check_reply(reader.reading.events, gid, content, max_tokens)
        tokens = sum(e.event == "token" for e in reader.reading.events)
        print(
            f"\nprimary killed: replica promoted in {promoted_s:.2f} s, reader's outage "
            f"{outage_s(reader.arrived, killed_at):.2f} s, final {final.get('type', 'done')}, "
            f"{tokens} tokens, nothing repeated"
        )
    assert readers[0].reading.events == readers[1].reading.events


async def test_a_connection_to_a_primary_sentinel_no_longer_names_is_dropped(
    redis_sentinel: EmbeddedSentinel,
) -> None:
    """Sentinel's answer a connection acts on may be a failover old (asked just before the
    primary was called down, used after its replica was promoted): by then the old primary,
    restarted, is a primary again until the Sentinels make it a replica, seconds later, and
    then drops all it took. A connection opened to it is dropped with a clear error, not
    used (the soak found sessions and replies written there, then gone, and a relay
    subscribed there hearing nothing); one to the promoted primary is kept."""
    victim = redis_sentinel.primary_now()
    victim.kill()
    promoted = await asyncio.to_thread(redis_sentinel.wait_promoted, victim)
    victim.start()  # back empty, a primary until the Sentinels convert it
    with redis_sentinel.client(victim) as on_victim:
        assert on_victim.info("replication")["role"] == "master"
    client = connect(redis_sentinel.url)
    stale = client.connection_pool.make_connection()
    named = client.connection_pool.make_connection()
    try:
        with pytest.raises(RedisConnectionError, match="no longer the primary Sentinel names"):
            await stale.connect_to(("127.0.0.1", victim.port))
        assert not stale.is_connected
        await named.connect_to(("127.0.0.1", promoted.port))
        assert named.is_connected
        await client.set("written-once", "here")
    finally:
        for connection in (stale, named):
            await connection.disconnect()
        await client.aclose()
        await client.connection_pool.sentinel_manager.aclose()  # its clients of the Sentinels
    with redis_sentinel.client(promoted) as on_promoted:
        assert on_promoted.get("written-once") == "here"
