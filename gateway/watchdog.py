"""Background duties of every gateway process.

- ``refresh_watches``: tells workers which sessions this process has readers for, so a
  generation nobody reads is aborted after the grace period (engine/worker.py checks).
- ``reap_dead_workers``: a worker that stops heartbeating leaves requests in the consumer
  group's pending list. One gateway at a time (a Redis lock) takes them: a request that
  never started goes back on the queue for a surviving worker; one that was running ends
  with an ``error`` event (``worker_lost``), so no client waits forever.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from engine import contract
from engine.contract import Error, GenerationRequest, Keys
from gateway.relay import RelayHub
from gateway.sessions import SessionStore

log = logging.getLogger("tokenspout.watchdog")
_request_decoder = msgspec.json.Decoder(GenerationRequest)


WATCH_BATCH = 256
"""Sessions marked per pipeline: one pipeline for 10,000 open streams would hold the event
loop (packing and parsing every reply) long enough to stall every stream of the process."""


async def refresh_watches(store: SessionStore, hub: RelayHub, interval_s: float) -> None:
    while True:
        try:
            sessions = hub.watched_sessions()
            for start in range(0, len(sessions), WATCH_BATCH):
                await store.mark_watched(sessions[start : start + WATCH_BATCH])
        except (RedisError, OSError) as exc:
            log.warning("could not refresh session watches: %s", exc)
        await asyncio.sleep(interval_s)


class Reaper:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        worker_timeout_s: float,
        events_maxlen: int,
        ttl_s: int,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.worker_timeout_s = worker_timeout_s
        self.events_maxlen = events_maxlen
        self.ttl_s = ttl_s
        self._emit = redis.register_script(contract.EMIT_SCRIPT)
        self._owner = f"reaper-{time.monotonic_ns()}"

    async def run_forever(self, interval_s: float = 1.0) -> None:
        while True:
            try:
                if await self._acquire():
                    await self.reap_once()
            except (RedisError, OSError) as exc:
                log.warning("reaper pass failed: %s", exc)
            await asyncio.sleep(interval_s)

    async def _acquire(self) -> bool:
        lock_ms = int(max(2.0, self.worker_timeout_s) * 1000)
        if await self.redis.set(self.keys.reaper_lock, self._owner, nx=True, px=lock_ms):
            return True
        holder = await self.redis.get(self.keys.reaper_lock)
        if holder is not None and contract.text(holder) == self._owner:
            await self.redis.pexpire(self.keys.reaper_lock, lock_ms)
            return True
        return False

    async def reap_once(self) -> int:
        """Handle the pending requests of dead workers; returns how many."""
        try:
            pending = await self.redis.xpending_range(
                self.keys.requests, contract.CONSUMER_GROUP, min="-", max="+", count=500
            )
        except RedisError as exc:
            if "no such key" in str(exc).lower() or "nogroup" in str(exc).lower():
                return 0
            raise
        if not pending:
            return 0
        alive = await self._live_worker_ids()
        dead = [entry for entry in pending if contract.text(entry["consumer"]) not in alive]
        for entry in dead:
            await self._take_over(contract.text(entry["message_id"]))
        return len(dead)

    async def _live_worker_ids(self) -> set[str]:
        since = time.time() - self.worker_timeout_s
        ids = await self.redis.zrangebyscore(self.keys.workers, since, "+inf")
        return {contract.text(worker_id) for worker_id in ids}

    async def _take_over(self, message_id: bytes | str) -> None:
        claimed = await self.redis.xclaim(
            self.keys.requests, contract.CONSUMER_GROUP, self._owner, 0, [message_id]
        )
        for entry_id, fields in contract.entries_of(claimed):
            if not fields:
                continue  # trimmed away meanwhile
            request = _request_decoder.decode(fields[b"r"])
            gen_key = self.keys.generation(request.session_id, request.generation_id)
            state = await self.redis.hget(gen_key, "state")
            if state == b"queued":
                log.info("requeueing %s from a dead worker", request.generation_id)
                await self.redis.xadd(self.keys.requests, {"r": fields[b"r"]})
            else:
                log.warning("worker lost while running %s", request.generation_id)
                await self._end_with_error(request)
            await self.redis.xack(self.keys.requests, contract.CONSUMER_GROUP, entry_id)
        await self.redis.xgroup_delconsumer(
            self.keys.requests, contract.CONSUMER_GROUP, self._owner
        )

    async def _end_with_error(self, request: GenerationRequest) -> None:
        sid, gid = request.session_id, request.generation_id
        error = Error(gid, "worker_lost", "the engine worker running this generation stopped")
        await self._emit(
            keys=[
                self.keys.events(sid),
                self.keys.generation(sid, gid),
                self.keys.active(sid),
                self.keys.history(sid),
            ],
            args=[
                self.keys.live_channel(sid),
                self.events_maxlen,
                self.ttl_s,
                "error",
                gid,
                contract.encode(error),
                "error",
                "",
                "",
            ],
        )
