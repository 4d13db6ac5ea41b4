"""Every transport's routes; each module owns one transport."""

from __future__ import annotations

from litestar.types import ControllerRouterHandler

from gateway.routes.health import health, ready
from gateway.routes.metrics import metrics_endpoint
from gateway.routes.oip import oip_router
from gateway.routes.openai import openai_router
from gateway.routes.responses import responses_router
from gateway.routes.responses_ws import responses_socket_router
from gateway.routes.sessions import SessionController
from gateway.routes.tgi import tgi_router
from gateway.routes.tokenize import tokenize_router
from gateway.routes.ws import ws_endpoint

ROUTES: list[ControllerRouterHandler] = [
    health,
    ready,
    metrics_endpoint,
    SessionController,
    ws_endpoint,
    openai_router,
    responses_router,
    responses_socket_router,
    tgi_router,
    oip_router,
    tokenize_router,
]
