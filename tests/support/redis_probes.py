"""What Redis holds under a test's key prefix, read through ``wire.Keys`` (the one builder
of every key): generations, their events, live workers."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

import wire
from gateway.recovery.takeover import LEASE_GRACE_S
from stack.rig import sync_client
from wire import Keys
from wire.connect import connect
from wire.keys import FairNames


def async_client(redis_url: str) -> aioredis.Redis:
    """An asyncio client of ``redis_url``, made as the gateway and the engine make theirs."""
    return connect(redis_url)


async def live_readers(client: aioredis.Redis, channel: str) -> int:
    """Subscribers of a session's live channel: by SUBSCRIBE on one Redis, by SSUBSCRIBE
    on the shard that serves the channel's slot on a cluster."""
    if isinstance(client, AsyncRedisCluster):
        node = client.get_node_from_key(channel)
        reply = await client.execute_command("PUBSUB SHARDNUMSUB", channel, target_nodes=node)
        return int(reply[1])
    return int((await client.pubsub_numsub(channel))[0][1])


async def command_calls(client: aioredis.Redis, command: str) -> int:
    """How many times the server has run ``command`` (``INFO commandstats``, every client's;
    a subcommand as ``xinfo|groups``)."""
    stats = await client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def only_generation(redis_url: str, prefix: str, timeout_s: float = 30) -> tuple[str, str]:
    """(session id, generation id) of the one generation under ``prefix``."""
    keys = Keys(prefix)
    client = sync_client(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            found = [k.decode() for k in client.scan_iter(match=keys.generation("*", "*"))]
            if found:
                assert len(found) == 1, found
                key = found[0]
                return keys.session_id_of_channel(key), key.rsplit(":", 1)[1]
            time.sleep(0.05)
    finally:
        client.close()
    raise TimeoutError(f"no generation appeared under {prefix}")


def wait_final(redis_url: str, prefix: str, timeout_s: float = 60) -> dict[str, Any]:
    """The final event of the one generation under ``prefix``, once it has one."""
    session_id, generation_id = only_generation(redis_url, prefix)
    client = sync_client(redis_url)
    key = Keys(prefix).generation(session_id, generation_id)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            final = client.hget(key, "final")
            if final is not None:
                return dict(json.loads(final))
            time.sleep(0.05)
    finally:
        client.close()
    raise TimeoutError(f"generation {generation_id} did not end")


async def stream_entries(
    redis_url: str, prefix: str, session_id: str
) -> list[tuple[str, dict[bytes, bytes]]]:
    """Every event the session's stream holds, with its id, straight from Redis."""
    client = async_client(redis_url)
    try:
        entries = await client.xrange(Keys(prefix).events(session_id))
    finally:
        await client.aclose()
    return [(entry_id.decode(), fields) for entry_id, fields in entries]


async def stream_events(redis_url: str, prefix: str, session_id: str) -> list[dict[bytes, bytes]]:
    """Every event the session's stream holds, straight from Redis."""
    return [fields for _id, fields in await stream_entries(redis_url, prefix, session_id)]


def after_final(events: list[dict[bytes, bytes]], gid: str) -> list[bytes]:
    """Types of the generation's events that follow its first final event."""
    types = [e[b"t"] for e in events if e[b"g"].decode() == gid]
    finals = [n for n, t in enumerate(types) if t in (b"done", b"cancelled", b"error")]
    assert finals, types
    return types[finals[0] + 1 :]


async def session_events(
    redis_url: str, prefix: str, session_id: str
) -> list[tuple[str, dict[str, object]]]:
    """The session's events as Redis holds them: (type, data)."""
    client = async_client(redis_url)
    try:
        entries = await client.xrange(Keys(prefix).events(session_id))
    finally:
        await client.aclose()
    return [(fields[b"t"].decode(), json.loads(fields[b"d"])) for _id, fields in entries]


def event_key(event_id: str) -> tuple[int, int]:
    """A stream entry id (``ms-seq``, the SSE ``id:``) as a sortable pair."""
    ms, seq = event_id.split("-")
    return int(ms), int(seq)


def worker_registered(redis_url: str, prefix: str) -> bool:
    """Some worker is in the set of live workers."""
    client = sync_client(redis_url)
    try:
        return bool(client.zcard(Keys(prefix).workers))
    finally:
        client.close()


def workers_running(redis_url: str, prefix: str) -> int:
    """Requests the live workers report running in their heartbeats."""
    client = sync_client(redis_url)
    try:
        keys = list(client.scan_iter(match=Keys(prefix).worker("*")))
        return (
            sum(
                json.loads(raw)["running"] for raw in client.mget_nonatomic(keys) if raw is not None
            )
            if isinstance(client, RedisCluster)
            else sum(json.loads(raw)["running"] for raw in client.mget(keys) if raw is not None)
        )
    finally:
        client.close()


def wait_running(redis_url: str, prefix: str, count: int, within_s: float = 30.0) -> float:
    """Seconds until the workers' heartbeats report ``count`` running generations; fails
    past ``within_s``."""
    began = time.monotonic()
    while (running := workers_running(redis_url, prefix)) != count:
        elapsed = time.monotonic() - began
        assert elapsed < within_s, f"{running} generations run, not {count}, after {elapsed:.1f} s"
        time.sleep(0.05)
    return time.monotonic() - began


async def lease_trusted(redis_url: str) -> None:
    """Wait until Redis has run LEASE_GRACE_S: before that, a lost lease proves nothing
    (gateway/recovery/takeover.py) and the heartbeat timeout decides."""
    redis = aioredis.Redis.from_url(redis_url)
    try:
        async with asyncio.timeout(LEASE_GRACE_S + 5):
            while int((await redis.info("server"))["uptime_in_seconds"]) < LEASE_GRACE_S:
                await asyncio.sleep(0.1)
    finally:
        await redis.aclose()


async def waiting_requests(redis: aioredis.Redis, keys: Keys, model: str) -> list[bytes]:
    """The requests waiting in ``model``'s tenants' lists (wire/queue.py), every tenant's
    (each list entry is '<estimate>|<request>': the requests alone)."""
    names = FairNames(keys.fair(model))
    waiting: list[bytes] = []
    for tenant in await redis.zrange(names.ready, 0, -1):
        entries = await redis.lrange(names.waiting(wire.text(tenant)), 0, -1)
        waiting += [entry.partition(b"|")[2] for entry in entries]
    return waiting


async def waiting_of(redis: aioredis.Redis, keys: Keys, model: str, generation_id: str) -> int:
    """How many of ``model``'s waiting requests carry ``generation_id``'s."""
    return sum(generation_id.encode() in raw for raw in await waiting_requests(redis, keys, model))


async def lose_waiting(redis: aioredis.Redis, keys: Keys, model: str, generation_id: str) -> int:
    """Lose ``generation_id``'s waiting request as a Redis failover can (the list entry
    and its count together); returns how many went."""
    names = FairNames(keys.fair(model))
    lost = 0
    for tenant in await redis.zrange(names.ready, 0, -1):
        waiting = names.waiting(wire.text(tenant))
        for raw in await redis.lrange(waiting, 0, -1):
            if generation_id.encode() in raw:
                lost += await redis.lrem(waiting, 0, raw)
    await redis.hincrby(names.base, "waiting", -lost)
    return lost
