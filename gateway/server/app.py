"""The Litestar application: resources in one lifespan, routes, and its error handler."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from litestar import Litestar, Response
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.di import Provide
from litestar.static_files import create_static_files_router
from litestar.types import ControllerRouterHandler
from redis.exceptions import RedisError

from gateway.apis.openai.hot import HotRoutes
from gateway.apis.tgi import compat_generate
from gateway.core.auth import API_KEYS_STATE, ApiKeys
from gateway.core.errors import HANDLED, AnyRequest, ErrorEnvelope, request_error
from gateway.core.relay.hub import RelayHub
from gateway.core.service import GatewayService
from gateway.core.settings import Settings
from gateway.recovery.admissions import UnsubmittedAdmissions
from gateway.recovery.lost_submits import LostSubmits
from gateway.recovery.reader_deadline import ReaderDeadline
from gateway.recovery.reaper import Reaper
from gateway.recovery.stranded import StrandedTurns
from gateway.server.metrics import GatewayMetrics
from gateway.server.middleware import RequestMetrics
from gateway.server.openapi import openapi_config
from gateway.server.routes import ROUTES
from gateway.transport.drain_cut import UnansweredRequests
from wire import Keys
from wire.connect import connect, ready, when_redis_answers
from wire.tracing import stop_tracer

if TYPE_CHECKING:
    from gateway.server.grpc import GrpcServer

log = logging.getLogger("tokenspout.gateway")

STOP_WAIT_S = 5.0
"""How long the background duties may take to end at shutdown; what has not ended by then
is logged with where it waits and left behind, so a stuck one never keeps the process up."""
CUT_MARGIN_S = 1.0
"""A request still waiting for its whole generation is answered this long before the
shutdown grace ends (half the grace when that is shorter): time to write the answer."""


async def _ended_within(seconds: float, tasks: list[asyncio.Task[None]]) -> None:
    _, stuck = await asyncio.wait(tasks, timeout=seconds)
    for task in stuck:
        where = "; ".join(
            f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"
            for frame in task.get_stack()
        )
        log.error("shutdown: %s did not end within %.0f s, at %s", task, seconds, where)


REDIS_POOL_SIZE = 64
"""Connections per gateway process for commands (the relay adds one pub/sub connection)."""


class Services:
    """What the lifespan opens; handed to handlers through dependency injection."""

    def __init__(
        self,
        settings: Settings,
        grpc_host: str = "127.0.0.1",
        *,
        grpc_socket: socket.socket | None = None,
        peers_dir: Path | None = None,
        process_index: int = 0,
    ) -> None:
        """``grpc_socket``, ``peers_dir``, ``process_index``: one of the processes of
        ``python -m gateway --workers N`` (gateway/server/supervisor.py): its gRPC listening socket,
        and where its siblings' metrics are (gateway/server/federation.py)."""
        self.settings = settings
        self.redis = connect(
            settings.redis_url,
            max_connections=REDIS_POOL_SIZE,
            timeout=5,
            health_check_interval=10,
        )
        self.keys = Keys(settings.key_prefix)
        self.metrics = GatewayMetrics(peers_dir, process_index)
        # The static keys are read here: a missing key file stops the start (ConfigError).
        self.hub = RelayHub(
            self.redis, self.keys, settings.stream_buffer_events, observer=self.metrics
        )
        self.metrics.active_streams.set_function(lambda: self.hub.open_feeds)
        self.unanswered = UnansweredRequests()
        self.service = GatewayService(self.redis, self.hub, settings, observer=self.metrics)
        self.api_keys = ApiKeys(self.service.directory, settings.admin_key)
        self.metrics.tenant_label = self._tenant_label
        self.reaper, self.reader_deadline = self._recovery()
        self.grpc: GrpcServer | None = None
        if settings.grpc_port:
            self.grpc = self._grpc_server(grpc_host, grpc_socket)

    def _tenant_label(self, tenant_id: str) -> str:
        """A tenant's label in the metrics (the key directory's: bounded)."""
        directory = self.service.directory
        tenant = directory.by_id(tenant_id) if tenant_id else None
        if tenant is None:  # anonymous, or a key gone since
            return "other" if tenant_id else "anonymous"
        return directory.label(tenant)

    def _recovery(self) -> tuple[Reaper, ReaderDeadline]:
        """The reaper (one gateway at a time) and this process's readers' deadline."""
        settings = self.settings
        service = self.service
        generations = service.generations
        stranded = StrandedTurns(service.sessions, service.queue)
        admissions = UnsubmittedAdmissions(generations, service.admission)
        reaper = Reaper(generations, settings, stranded=stranded, admissions=admissions)
        deadline = ReaderDeadline(generations, self.hub, stranded, settings.queue_timeout_s)
        return reaper, deadline

    def _grpc_server(self, host: str, sock: socket.socket | None) -> GrpcServer:
        # Imported only here: the gRPC stack (grpc, tritonclient, numpy) is a third of a
        # second of every start, and most gateways serve no gRPC.
        from gateway.apis.oip.grpc.service import InferenceService
        from gateway.server.grpc import GrpcServer

        return GrpcServer(
            InferenceService(self.service, self.api_keys),
            host,
            self.settings.grpc_port,
            max_message_bytes=self.settings.max_body_bytes,
            grace_s=self.settings.shutdown_grace_s,
            sock=sock,
        )

    def begin_drain(self) -> None:
        """The shutdown signal came: streams end as their generations do, no new RPC."""
        grace_s = self.settings.shutdown_grace_s
        cut_after_s = grace_s - min(CUT_MARGIN_S, grace_s / 2)
        self.hub.begin_drain(cut_after_s=cut_after_s)
        asyncio.get_running_loop().call_later(cut_after_s, self.unanswered.cut)
        if self.grpc is not None:
            self.grpc.begin_drain()

    def dependencies(self) -> dict[str, Provide]:
        """The services by name, for handlers to ask for.

        Litestar resolves the dependencies of one level concurrently, in an anyio task group
        with a task for each, on every request. Chained (each takes the one before it), every
        level holds one and resolves inline: no task group on the way to a handler.
        """

        def service() -> GatewayService:
            return self.service

        def metrics(service: GatewayService) -> GatewayMetrics:
            return self.metrics

        def api_keys(metrics: GatewayMetrics) -> ApiKeys:
            return self.api_keys

        providers: list[Callable[..., object]] = [service, metrics, api_keys]
        return {p.__name__: Provide(p, sync_to_thread=False) for p in providers}

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Litestar) -> AsyncIterator[None]:
        await when_redis_answers(lambda: ready(self.redis), "gateway start")
        keys = self.service.directory
        await keys.first_load()
        await self.hub.start()
        if self.grpc is not None:
            await self.grpc.start()
        if self.metrics.peers is not None:
            await self.metrics.peers.start()
        tasks = [
            asyncio.create_task(self.service.watch_marks.refresh_forever()),
            asyncio.create_task(self.reaper.run_forever()),
            asyncio.create_task(self.reader_deadline.run_forever()),
            asyncio.create_task(LostSubmits(self.redis, self.service.submitter).run_forever()),
            asyncio.create_task(self.service.models.refresh_forever()),
            asyncio.create_task(keys.refresh_forever()),
        ]
        try:
            yield
        finally:
            if self.metrics.peers is not None:
                await self.metrics.peers.stop()
            if self.grpc is not None:
                await self.grpc.stop()  # its streams end, their generations closed, first
            for task in tasks:
                task.cancel()
            stop = asyncio.create_task(self.hub.stop(), name="relay hub stop")
            await _ended_within(STOP_WAIT_S, [*tasks, stop])
            await self.redis.aclose()
            # The spans left go out here: after the app's shutdown, uvicorn raises the
            # signal that stopped it again, and the process ends at once.
            stop_tracer()


