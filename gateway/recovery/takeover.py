"""Takeover: a lost worker's running reply goes on in another worker, from where it was.

The reaper (gateway/recovery/reaper.py) finds requests pending under a worker that is gone and
hands each to ``LostRequests.hand_on``, which makes the transition a stopping worker makes
for its own replies (wire/handoff.py):

1. The TAKEOVER script (``wire.scripts.Takeover``) takes the generation from the lost
   worker atomically: ``running`` under that worker becomes ``queued`` at the next epoch
   (``takeovers``), and from then on Redis refuses every event of the old worker (EMIT
   checks the owner), so a worker that was only slow can never write into the reply again.
   Two reapers racing both run the script; only one sees ``takeover``.
2. What was streamed is read back from the session's event stream (everything after the
   transition is written by nobody, so this read is exact): the prompt's token count, the
   text and token ids of every ``token`` event.
3. The request goes back on the queue with ``resume`` set; the worker that takes it
   claims the generation with a ``resumed`` event and streams on from the next token.

A generation is not continued when a cancel was asked for (it ends ``cancelled``), when it
was taken over ``TOKENSPOUT_MAX_TAKEOVERS`` times already, or when its early events were
trimmed from the stream (both end with ``error`` ``worker_lost``). A request whose worker
died before claiming it goes back on the queue as it was, but not more than
``TOKENSPOUT_MAX_TAKEOVERS`` times either: a request that kills every worker that prepares
it ends ``worker_lost`` too, instead of taking down one worker after another.
"""

from __future__ import annotations

import logging
import time

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

import wire
from wire import (
    Error,
    GenerationRequest,
    Keys,
)
from wire.connect import mget, node_by_address
from wire.generations import Generations
from wire.outcomes import (
    AlreadyFinal,
    Moved,
    NotStarted,
    TakenOver,
)
from wire.queue import RequestQueue

log = logging.getLogger("tokenspout.takeover")
_info_decoder = msgspec.json.Decoder(wire.WorkerInfo)

REAPER_PREFIX = "reaper-"
"""Consumer names the reaper claims entries under while it hands them on."""
LOST_BEFORE_START = "lost_before_start"
"""Field of the generation's hash: how often its worker died before claiming it."""
LEASE_GRACE_S = 3
"""For this long after Redis starts, a missing lease proves nothing (heartbeats decide)."""


async def live_workers(
    redis: aioredis.Redis, keys: Keys, names: list[str], timeout_s: float
) -> set[str]:
    """Which of ``names`` are alive: a heartbeat within ``timeout_s``, and the lease
    connection still open where the worker names one (engine/lease.py)."""
    since = time.time() - timeout_s
    fresh = {wire.text(w) for w in await redis.zrangebyscore(keys.workers, since, "+inf")}
    candidates = [name for name in names if name in fresh]
    if not candidates:
        return set()
    alive: set[str] = set()
    leases: dict[str, dict[int, str]] = {}
    """Node address ("": the one Redis) -> lease client id -> worker."""
    for name, raw in zip(
        candidates, await mget(redis, [keys.worker(n) for n in candidates]), strict=True
    ):
        info = _info_decoder.decode(raw) if raw is not None else None
        if info is None or not info.lease_id:
            alive.add(name)  # nothing better to go on than its heartbeat
        else:
            leases.setdefault(info.lease_node, {})[info.lease_id] = name
    for node, ids in leases.items():
        alive |= await _leases_open(redis, node, ids)
    return alive


async def _leases_open(redis: aioredis.Redis, node: str, leases: dict[int, str]) -> set[str]:
    """The workers whose lease connection (by client id) is open on ``node``."""
    if not node:
        return await _leases_open_on(redis, leases)
    client = node_by_address(redis, node)
    if client is None:  # not a cluster node now (failed over, removed): heartbeats decide
        return set(leases.values())
    try:
        return await _leases_open_on(client, leases)
    except (RedisError, OSError) as exc:  # the node is down: its replica takes over
        log.warning("lease check on %s failed (%s): liveness by heartbeat", node, exc)
        return set(leases.values())
    finally:
        await client.aclose()
        await client.connection_pool.disconnect()


