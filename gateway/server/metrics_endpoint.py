"""``/metrics``: the gateway's Prometheus metrics (gateway/server/metrics.py; with ``--workers N``
every process's, gateway/server/federation.py)."""

from __future__ import annotations

import logging

from litestar import get
from litestar.response import Response
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from gateway.core.service import GatewayService
from gateway.server.metrics import GatewayMetrics

log = logging.getLogger("tokenspout.metrics")


@get("/metrics", tags=["operations"], summary="Prometheus metrics", include_in_schema=False)
async def metrics_endpoint(service: GatewayService, metrics: GatewayMetrics) -> Response[bytes]:
    try:
        counts = await service.queue_counts()
    except (RedisError, OSError) as exc:
        # A scrape still answers while Redis is down; the queue gauges keep their last value.
        log.warning("could not read queue depths: %s", exc)
        metrics.redis_error("metrics")
    else:
        metrics.queue_depths(counts)
    # As a header, not a media type: Litestar appends "; charset=utf-8" to every text/
    # media type, and Prometheus's has its charset already (it went out twice).
    return Response(await metrics.exposition(), headers={"content-type": CONTENT_TYPE_LATEST})
