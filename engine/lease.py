"""A worker's claim to be alive: its heartbeat, and a Redis connection that dies with it.

The heartbeat (every ``HEARTBEAT_S``) refreshes the worker's description and its score in
the ``workers`` set; a worker silent for ``TOKENSPOUT_WORKER_TIMEOUT_S`` is dead. That is
slow to notice a killed process, so the heartbeat goes over a connection of its own, named
``wire.lease_name(worker_id)``, whose Redis client id the description carries. The
kernel closes that connection the moment the process dies; a gateway that finds the id
gone from ``CLIENT LIST`` knows the worker is lost at once, while a worker that is only
slow keeps its connection and is never taken for dead (until the heartbeat timeout).

On a Redis Cluster client ids are per node: the lease connection goes straight to the
primary that serves the worker's description (``wire.connect.node_client``), whose
address the description carries (``lease_node``) for the gateways to ask; the writes go
through the cluster client, each to its own shard. A lease connection that fails (its node
died or lost its slots in a failover) is opened again on the slot's primary now.
"""

from __future__ import annotations

import time

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

import wire
from wire import Keys, WorkerInfo
from wire.connect import address_of, mget, node_client
from wire.topology import topology_of

HEARTBEAT_S = 1.0
HEARTBEAT_TTL_S = 5
_info_decoder = msgspec.json.Decoder(WorkerInfo)


class Lease:
    def __init__(self, redis: aioredis.Redis, keys: Keys, worker_id: str, model: str) -> None:
        self.shared = redis
        self.cluster = not topology_of(redis).one_node
        self.keys = keys
        self.worker_id = worker_id
        self.model = model
        self.requests_key = keys.requests(model)
        self.last_beat = time.monotonic()
        """When the last heartbeat Redis took was sent (monotonic: it runs on while stopped).
        Its send, not its reply: the score the others judge by is the time it was sent, and a
        write held up (a ``CLIENT PAUSE``, a failover's retries) lands that old."""
        self.doubted_at: float | None = None
        """When something said the others may not see this worker alive (None: nothing
        since a heartbeat went through): a heartbeat failed, or work came back taken over
        from this worker (its lease connection cut, say). Takes wait for a heartbeat."""
        self.lease_id: int | None = None
        """The lease connection's client id at the last heartbeat."""
        self.reconnected = False
        """The last heartbeat went over a connection other than the one before it: Redis
        restarted or failed over, or the connection was cut (what was written just before
        may be lost: engine/ends.py)."""
        self.redis = self._open()
        """The lease connection. One connection: callers (the heartbeat, a drain's look for
        others) take turns."""
        self.writer = redis if self.cluster else self.redis
        """Where the heartbeat writes: the lease connection itself on one Redis; the
        cluster client on a cluster (the keys lie in several slots)."""

    def _open(self) -> aioredis.Redis:
        return node_client(
            self.shared,
            self.keys.worker(self.worker_id),
            client_name=wire.lease_name(self.worker_id),
        )

    async def _lease_id(self) -> int:
        try:
            return int(await self.redis.client_id())
        except (RedisError, OSError):
            if self.cluster:  # its node may be gone: the next heartbeat asks the slot's primary
                old, self.redis = self.redis, self._open()
                await old.aclose()
                await old.connection_pool.disconnect()
            raise

    async def heartbeat(self, info: WorkerInfo) -> None:
        """Publish ``info`` (with this connection's client id) and refresh the shared keys."""
        began = time.monotonic()
        try:
            await self._publish(info)
        except BaseException:
            self.doubt()
            raise
        if self.doubted_at is not None and self.doubted_at <= began:
            self.doubted_at = None

    def doubt(self) -> None:
        """The others may take this worker for lost: ``doubted`` until a heartbeat sent
        from now on goes through."""
        self.doubted_at = time.monotonic()

    @property
    def doubted(self) -> bool:
        return self.doubted_at is not None

    async def _publish(self, info: WorkerInfo) -> None:
        # Asked every time: a reconnect gives the connection a new id.
        lease_id = await self._lease_id()
        self.reconnected = self.lease_id is not None and lease_id != self.lease_id
        self.lease_id = lease_id
        info = msgspec.structs.replace(
            info, lease_id=lease_id, lease_node=address_of(self.redis) if self.cluster else ""
        )
        now, sent = time.time(), time.monotonic()
        async with self.writer.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.worker(self.worker_id), wire.encode(info), ex=HEARTBEAT_TTL_S)
            pipe.zadd(self.keys.workers, {self.worker_id: now})
            pipe.zremrangebyscore(self.keys.workers, "-inf", now - 3600)
            pipe.expire(self.keys.workers, wire.SHARED_KEY_TTL_S)
            # The names gateways route by; they outlive this worker, so a request for a
            # model whose workers all left gets "no live worker" (503), not "unknown" (404).
            pipe.hset(self.keys.models, mapping=dict.fromkeys(info.names, info.model))
            pipe.expire(self.keys.models, wire.SHARED_KEY_TTL_S)
            pipe.set(self.keys.models_since, int(now * 1000), nx=True)
            pipe.expire(self.keys.models_since, wire.SHARED_KEY_TTL_S)
            # Keeps the consumer group alive while workers idle (EXPIRE on no key: no-op).
            pipe.expire(self.requests_key, wire.SHARED_KEY_TTL_S)
            await pipe.execute()
        self.last_beat = max(self.last_beat, sent)  # two heartbeats may overlap

    def silent_for(self) -> float:
        """How old the last heartbeat Redis took is to the others, who judge this worker by
        it."""
        return time.monotonic() - self.last_beat

    async def others_serving(self) -> int:
        """Other workers of this model that heartbeat now and are not draining (hand-over
        targets: only they read this model's queue)."""
        since = time.time() - 2 * HEARTBEAT_S
        ids = [
            wire.text(worker_id)
            for worker_id in await self.writer.zrangebyscore(self.keys.workers, since, "+inf")
        ]
        ids = [worker_id for worker_id in ids if worker_id != self.worker_id]
        if not ids:
            return 0
        raw = await mget(self.writer, [self.keys.worker(worker_id) for worker_id in ids])
        infos = [_info_decoder.decode(item) for item in raw if item is not None]
        return sum(1 for info in infos if info.model == self.model and not info.draining)

    async def release(self) -> None:
        """Leave the worker set and close the lease connection."""
        try:
            await self.writer.zrem(self.keys.workers, self.worker_id)
            await self.writer.delete(self.keys.worker(self.worker_id))
        finally:
            await self.redis.aclose()
            await self.redis.connection_pool.disconnect()
