"""Liveness and readiness: ``/health`` says the process runs, ``/ready`` that it can serve."""

from __future__ import annotations

import msgspec
from litestar import get
from litestar.response import Response

from engine.contract import WorkerInfo
from gateway.errors import Unavailable
from gateway.sessions import SessionStore


class Readiness(msgspec.Struct):
    ready: bool
    redis: str
    workers: list[WorkerInfo]


@get("/health", tags=["operations"], summary="Liveness")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@get("/ready", tags=["operations"], summary="Redis reachable and an engine worker alive")
async def ready(store: SessionStore) -> Response[Readiness]:
    try:
        await store.ping()
    except Unavailable as exc:
        return Response(Readiness(False, exc.message, []), status_code=503)
    workers = await store.live_workers()
    return Response(Readiness(bool(workers), "ok", workers), status_code=200 if workers else 503)
