"""``WS /v1/responses``: the Responses API's WebSocket mode, as OpenAI documents it.

Each ``response.create`` frame is a ``POST /v1/responses`` body (``stream`` is implicit;
``background`` is refused, as OpenAI refuses it over a socket) and the response's events
come back as text frames, in the SSE stream's shapes and order. Frames with the same
``stream_id`` (none is a lane of its own) are answered one after another, first in first
out; different lanes run at once, and their events echo their ``stream_id``.

A response made here is a stored response like any other
(gateway/apis/openai/responses/store.py): its events are in Redis, so ``GET
/v1/responses/{id}?stream=true&starting_after=N`` resumes it on any replica, ``POST
/v1/responses/{id}/cancel`` stops it from anywhere, and the next frame's
``previous_response_id`` continues it. A socket that closes abandons its running responses
as an SSE client that leaves does (cancelled after the abandon grace); an unstored one is
forgotten.

A frame that cannot be answered gets an ``error`` event (``{"type": "error", "status":
400, "error": {...}}``, with the frame's ``stream_id``) and the socket stays open; so do
the other lanes. ``response.steer`` is not supported: it is answered with such an error.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from litestar import Router, WebSocket, websocket
from litestar.exceptions import WebSocketDisconnect
from redis.exceptions import RedisError

from gateway.apis.openai.errors import error_body
from gateway.apis.openai.responses.routes import ResponseRequest, after_owner, open_response
from gateway.core.auth import api_key_guard
from gateway.core.errors import (
    BadRequest,
    GatewayError,
    Unavailable,
    as_gateway_error,
    not_json,
    over_body_limit,
)
from gateway.core.service import GatewayService
from gateway.core.walk import Heartbeat
from gateway.tenants.caller import caller_of
from gateway.transport.websocket import received

log = logging.getLogger("tokenspout.responses_ws")

MAX_WAITING = 64
"""``response.create`` frames one socket may have queued or running across its lanes."""

AnyWebSocket = WebSocket[Any, Any, Any]
Lane = str | None


class ResponsesSocket:
    """One client socket: reads frames, runs one task per lane, writes events in order."""

    def __init__(self, socket: AnyWebSocket, service: GatewayService) -> None:
        self.socket = socket
        self.service = service
        self.settings = service.settings
        self.caller = caller_of(socket.scope)
        self._lanes: dict[Lane, asyncio.Queue[ResponseRequest]] = {}
        self._workers: set[asyncio.Task[None]] = set()
        self._waiting = 0
        self._send_lock = asyncio.Lock()

    async def serve(self) -> None:
        await self.socket.accept()
        try:
            async for data in received(self.socket):
                await self._handle(data)
        except WebSocketDisconnect:  # a send found it gone
            return
        finally:
            # The client left: each lane's running response is abandoned by its task.
            for worker in self._workers:
                worker.cancel()
            await asyncio.gather(*self._workers, return_exceptions=True)

    async def _handle(self, data: str | bytes) -> None:
        lane: Lane = None
        try:
            lane, request = self._read(data)
            if self._waiting >= MAX_WAITING:
                raise BadRequest(
                    f"{MAX_WAITING} responses are already queued or running on this socket",
                    code="too_many_responses",
                )
        except GatewayError as exc:
            await self._send_error(exc, lane)
            return
        self._waiting += 1
        queue = self._lanes.get(lane)
        if queue is None:
            queue = self._lanes[lane] = asyncio.Queue()
            worker = asyncio.create_task(self._run_lane(lane, queue), name=f"lane {lane}")
            self._workers.add(worker)
            worker.add_done_callback(self._lane_done)
        queue.put_nowait(request)

    def _read(self, data: str | bytes) -> tuple[Lane, ResponseRequest]:
        """The frame's lane and request; ``BadRequest`` naming what is wrong."""
        if len(data) > self.settings.max_body_bytes:
            raise BadRequest(over_body_limit("the frame", self.settings.max_body_bytes))
        try:
            frame = msgspec.json.decode(data)
        except (msgspec.DecodeError, UnicodeDecodeError):
            raise not_json(data.encode() if isinstance(data, str) else data, "the frame") from None
        if not isinstance(frame, dict):
            raise BadRequest("a frame must be a JSON object")
        lane = frame.pop("stream_id", None)
        if lane is not None and not isinstance(lane, str):
            raise BadRequest("stream_id must be a string", field="stream_id")
        kind = frame.pop("type", None)
        if kind != "response.create":
            code = "unsupported_event" if kind == "response.steer" else "unknown_event"
            raise BadRequest(
                f"unsupported event type {kind!r}: this socket takes response.create",
                code=code,
                field="type",
            )
        if frame.pop("background", None):
            raise BadRequest("background is not supported over WebSocket", field="background")
        if frame.pop("stream", True) is not True:
            raise BadRequest("stream is implicit over WebSocket", field="stream")
        try:
            request = msgspec.convert(frame, ResponseRequest)
        except msgspec.ValidationError as exc:
            raise BadRequest(str(exc)) from None
        return lane, request

    async def _run_lane(self, lane: Lane, queue: asyncio.Queue[ResponseRequest]) -> None:
        """The lane's frames in order; it ends (and is forgotten) when none waits."""
        try:
            while not queue.empty():
                request = queue.get_nowait()
                try:
                    await self._answer(lane, request)
                finally:
                    self._waiting -= 1
        finally:
            self._waiting -= queue.qsize()  # frames a failed lane will not answer
            del self._lanes[lane]

    def _lane_done(self, worker: asyncio.Task[None]) -> None:
        self._workers.discard(worker)
        error = None if worker.cancelled() else worker.exception()
        if error is not None and not isinstance(error, WebSocketDisconnect | OSError):
            log.error("a Responses socket lane failed", exc_info=error)  # not the client leaving

    async def _answer(self, lane: Lane, request: ResponseRequest) -> None:
        """One response's events, then the next frame of the lane; an error is an event."""
        try:
            response = await open_response(self.service, request, self.caller)
        except (GatewayError, RedisError) as exc:
            await self._send_error(_as_error(exc), lane)
            return
        renderer = response.renderer()
        try:
            events = response.events(self.settings.sse_heartbeat_s, -1, renderer)
            async for batch in events:
                if isinstance(batch, Heartbeat):
                    continue  # the WebSocket's own pings keep the connection alive
                for event in batch:
                    await self._send(event, lane)
        except (GatewayError, RedisError) as exc:
            await self._send_error(_as_error(exc), lane)
        finally:
            await after_owner(response, renderer.ended)

    async def _send_error(self, error: GatewayError, lane: Lane) -> None:
        status = 400 if error.status == 422 else error.status
        body = msgspec.to_builtins(error_body(error).error)
        await self._send({"type": "error", "status": status, "error": body}, lane)

    async def _send(self, event: dict[str, Any], lane: Lane) -> None:
        if lane is not None:
            event = {**event, "stream_id": lane}
        async with self._send_lock:
            await self.socket.send_data(msgspec.json.encode(event).decode())


def _as_error(exc: GatewayError | RedisError) -> GatewayError:
    if isinstance(exc, RedisError):
        log.warning("redis error on a Responses socket: %s", exc)
        return Unavailable("lost the connection to Redis; retry the response")
    return as_gateway_error(exc)


@websocket("/responses", name="responses_ws")
async def responses_socket(socket: AnyWebSocket, service: GatewayService) -> None:
    """OpenAI's Responses WebSocket mode; see docs/api.md, "OpenAI Responses"."""
    await ResponsesSocket(socket, service).serve()


responses_socket_router = Router(
    path="/v1", route_handlers=[responses_socket], tags=["openai"], guards=[api_key_guard]
)
