"""Every transport's routes; each module owns one transport."""

from __future__ import annotations

from litestar.types import ControllerRouterHandler

from gateway.apis.admin.routes import admin_router
from gateway.apis.oip.routes import oip_router
from gateway.apis.openai.responses.routes import responses_router
from gateway.apis.openai.responses.socket import responses_socket_router
from gateway.apis.openai.routes import openai_router
from gateway.apis.openai.tokenize import tokenize_router
from gateway.apis.sessions.routes import SessionController
from gateway.apis.sessions.socket import ws_endpoint
from gateway.apis.tgi import tgi_router
from gateway.server.health import health, ready
from gateway.server.metrics_endpoint import metrics_endpoint

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
    admin_router,
]
