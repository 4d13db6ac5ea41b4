"""The relay's connection to one cluster shard (gateway/core/relay/shards.py), over a real
socket."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.core.relay.shards import Shard, ShardedLive
from stack.redis_server import EmbeddedRedis, free_port


async def test_a_shard_whose_first_subscribe_never_connected_counts_as_lost() -> None:
    """Its node was down when the first SSUBSCRIBE went out (a primary killed, the slot map
    not yet updated): the shard says it is lost, so the relay subscribes its channels again
    where the slot map says. Its reader used to end with redis-py's "pubsub connection not
    set" instead: a shard that read nothing stayed in use, and the gateway's shutdown failed
    on it."""
    port = free_port()  # nothing listens there
    async with aioredis.Redis() as cluster, aioredis.Redis(port=port) as node:
        live = ShardedLive(cluster, lambda _c, _d: None, lambda _c, _ok: None)
        shard = Shard(live, f"127.0.0.1:{port}", node)
        with pytest.raises(RedisConnectionError):
            await shard.ssubscribe("t:{s_1}:live")
        await asyncio.wait_for(shard.task, 5)
        assert shard.lost and not shard.channels
        await shard.close()


async def test_a_subscribe_on_a_shard_left_with_no_channels_never_reads_beside_its_reader(
    redis_server: EmbeddedRedis,
) -> None:
    """A shard whose channels were all unsubscribed keeps its connection and its reader;
    redis-py health-checks a pub/sub command in place (a PING and a read of its answer)
    when no channel is subscribed and the check is due, while the reader waits on the
    same connection: the next SSUBSCRIBE, a request's, failed with ``RuntimeError: read()
    called while another coroutine is already waiting`` (a 500 to an OIP client, ten-minute
    cluster soak, seed 1). Here the check falls due 1.5 s after the connection last read
    something, in the middle of the reader's second 1 s wait (the gateway's is 10 s)."""
    channel = "t:{s_1}:live"
    async with (
        aioredis.Redis() as cluster,
        aioredis.Redis(port=redis_server.port, health_check_interval=1.5) as node,
    ):
        live = ShardedLive(cluster, lambda _c, _d: None, lambda _c, _ok: None)
        shard = Shard(live, f"127.0.0.1:{redis_server.port}", node)
        try:
            for _ in range(2):
                await shard.ssubscribe(channel)
                shard.channels.discard(channel)
                await shard.pubsub.sunsubscribe(channel)
                async with asyncio.timeout(5):
                    while shard.pubsub.subscribed:  # until the reader read the answer
                        await asyncio.sleep(0.01)
                await asyncio.sleep(1.7)
            await shard.ssubscribe(channel)
            assert not shard.lost and not shard.task.done()
        finally:
            await shard.close()
