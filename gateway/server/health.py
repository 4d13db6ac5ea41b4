"""Liveness and readiness: ``/health`` says the process runs, ``/ready`` that it can serve."""

from __future__ import annotations

from typing import Literal

import msgspec
from litestar import get
from litestar.response import Response

from gateway.core.readiness import Readiness
from gateway.core.service import GatewayService


class Alive(msgspec.Struct, frozen=True):
    status: Literal["ok"] = "ok"


@get("/health", tags=["operations"], summary="Liveness: 200 while the process runs")
async def health() -> Alive:
    return Alive()


@get(
    "/ready",
    tags=["operations"],
    summary="Readiness: 200 when Redis answers and an engine worker is alive, else 503",
)
async def ready(service: GatewayService) -> Response[Readiness]:
    readiness = await service.readiness()
    return Response(readiness, status_code=200 if readiness.ready else 503)
