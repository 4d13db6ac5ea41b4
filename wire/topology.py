"""What one Redis can do that a Redis Cluster cannot: one strategy object per topology.

The keys of one session share a hash tag, so every script keeps to one slot on either; what
differs is what crosses slots, and each difference is a member here, asked of the process's
one ``Topology`` (``topology_of``), never a test of the client's class in a caller:

- ``source``: a script's Lua as it runs here. One Redis publishes live events with PUBLISH
  and counts a final event's usage inside the script that writes it (the tenant's keys are
  on the same node); a cluster publishes with SPUBLISH (sharded pub/sub: only the shard of
  the session's slot carries them) and leaves the count to the writer, right after
  (``counts_in_script``: ``wire.tenancy.UsageCounter`` then counts once per generation).
- ``script_command``, ``load_script``: how a script is called and loaded. One Redis keeps
  every script in one Functions library (``FCALL``, wire/library.py: its shared functions
  made once, not at every call); a cluster runs each script's text with EVALSHA (redis-py
  routes an FCALL there through a round trip that asks a node for its keys).
- ``in_order``: commands that must land in order (a generation before its request, a note
  before its submit): one pipeline on one Redis, which runs it in order; one round trip
  after another on a cluster, which runs each node's part of a pipeline at once.
- ``one_node``: every key lives on one node, so SUBMIT admits a request against every
  queue and its key's limits in the same call, and an engine step's script acknowledges
  its requests itself.
- ``group_of``: which sessions' events may share one script call (all of them; one slot's).
- ``sharded``: live events come over sharded pub/sub (the relay's reader per shard).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Sequence
from typing import ClassVar, Protocol

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from wire.connect import is_cluster, slot_of
from wire.library import LIBRARY

Fill = Callable[[Pipeline], object]
"""Queues commands in a pipeline (its return value is not used)."""
Proceed = Callable[[list[object]], bool]
"""Whether the replies so far let the next commands of an ``in_order`` go."""

_PUBLISH = "local publish = 'PUBLISH'\n"
_SPUBLISH = "local publish = 'SPUBLISH'\n"
_COUNT_HERE = "local count_here = true\n"
_COUNT_AFTER = "local count_here = false\n"


class CalledScript(Protocol):
    """A Lua script as ``wire.scripts.Script`` wraps it: what a topology calls and loads."""

    name: ClassVar[str]
    """Its file in wire/lua/."""
    source: ClassVar[str]
    """Its whole text as EVAL runs it."""


class Topology:
    """One Redis (this class) or a cluster (``ClusterTopology``)."""

    one_node = True
    counts_in_script = True
    sharded = False

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis

    def source(self, lua: str) -> str:
        return lua

    def group_of(self, session_id: str) -> Hashable:
        """Every session's events in one call."""
        return None

    def script_command(self, script: CalledScript) -> tuple[str, str]:
        """The command that calls ``script``, before its keys."""
        return "FCALL", LIBRARY.function(script.name)

    async def load_script(self, script: CalledScript) -> None:
        """Load ``script``: here the library, with every script in it."""
        await self.redis.function_load(LIBRARY.code, replace=True)

    async def in_order(self, fills: Sequence[Fill], proceed: Proceed | None = None) -> list[object]:
        """Run what each of ``fills`` queues, in order: here in one pipeline, so
        ``proceed`` (whether the replies so far let the next fill go) is not asked: the
        later fills must be harmless after a refusal. Every reply, in order."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for fill in fills:
                fill(pipe)
            return list(await pipe.execute())


class ClusterTopology(Topology):
    one_node = False
    counts_in_script = False
    sharded = True

    def source(self, lua: str) -> str:
        return lua.replace(_PUBLISH, _SPUBLISH).replace(_COUNT_HERE, _COUNT_AFTER)

    def group_of(self, session_id: str) -> Hashable:
        """One hash slot's sessions per call: every script keeps to one slot."""
        return slot_of(session_id)

    def script_command(self, script: CalledScript) -> tuple[str, str]:
        text = self.source(script.source).encode()
        return "EVALSHA", hashlib.sha1(text, usedforsecurity=False).hexdigest()

    async def load_script(self, script: CalledScript) -> None:
        """Load ``script`` into every primary."""
        await self.redis.script_load(self.source(script.source))

    async def in_order(self, fills: Sequence[Fill], proceed: Proceed | None = None) -> list[object]:
        """One round trip after another: the next goes once the one before is back, and
        only if ``proceed`` says the replies so far let it."""
        replies: list[object] = []
        for fill in fills:
            if replies and proceed is not None and not proceed(replies):
                break
            async with self.redis.pipeline(transaction=False) as pipe:
                fill(pipe)
                replies += await pipe.execute()
        return replies


def topology_of(redis: aioredis.Redis) -> Topology:
    """The topology ``redis`` (a client from ``wire.connect.connect``) talks to."""
    return ClusterTopology(redis) if is_cluster(redis) else Topology(redis)
