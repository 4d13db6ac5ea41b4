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
import time

import httpx
import pytest

from stack.redis_sentinel import EmbeddedSentinel
from tests.support.cluster import check_reply, outage_s
from tests.support.http import create_session, follow, send
from tests.support.stack import Stack
from tests.support.tenants import ADMIN_KEY, keyed_session, make_key, usage_total

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
