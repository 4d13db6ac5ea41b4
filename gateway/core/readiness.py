"""Whether this gateway can serve: Redis answers and an engine worker is alive (``/ready``,
gRPC ``ServerReady``)."""

from __future__ import annotations

import asyncio

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.core.store.models import ModelDirectory
from wire import WorkerInfo

READY_PING_S = 5.0
"""How long ``/ready`` waits for Redis's PONG: commands have no timeout of their own (a slow
Redis is waited for; wire/connect.py), a readiness probe must answer."""


class Readiness(msgspec.Struct):
    ready: bool
    redis: str
    workers: list[WorkerInfo]
    models: dict[str, int] = {}
    """Every registered model -> its live workers (0: its last worker left)."""


async def check_readiness(redis: aioredis.Redis, models: ModelDirectory) -> Readiness:
    """Redis answers and an engine worker is alive (``/ready``, gRPC ``ServerReady``)."""
    try:
        async with asyncio.timeout(READY_PING_S):
            await redis.ping()
    except TimeoutError:
        return Readiness(False, f"Redis did not answer within {READY_PING_S:g} s", [])
    except (RedisError, OSError) as exc:
        return Readiness(False, f"Redis is unreachable: {exc}", [])
    snapshot = await models.snapshot(fresh=True)
    served = dict.fromkeys(snapshot.models, 0)
    for model, workers in snapshot.live.items():
        served[model] = len(workers)
    return Readiness(bool(snapshot.workers), "ok", snapshot.workers, served)
