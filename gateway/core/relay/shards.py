"""The relay's live events on a Redis Cluster: sharded pub/sub, one connection per shard
(a ``LiveSource``, gateway/core/relay/live.py).

On a cluster the EMIT script publishes with SPUBLISH (wire/scripts.py): a live channel is
tagged like its session's keys, so only the shard that serves the session's slot carries
its events. ``ShardedLive`` holds one pub/sub connection per primary that serves a
watched session (not one per stream), SSUBSCRIBEs each channel on the primary of its slot
now, and reads every shard in a task of its own.

A shard that fails (its primary died, or its connection broke) or that drops a channel
(the server sends ``sunsubscribe`` when the channel's slot migrates away) tells the hub
its channels are lost: their feeds re-read the stream from their last id once subscribed
again (gateway/core/relay/feed.py), so nothing is lost or repeated. The channels are then subscribed
again on the primary of their slot per the cluster's slot map, refreshed first; while a
failover is under way that is retried with a backoff until a replica took over.

redis-py's ``ClusterPubSub`` does this too, but reads its shards one after another with a
timeout each, and reconciles moved channels in background tasks that do not say when a
channel is confirmed again, which is what a feed waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import cast

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

import wire
from gateway.core.relay.live import Confirmed, Deliver, relay_pubsub
from wire.connect import RETRY_MAX_S, node_by_address

log = logging.getLogger("tokenspout.relay")


class Shard:
    """One primary's pub/sub connection and the channels subscribed there."""

    def __init__(self, owner: ShardedLive, address: str, client: aioredis.Redis) -> None:
        self.owner = owner
        self.address = address
        self.client = client
        self.pubsub: PubSub = relay_pubsub(client)
        self.channels: set[str] = set()
        self.subscribed = asyncio.Event()
        """Set after the first SSUBSCRIBE was sent: the connection exists from then on."""
        self.task = asyncio.create_task(self._read_forever(), name=f"relay-shard {address}")
        self.lost = False

    async def ssubscribe(self, channel: str) -> None:
        self.channels.add(channel)
        try:
            await self.pubsub.ssubscribe(channel)
        finally:
            self.subscribed.set()  # a failed one too: the reader finds the connection broken

    async def _read_forever(self) -> None:
        await self.subscribed.wait()
        try:
            if self.pubsub.connection is None:
                # The first SSUBSCRIBE never connected (its node was down): nothing to read,
                # and a reader left here would miss what a later SSUBSCRIBE brings.
                raise RedisConnectionError(f"no connection to {self.address}")
            while True:
                message = await self.pubsub.get_message(timeout=1.0)
                if message is not None:
                    self._dispatch(message)
        except (RedisError, OSError) as exc:
            log.warning(
                "relay shard %s lost (%s: %s); subscribing its channels again",
                self.address,
                type(exc).__name__,
                exc,
            )
            self.owner.shard_lost(self)

    def _dispatch(self, message: dict[str, object]) -> None:
        kind, raw = message["type"], message["channel"]
        if kind == "smessage":
            data = message["data"]
            assert isinstance(raw, bytes) and isinstance(data, bytes)
            self.owner.deliver(raw, data)
            return
        channel = raw.decode() if isinstance(raw, bytes) else str(raw)
        if kind == "ssubscribe" and channel in self.channels:
            self.owner.confirmed(channel, True)
        elif kind == "sunsubscribe" and channel in self.channels:
            # Not asked for: the slot moved to another shard (a reshard, a failover).
            self.channels.discard(channel)
            self.owner.moved(channel)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
            await self.task
        with contextlib.suppress(RedisError, OSError):
            await self.pubsub.aclose()  # type: ignore[no-untyped-call]
        await self.client.aclose()
        await self.client.connection_pool.disconnect()


class ShardedLive:
    """SSUBSCRIBE each watched channel on its shard; tell the hub what arrives (a
    ``LiveSource``)."""

    def __init__(self, cluster: aioredis.Redis, deliver: Deliver, confirmed: Confirmed) -> None:
        self.cluster: RedisCluster = cast(RedisCluster, cluster)
        self.deliver: Deliver = deliver
        self.confirmed: Confirmed = confirmed
        self.client_name = wire.relay_name(socket.gethostname(), os.getpid())
        self._shards: dict[str, Shard] = {}
        self._wanted: set[str] = set()
        self._orphans: set[str] = set()
        """Channels wanted but subscribed nowhere now (their shard failed or moved them)."""
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._repair: asyncio.Task[None] | None = None

    @property
    def shards(self) -> int:
        return len(self._shards)

    async def start(self) -> None:
        self._repair = asyncio.create_task(self._repair_forever(), name="relay-shards")

    async def subscribe(self, channel: str) -> None:
        self._wanted.add(channel)
        async with self._lock:
            try:
                await self._subscribe_on_owner(channel)
            except (RedisError, OSError):
                self._orphan(channel)

    async def unsubscribe(self, channel: str) -> None:
        self._wanted.discard(channel)
        self._orphans.discard(channel)
        async with self._lock:
            for shard in self._shards.values():
                if channel in shard.channels:
                    shard.channels.discard(channel)
                    with contextlib.suppress(RedisError, OSError):
                        await shard.pubsub.sunsubscribe(channel)

    async def _subscribe_on_owner(self, channel: str) -> None:
        node = self.cluster.get_node_from_key(channel)
        if node is None:
            raise OSError(f"no primary serves {channel} now")
        shard = self._shards.get(node.name)
        if shard is not None and shard.lost:
            del self._shards[node.name]
            await shard.close()
            shard = None
        if shard is None:
            client = node_by_address(self.cluster, node.name, self.client_name)
            if client is None:
                raise OSError(f"{node.name} is not a cluster node now")
            shard = self._shards[node.name] = Shard(self, node.name, client)
        await shard.ssubscribe(channel)

    def _orphan(self, channel: str) -> None:
        if channel in self._wanted:
            self.confirmed(channel, False)
            self._orphans.add(channel)
            self._wake.set()

    def moved(self, channel: str) -> None:
        self._orphan(channel)

    def shard_lost(self, shard: Shard) -> None:
        shard.lost = True
        for channel in shard.channels:
            self._orphan(channel)
        shard.channels.clear()
        self._wake.set()

    async def _repair_forever(self) -> None:
        """Subscribe orphaned channels again where the slot map says they live now."""
        backoff = 0.05
        while True:
            await self._wake.wait()
            self._wake.clear()
            async with self._lock:
                for address, shard in list(self._shards.items()):
                    if shard.lost:
                        del self._shards[address]
                        await shard.close()
                if not self._orphans:
                    continue
                try:
                    await self.cluster.nodes_manager.initialize()
                    while self._orphans:
                        # Out of the set before subscribing: a shard that fails while the
                        # SSUBSCRIBE is on its way (a MOVED from a stale slot map) puts it
                        # back, and no later discard may take it out again.
                        channel = self._orphans.pop()
                        if channel in self._wanted:
                            try:
                                await self._subscribe_on_owner(channel)
                            except BaseException:
                                self._orphans.add(channel)
                                raise
                    backoff = 0.05
                    continue
                except (RedisError, OSError) as exc:
                    log.warning(
                        "relay: subscribing %d channels failed (%s)", len(self._orphans), exc
                    )
            await asyncio.sleep(backoff)  # a failover under way: try again
            backoff = min(backoff * 2, RETRY_MAX_S)
            self._wake.set()

    async def close(self) -> None:
        if self._repair is not None:
            self._repair.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._repair
        for shard in self._shards.values():
            await shard.close()
        self._shards.clear()
