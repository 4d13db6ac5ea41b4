"""The relay's connection to one cluster shard (gateway/core/relay/shards.py), over a real
socket."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.core.relay.shards import Shard, ShardedLive
from stack.redis_server import free_port


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
