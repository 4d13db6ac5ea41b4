"""What one Redis can do that a Redis Cluster cannot: one strategy object per topology.

The keys of one session share a hash tag, so every script keeps to one slot on either; what
differs is what crosses slots, and each difference is a member here, asked of the process's
one ``Topology`` (``topology_of``), never a test of the client's class in a caller:

- ``source``: a script's Lua as it runs here. One Redis publishes live events with PUBLISH
  and counts a final event's usage inside the script that writes it (the tenant's keys are
  on the same node); a cluster publishes with SPUBLISH (sharded pub/sub: only the shard of
  the session's slot carries them) and leaves the count to the writer, right after
  (``counts_in_script``: ``wire.tenancy.UsageCounter`` then counts once per generation).
- ``queue_script``: a script call queued in a pipeline: redis-py's registered script on one
  Redis; a bare EVALSHA on a cluster, whose pipeline cannot load a script by itself.
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

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.commands.core import AsyncScript

from wire.batched import Arg
from wire.connect import is_cluster, slot_of

Fill = Callable[[Pipeline], object]
"""Queues commands in a pipeline (its return value is not used)."""
Proceed = Callable[[list[object]], bool]
"""Whether the replies so far let the next commands of an ``in_order`` go."""

_PUBLISH = "local publish = 'PUBLISH'\n"
_SPUBLISH = "local publish = 'SPUBLISH'\n"
_COUNT_HERE = "local count_here = true\n"
_COUNT_AFTER = "local count_here = false\n"


class QueuedScript(Protocol):
    """A Lua script as ``wire.scripts.Script`` wraps it: what a topology queues."""

    registered: AsyncScript

    async def load_once(self) -> None: ...

    def queue_evalsha(
        self, pipe: Pipeline, keys: Sequence[str | bytes], args: Sequence[Arg]
    ) -> None: ...


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

    async def queue_script(
        self, pipe: Pipeline, script: QueuedScript, keys: Sequence[str | bytes], args: Sequence[Arg]
    ) -> None:
        """Queue a call of ``script`` in ``pipe``: redis-py loads what the server lacks."""
        await script.registered(keys=keys, args=args, client=pipe)

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

    async def queue_script(
        self, pipe: Pipeline, script: QueuedScript, keys: Sequence[str | bytes], args: Sequence[Arg]
    ) -> None:
        """A bare EVALSHA (its caller loads the script and sends again on NoScriptError),
        loaded first once per process. The command, not ``pipe.evalsha``: redis-py's
        cluster pipeline refuses that by name but routes the command by its keys' slot."""
        await script.load_once()
        script.queue_evalsha(pipe, keys, args)

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