async def _leases_open_on(redis: aioredis.Redis, leases: dict[int, str]) -> set[str]:
    alive: set[str] = set()
    try:
        clients = await redis.client_list(client_id=list(leases))
    except ResponseError as exc:  # a Redis without CLIENT LIST ID (before 6.2)
        log.warning("CLIENT LIST ID failed (%s): liveness by heartbeat only", exc)
        return set(leases.values())
    for client in clients:
        worker = leases.get(int(client.get("id", 0)))
        if worker is not None and client.get("name") == wire.lease_name(worker):
            alive.add(worker)
    missing = set(leases.values()) - alive
    if missing:
        alive |= await _reconnected(redis, missing)
    return alive


async def _reconnected(redis: aioredis.Redis, missing: set[str]) -> set[str]:
    """Of the workers whose published lease connection is gone, those that may only have
    reconnected: a lease connection under their name (the id changes with a reconnect, the
    name does not), or any of them while Redis itself has just restarted (a lease takes up
    to a heartbeat to come back)."""
    uptime = int((await redis.info("server")).get("uptime_in_seconds", 0))
    if uptime < LEASE_GRACE_S:
        return missing
    names = {client.get("name") for client in await redis.client_list()}
    return {worker for worker in missing if wire.lease_name(worker) in names}


class LostRequests:
    """The requests a lost worker left pending, each handed on: queued again as it was,
    continued by another worker (taken over), or ended."""

    def __init__(
        self, generations: Generations, *, max_takeovers: int, requests_maxlen: int
    ) -> None:
        self.generations = generations
        self.redis, self.keys = generations.redis, generations.keys
        self.max_takeovers = max_takeovers
        self.requests_maxlen = requests_maxlen

    async def hand_on(
        self, queue: RequestQueue, request: GenerationRequest, raw: bytes, consumer: str
    ) -> str:
        """Hand on a request left pending in ``queue`` (its model's) by a lost ``consumer``;
        returns what was done."""
        sid, gid = request.session_id, request.generation_id
        gen_key = self.keys.generation(sid, gid)
        owner, redo = consumer, consumer.startswith(REAPER_PREFIX)
        if redo:  # a reaper that stopped mid-way (or a write of its refused): redo it
            owner = wire.text(await self.redis.hget(gen_key, "worker") or b"")
        reply = await self.generations.take_over(
            sid, gid, worker=owner, max_takeovers=self.max_takeovers, lost=True
        )
        match reply:
            case AlreadyFinal():  # counted, should its writer have been lost before its count
                return "final"
            case Moved():
                return "moved"
        epoch = reply.takeovers if isinstance(reply, NotStarted | TakenOver) else 0
        # Queued by a takeover a reaper is redoing: no worker died with it.
        if isinstance(reply, NotStarted) and not redo and await self._killed_too_many(request):
            return "worker_lost"
        if isinstance(reply, NotStarted) and epoch == 0:
            log.info("requeueing %s from a dead worker", gid)
            await self._queue(queue, raw)
            return "requeued"

        async def queue_it(resumed: GenerationRequest) -> None:
            await self._queue(queue, wire.encode(resumed))

        gone_on, streamed = await self.generations.go_on_from_events(
            queue, request, reply, queue_it, max_takeovers=self.max_takeovers
        )
        if gone_on == "taken_over" and streamed and isinstance(reply, NotStarted | TakenOver):
            log.info(
                "taking over %s from %s after %d tokens (takeover %d)",
                gid,
                reply.from_worker,
                streamed.completion_tokens,
                epoch,
            )
        elif gone_on == "worker_lost":
            log.warning("worker lost while running %s; ended worker_lost", gid)
        return gone_on

    async def _killed_too_many(self, request: GenerationRequest) -> bool:
        """Its worker died before it claimed it (while preparing it): counted, so that a
        request that kills every worker that takes it ends (``worker_lost``, True) instead
        of going round."""
        gid = request.generation_id
        gen_key = self.keys.generation(request.session_id, gid)
        lost = int(await self.redis.hincrby(gen_key, LOST_BEFORE_START, 1))
        if lost <= self.max_takeovers:
            return False
        log.warning("%s: %d workers died before starting it; ending it", gid, lost)
        message = (
            f"the engine worker taking this generation stopped before it started ({lost} times)"
        )
        await self._end(request, Error(gid, "worker_lost", message))
        return True

    async def _queue(self, queue: RequestQueue, raw: bytes) -> None:
        await queue.add({"r": raw}, maxlen=self.requests_maxlen)

    async def _end(self, request: GenerationRequest, event: wire.FinalEvent) -> None:
        await self.generations.end(request, event)
