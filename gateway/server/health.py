"""Liveness and readiness: ``/health`` says the process runs, ``/ready`` that it can serve."""

from __future__ import annotations

from litestar import get
from litestar.response import Response

from gateway.core.readiness import Readiness
from gateway.core.service import GatewayService


@get("/health", tags=["operations"], summary="Liveness")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@get("/ready", tags=["operations"], summary="Redis reachable and an engine worker alive")
async def ready(service: GatewayService) -> Response[Readiness]:
    readiness = await service.readiness()
    return Response(readiness, status_code=200 if readiness.ready else 503)
