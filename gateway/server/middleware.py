"""The outermost ASGI layer: a request id, one log line and one metric count per request,
the ``x-ratelimit-*`` headers of a key with limits (its caller, gateway/tenants/caller.py),
and, with tracing on, the request's trace (gateway/core/tracing.py): its span, continuing
the caller's ``traceparent``, and a ``traceresponse`` header naming it.

It wraps the whole Litestar app, so requests that match no route (404, 405) are counted
too. Routes are labelled by their template (``/v1/sessions/{session_id}/events``), never
by the raw path, so the metric's label set stays small. The log line carries the ids in the
path (session, generation) and no body: message text never reaches the logs.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.core import tracing
from gateway.core.ids import token_hex
from gateway.server.metrics import GatewayMetrics
from gateway.tenants.caller import caller_of

log = logging.getLogger("tokenspout.http")

REQUEST_ID_HEADER = b"x-request-id"
TRACEPARENT_HEADER = b"traceparent"
TRACERESPONSE_HEADER = b"traceresponse"
"""W3C Trace Context's response header: the trace (and span) the request was served in."""
_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")
QUIET_ROUTES = frozenset({"/health", "/ready", "/metrics"})
"""Probes and scrapes: logged at DEBUG only, so they do not flood the logs."""
UNMATCHED = "unmatched"


def request_id_of(scope: Scope) -> str:
    """The client's or proxy's ``X-Request-ID`` when it is sane, else a fresh one."""
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER and _REQUEST_ID.match(value):
            return str(value.decode())
    return token_hex(8)


def begin_trace(scope: Scope, websocket: bool) -> tracing.RequestTrace | None:
    """The request's trace, continuing the caller's ``traceparent`` (None: tracing off)."""
    if not tracing.enabled() or scope.get("path") in QUIET_ROUTES:
        return None
    incoming = next((v for n, v in scope.get("headers", ()) if n == TRACEPARENT_HEADER), None)
    method = "WS" if websocket else str(scope.get("method", ""))
    attributes = {"http.request.method": method, "url.path": str(scope.get("path", ""))}
    return tracing.begin(method, incoming.decode("latin-1") if incoming else None, attributes)


class RequestMetrics:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in (ScopeType.HTTP, ScopeType.WEBSOCKET):
            await self.app(scope, receive, send)
            return
        websocket = scope["type"] == ScopeType.WEBSOCKET
        request_id = request_id_of(scope)
        began = time.monotonic()
        status = "101" if websocket else "500"
        # Who it serves: the key check fills it in, an admission leaves the key's counts.
        serving = caller_of(scope)
        trace = begin_trace(scope, websocket)

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
                headers = list(message.get("headers", ()))
                headers.append((REQUEST_ID_HEADER, request_id.encode()))
                if serving.quota is not None:
                    headers += [(k.encode(), v.encode()) for k, v in serving.headers()]
                if trace is not None:
                    headers.append((TRACERESPONSE_HEADER, trace.traceparent.encode()))
                    trace.responded()
                message = {**message, "headers": headers}
            elif message["type"] == "websocket.close" and status == "101":
                status = "403"  # closed before it was accepted
            elif message["type"] == "websocket.accept":
                status = "101"
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._record(scope, websocket, status, request_id, time.monotonic() - began, trace)

    def _record(
        self,
        scope: Scope,
        websocket: bool,
        status: str,
        request_id: str,
        seconds: float,
        trace: tracing.RequestTrace | None,
    ) -> None:
        route = str(scope.get("path_template") or UNMATCHED)
        method = "WS" if websocket else str(scope.get("method", ""))
        self.metrics.requests.labels(method, route, status).inc()
        params: dict[str, Any] = scope.get("path_params") or {}
        if trace is not None:
            attributes: dict[str, str | int] = {
                "http.route": route,
                "http.response.status_code": int(status),
                "tokenspout.request_id": request_id,
            }
            trace.end(f"{method} {route}", status.startswith("5"), attributes)
        level = logging.DEBUG if route in QUIET_ROUTES else logging.INFO
        if log.isEnabledFor(level):
            extra = {
                "request_id": request_id,
                "method": method,
                "route": route,
                "status": status,
                "duration_ms": round(seconds * 1000, 1),
            }
            for key in ("session_id", "generation_id"):
                if key in params:
                    extra[key] = params[key]
            log.log(level, "request", extra=extra)
