"""Liveness and readiness: ``/health`` says the process runs, ``/ready`` that it can serve."""

from __future__ import annotations

from litestar import get
from litestar.response import Response

from gateway.core.readiness import Readiness, check_readiness
from gateway.core.sessions import SessionStore


@get("/health", tags=["operations"], summary="Liveness")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@get("/ready", tags=["operations"], summary="Redis reachable and an engine worker alive")
async def ready(store: SessionStore) -> Response[Readiness]:
    readiness = await check_readiness(store)
    return Response(readiness, status_code=200 if readiness.ready else 503)
