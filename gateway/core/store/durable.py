"""Submits kept before their client is told of them (``TOKENSPOUT_WAIT_REPLICAS``,
``TOKENSPOUT_WAIT_AOF``).

Redis acknowledges a write once it holds it in memory. A primary killed before its replica
received the write (a failover) or before its AOF was on disk (``appendfsync everysec``:
up to a second) loses it, and a client answered 202 then waits on a reply that no longer
exists: it is told so (``events_lost``, a 404: docs/reliability.md), but the request is
gone. With these settings a submit asks Redis, after its writes and before its answer, to
confirm them: ``WAIT n`` (n replicas hold them) and ``WAITAOF 1 0`` (the primary's AOF holds
them on disk), each up to ``TOKENSPOUT_WAIT_TIMEOUT_MS``, on every node the submit wrote.
One round trip more per request (docs/reliability.md has its cost); a confirmation that
times out is logged and the request goes on: a replica that is down must not stop serving.
"""

from __future__ import annotations

import logging
from typing import Any

import redis.asyncio as aioredis

from gateway.core.settings import Settings
from wire.topology import Topology

log = logging.getLogger("tokenspout.durable")


class DurableSubmits:
    def __init__(self, redis: aioredis.Redis, topology: Topology, settings: Settings) -> None:
        self.redis = redis
        self.topology = topology
        self.replicas = settings.wait_replicas
        self.aof = settings.wait_aof
        self.timeout_ms = settings.wait_timeout_ms

    @property
    def on(self) -> bool:
        return bool(self.replicas or self.aof)

    async def confirm(self, *keys: str) -> None:
        """Wait until the writes made so far on the nodes of ``keys`` are kept as asked."""
        if not self.on:
            return
        if self.topology.one_node:
            await self._confirm_on({})
            return
        cluster: Any = self.redis
        nodes = {
            cluster.get_node_from_key(key).name: cluster.get_node_from_key(key) for key in keys
        }
        for node in nodes.values():
            await self._confirm_on({"target_nodes": node})

    async def _confirm_on(self, where: dict[str, Any]) -> None:
        command: Any = self.redis.execute_command
        if self.replicas:
            held = await command("WAIT", self.replicas, self.timeout_ms, **where)
            if int(held) < self.replicas:
                log.warning(
                    "a submit held by %s of %d replicas in %d ms: answered anyway",
                    held,
                    self.replicas,
                    self.timeout_ms,
                )
        if self.aof:
            local, _ = await command("WAITAOF", 1, 0, self.timeout_ms, **where)
            if int(local) < 1:
                log.warning(
                    "a submit not on the AOF's disk in %d ms: answered anyway", self.timeout_ms
                )
