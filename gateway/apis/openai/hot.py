"""The hot routes: ``POST /v1/chat/completions`` and ``POST /v1/completions``, served by a
bare ASGI handler in front of the Litestar app.

Most of a gateway's requests are those, and Litestar's part of one (routing, dependency
resolution, the handler's signature model, the response objects) was a large share of the
gateway's CPU per request (docs/bench.md). Here a request takes none of it: its
body is decoded into the same request struct, it is submitted and answered by the same
function as the Litestar route's (``answer``, with the same ``Endpoint``; ``send_stream``
sends a stream), and an error answers in the same format (``error_answer``).

Only a request this handler can take whole is taken; every other one goes on to Litestar
as it came (its body, already read, handed on unchanged), so every error the app answers
is answered there, once: a body that is not a valid request, over the size limit or not
JSON; a missing or wrong API key; a browser's cross-origin request when CORS is configured.
A request taken here serves its key's tenant, as ``api_key_check`` would name it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
from litestar.enums import ScopeType
from litestar.types import (
    ASGIApp,
    HTTPRequestEvent,
    HTTPResponseStartEvent,
    Receive,
    ReceiveMessage,
    Scope,
    Send,
)

from gateway.apis.openai.errors import error_answer
from gateway.apis.openai.routes import (
    CHAT,
    CHAT_COMPLETIONS,
    COMPLETION,
    COMPLETIONS,
    PREFIX,
    Endpoint,
    Streamed,
    answer,
)
from gateway.apis.openai.schema import ChatCompletionRequest, CompletionRequest
from gateway.core.auth import ApiKeys, bearer
from gateway.core.service import GatewayService
from gateway.tenants.caller import caller_of
from gateway.transport import sse
from gateway.transport.drain_cut import UnansweredRequests

Request = TypeVar("Request", ChatCompletionRequest, CompletionRequest)


@dataclass(frozen=True)
class HotRoute(Generic[Request]):
    """One hot route: its request's strict decoder, and the Litestar route's endpoint."""

    decode: Callable[[bytes], Request]
    endpoint: Endpoint[Request]

    def decoded(self, body: bytes) -> Request | None:
        """The request; None when the body is not one (Litestar answers it)."""
        try:
            return self.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
            return None


ROUTES: dict[str, HotRoute[Any]] = {
    PREFIX + CHAT_COMPLETIONS: HotRoute(msgspec.json.Decoder(ChatCompletionRequest).decode, CHAT),
    PREFIX + COMPLETIONS: HotRoute(msgspec.json.Decoder(CompletionRequest).decode, COMPLETION),
}


def _encoded(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """Headers as ASGI sends them: lower-case names, bytes."""
    return [(name.lower().encode(), value.encode()) for name, value in headers.items()]


_STREAM_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    *_encoded(sse.HEADERS),
]


class HotRoutes:
    """The ASGI app: the hot routes' requests, and ``app`` (Litestar) for the rest."""

    def __init__(
        self,
        app: ASGIApp,
        service: GatewayService,
        api_keys: ApiKeys,
        unanswered: UnansweredRequests,
    ) -> None:
        self.app = app
        self.service = service
        self.unanswered = unanswered
        self.max_body_bytes = service.settings.max_body_bytes
        self.api_keys = api_keys
        self.cors = bool(service.settings.cors_origin_list())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = None
        if scope["type"] == ScopeType.HTTP and scope["method"] == "POST":
            route = ROUTES.get(scope["path"])
        if route is None:
            await self.app(scope, receive, send)
            return
        authorization: str | None = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif (name == b"origin" and self.cors) or (
                name == b"content-type" and not value.startswith(b"application/json")
            ):
                await self.app(scope, receive, send)
                return
        body, whole = await self._read_body(receive)
        data = route.decoded(body) if whole and len(body) <= self.max_body_bytes else None
        caller = caller_of(scope)
        if data is None or not self.api_keys.serve(caller, bearer(authorization)):
            await self.app(scope, _replaying(body, whole, receive), send)
            return
        scope["path_template"] = scope["path"]  # what Litestar sets: the metric's label
        try:
            async with self.unanswered.waiting():  # a shutdown's cut: 503 shutting_down
                answered = await answer(route.endpoint, self.service, data, caller)
        except Exception as exc:  # answered as Litestar's exception handler answers it
            status, error, headers = error_answer(exc)
            await _send_json(send, status, msgspec.json.encode(error), headers)
            return
        if not isinstance(answered, Streamed):
            await _send_json(send, 200, msgspec.json.encode(answered))
            return
        chunks, choices = answered
        try:
            start: HTTPResponseStartEvent = {
                "type": "http.response.start",
                "status": 200,
                "headers": _STREAM_HEADERS,
            }
            await send(start)
            await sse.send_stream(chunks, send, receive)
        finally:
            await choices.close()

    async def _read_body(self, receive: Receive) -> tuple[bytes, bool]:
        """The body, up to the size limit; and whether it is whole (else more follows)."""
        pieces: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: Litestar's to see
                return b"".join(pieces), False
            piece = message.get("body", b"")
            pieces.append(piece)
            size += len(piece)
            if not message.get("more_body", False):
                return (piece if len(pieces) == 1 else b"".join(pieces)), True
            if size > self.max_body_bytes:
                return b"".join(pieces), False


def _replaying(body: bytes, whole: bool, receive: Receive) -> Receive:
    """``receive`` for the app, giving it first the body already read."""
    given = False

    async def replay() -> ReceiveMessage:
        nonlocal given
        if given:
            return await receive()
        given = True
        read: HTTPRequestEvent = {"type": "http.request", "body": body, "more_body": not whole}
        return read

    return replay


async def _send_json(
    send: Send, status: int, body: bytes, headers: Mapping[str, str] | None = None
) -> None:
    """A JSON answer, with the headers Litestar's ``Response`` gives it."""
    start: HTTPResponseStartEvent = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *_encoded(headers or {}),
        ],
    }
    await send(start)
    await send({"type": "http.response.body", "body": body, "more_body": False})
