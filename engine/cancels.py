"""The ``cancels`` stream, as a worker reads it: every cancel signal sent from now on.

Every worker reads every signal (a gateway does not know which worker runs a generation);
the one that runs it aborts it (``Worker.cancel``). Reading starts after the newest signal
already there, and goes on through Redis outages (logged, counted, retried).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

import wire
from engine.metrics import WorkerMetrics
from wire import CancelSignal, Keys
from wire.connect import on_key_node

log = logging.getLogger("tokenspout.worker")
_decoder = msgspec.json.Decoder(CancelSignal)
RETRY_S = 0.5


async def cancel_signals(
    redis: aioredis.Redis, keys: Keys, metrics: WorkerMetrics
) -> AsyncIterator[CancelSignal]:
    last = await _newest_id(redis, keys)
    while True:
        try:
            read = ("XREAD", "COUNT", 256, "BLOCK", 1000, "STREAMS", keys.cancels, last)
            reply = await on_key_node(redis, keys.cancels, *read)
        except (RedisError, OSError) as exc:
            log.warning("reading cancels failed (%s); retrying", exc)
            metrics.redis_errors.labels("cancels").inc()
            await asyncio.sleep(RETRY_S)
            continue
        for entry_id, fields in wire.read_entries(reply):
            last = entry_id.decode()
            yield _decoder.decode(fields[b"c"])


async def _newest_id(redis: aioredis.Redis, keys: Keys) -> str:
    while True:
        try:
            entries = wire.entries_of(await redis.xrevrange(keys.cancels, count=1))
            return entries[0][0].decode() if entries else "0-0"
        except (RedisError, OSError) as exc:
            log.warning("reading cancels failed (%s); retrying", exc)
            await asyncio.sleep(RETRY_S)
