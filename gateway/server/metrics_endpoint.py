"""``/metrics``: the gateway's Prometheus metrics (gateway/server/metrics.py; with ``--workers N``
every process's, gateway/server/federation.py)."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, get
from litestar.response import Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS
from redis.exceptions import RedisError

from gateway.core.service import GatewayService
from gateway.server.metrics import GatewayMetrics

log = logging.getLogger("tokenspout.metrics")


@get("/metrics", tags=["operations"], summary="Prometheus metrics", include_in_schema=False)
async def metrics_endpoint(
    request: Request[Any, Any, Any], service: GatewayService, metrics: GatewayMetrics
) -> Response[bytes]:
    try:
        counts = await service.queue_counts()
        workers = await service.workers_by_model()
    except (RedisError, OSError) as exc:
        # A scrape still answers while Redis is down; the queue gauges keep their last value.
        log.warning("could not read queue depths: %s", exc)
        metrics.redis_error("metrics")
        metrics.redis_up.set(0)
    else:
        metrics.queue_depths(counts)
        metrics.workers(workers)
        metrics.redis_up.set(1)
    # Prometheus asks for OpenMetrics first: the format that carries exemplars. As a
    # header, not a media type: Litestar appends "; charset=utf-8" to every text/ media
    # type, and these have their charset already (it went out twice).
    openmetrics = "application/openmetrics-text" in request.headers.get("accept", "")
    content_type = OPENMETRICS if openmetrics else CONTENT_TYPE_LATEST
    return Response(await metrics.exposition(openmetrics), headers={"content-type": content_type})