def create_app(settings: Settings | None = None, services: Services | None = None) -> Litestar:
    settings = settings or Settings.from_env()
    services = services or Services(settings)
    metrics = services.metrics

    def handle_error(request: AnyRequest, exc: Exception) -> Response[ErrorEnvelope]:
        """Every error a handler raises, in the gateway's own format (gateway/core/errors.py)."""
        if isinstance(exc, RedisError):
            metrics.redis_error("request")
        error = request_error(request, exc)
        return Response(error.body(), status_code=error.status, headers=error.headers())

    handlers: list[ControllerRouterHandler] = list(ROUTES)
    web_dir = Path(settings.web_dir)
    if web_dir.is_dir():
        handlers.append(
            create_static_files_router(
                path="/", directories=[web_dir], html_mode=True, include_in_schema=False
            )
        )
    handlers.append(compat_generate)  # after the web chat's router: see its docstring
    origins = settings.cors_origin_list()
    return Litestar(
        route_handlers=handlers,
        lifespan=[services.lifespan],
        dependencies=services.dependencies(),
        state=State({API_KEYS_STATE: services.api_keys}),  # gateway.core.auth reads it
        exception_handlers={kind: handle_error for kind in HANDLED},
        middleware=[services.unanswered.middleware],
        request_max_body_size=settings.max_body_bytes,
        cors_config=CORSConfig(allow_origins=origins) if origins else None,
        openapi_config=openapi_config(),
        logging_config=None,
    )


def create_asgi_app(
    settings: Settings, grpc_host: str = "127.0.0.1", **place: Any
) -> tuple[RequestMetrics, Services]:
    """What ``python -m gateway`` serves: the app inside its request-metrics layer (and the
    gRPC server on ``grpc_host``, the HTTP server's host, started by its lifespan);
    ``place``: ``Services``' arguments for one of several processes."""
    services = Services(settings, grpc_host, **place)
    app = HotRoutes(
        create_app(settings, services), services.service, services.api_keys, services.unanswered
    )
    return RequestMetrics(app, services.metrics), services
