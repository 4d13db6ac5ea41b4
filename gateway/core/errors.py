"""The gateway's errors, the one table that maps them to HTTP and WebSocket, and the one
translation of every other error a request can end with (``as_gateway_error``).

GatewayError               HTTP status (WebSocket close code); gRPC status in ``grpc_code``
 ├── ProtocolViolation     400  a WebSocket client broke the protocol past a limit (4400)
 ├── BadRequest            422  a field is wrong (names the field)
 ├── PayloadTooLarge       413  body or message over its limit
 ├── Unauthorized          401  API key missing or wrong
 ├── Forbidden             403  session token missing or wrong
 ├── NotFound              404  unknown session or generation
 ├── Conflict              409  the session is already generating
 ├── Overloaded            429  too many generations in flight (Retry-After)
 │    └── RateLimited           a key at one of its limits (``rate_limit_exceeded``)
 ├── Gone                  410  a stream's events are no longer there (4410)
 │    ├── EventsExpired         trimmed past the reader's last id (``events_expired``)
 │    ├── EventsLost            the reader's last id is ahead of the stream (``events_lost``)
 │    └── SessionLost           Redis lost the session while a reader was attached
 ├── BadEngineOutput       502  the engine sent what it must not (no logprobs when asked)
 ├── Unavailable           503  Redis unreachable or no engine can take work
 └── FrameworkError        its own status: an HTTP error Litestar raised itself (405 ...)

Every error body is ``{"error": {"code": ..., "message": ..., "field": ...}}``; the
OpenAI, TGI and OIP adapters spell the same ``GatewayError`` in their own clients' error
formats (their ``*_error`` handlers in gateway/apis/; the gRPC service's status codes and
``error_message``, gateway/apis/oip/grpc/service.py), over ``request_error`` (a handler's:
it has the request) or ``as_gateway_error``; a stream that fails after its headers ends in
that format too (``ending_with_error``). The wording that says what to change lives here
too: a limit and its setting (``over_body_limit``), where a body stops being JSON
(``not_json``), what an event id looks like (``bad_event_id``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from litestar.connection import Request
from litestar.exceptions import HTTPException, ValidationException
from litestar.utils.scope.state import ScopeState
from redis.exceptions import RedisError

log = logging.getLogger("tokenspout.errors")
AnyRequest = Request[Any, Any, Any]
"""What an exception handler gets (the app's and each adapter router's)."""
UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`")
MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")
BODY_KEY = "data"
"""Litestar's name, in a validation error, for the request body as a whole."""
MALFORMED_AT = re.compile(r"JSON is malformed: (.+) \(byte ([0-9]+)\)")


class ErrorBody(msgspec.Struct, omit_defaults=True):
    code: str
    message: str
    field: str | None = None


class ErrorEnvelope(msgspec.Struct):
    error: ErrorBody


class GatewayError(Exception):
    status: int = 500
    ws_close_code: int = 4500
    default_code: str = "internal_error"
    grpc_code: str = "INTERNAL"
    """The gRPC status (a ``grpc.StatusCode`` name) of the gRPC service (gateway/apis/oip/grpc/)."""

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        field: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.field = field
        self.retry_after_s = retry_after_s

    def body(self) -> ErrorEnvelope:
        return ErrorEnvelope(ErrorBody(code=self.code, message=self.message, field=self.field))

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(self.retry_after_s)}


class ProtocolViolation(GatewayError):
    status = 400
    ws_close_code = 4400
    default_code = "protocol_violation"
    grpc_code = "INVALID_ARGUMENT"


class BadRequest(GatewayError):
    status = 422
    ws_close_code = 4422
    default_code = "invalid_request"
    grpc_code = "INVALID_ARGUMENT"


class PayloadTooLarge(GatewayError):
    status = 413
    ws_close_code = 4413
    default_code = "too_large"
    grpc_code = "RESOURCE_EXHAUSTED"


class Unauthorized(GatewayError):
    status = 401
    ws_close_code = 4401
    default_code = "unauthorized"
    grpc_code = "UNAUTHENTICATED"


class Forbidden(GatewayError):
    status = 403
    ws_close_code = 4403
    default_code = "forbidden"
    grpc_code = "PERMISSION_DENIED"


class NotFound(GatewayError):
    status = 404
    ws_close_code = 4404
    default_code = "not_found"
    grpc_code = "NOT_FOUND"


class Conflict(GatewayError):
    status = 409
    ws_close_code = 4409
    default_code = "busy"
    grpc_code = "ABORTED"


class Overloaded(GatewayError):
    status = 429
    ws_close_code = 4429
    default_code = "overloaded"
    grpc_code = "RESOURCE_EXHAUSTED"


class RateLimited(Overloaded):
    """A key at one of its limits (gateway/tenants/limits.py): the message names the limit,
    its value and when it admits again; ``Retry-After`` says it too, and the response's
    ``x-ratelimit-*`` headers the key's counts (written where it starts, like every one of
    the key's responses: gateway/server/middleware.py)."""

    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, *, limit: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.limit = limit
        """Its name in a key's limits (``requests_per_minute``, ...)."""


class BadEngineOutput(GatewayError):
    status = 502
    default_code = "bad_engine_output"
    grpc_code = "INTERNAL"


AGAIN_AFTER_S = 1
"""``Retry-After`` (a WebSocket frame's ``retry_after_s``) of a refusal that clears by
itself soon: Redis away, a gateway shutting down, a generation a worker or Redis lost, a
session still busy with its last turn (there a hint only: a reply may run for minutes, and
a client following the session's stream knows exactly when it ends)."""


class Unavailable(GatewayError):
    status = 503
    ws_close_code = 4503
    default_code = "unavailable"
    grpc_code = "UNAVAILABLE"


class ShuttingDown(Unavailable):
    """The gateway is draining and this request outlasted it: another replica takes it."""

    default_code = "shutting_down"


class Gone(GatewayError):
    status = 410
    ws_close_code = 4410
    default_code = "gone"
    grpc_code = "DATA_LOSS"


class EventsExpired(Gone):
    """Events after the reader's last id were trimmed (``TOKENSPOUT_EVENTS_MAXLEN``)."""

    default_code = "events_expired"


class EventsLost(Gone):
    """A resume point past the stream's last event, or one it no longer holds: Redis lost
    the events after that one (a restart without them, a failover), or the id is none of
    this stream's. A reader
    that waited after it would wait for ever (later events sort before it): it is told,
    and starts over from the stream's beginning."""

    default_code = "events_lost"

    def __init__(
        self, given: str, last: str | None, *, field: str = "last_event_id", missing: bool = False
    ) -> None:
        """``missing``: ``given`` is within the stream but none of its events (Redis lost
        that one, and wrote others since), not ahead of it."""
        last_known = f"its last event is {last}" if last else "it has no event"
        where = "is no event of this stream" if missing else "is ahead of this stream"
        super().__init__(
            f"{field} {given} {where} ({last_known}): Redis lost the events after that one, "
            f"or it is not from this stream; start over from the beginning (leave {field} out)",
            field=field,
        )
        self.given = given


class SessionLost(Gone):
    """The session's keys vanished while a reader was attached (Redis lost its data)."""

    default_code = "session_lost"


class FrameworkError(GatewayError):
    """An HTTP error Litestar raised itself, at its own status and with its headers."""

    def __init__(self, exc: HTTPException) -> None:
        code = "method_not_allowed" if exc.status_code == 405 else "http_error"
        super().__init__(str(exc.detail), code=code)
        self.status = exc.status_code
        self._headers = dict(exc.headers or {})

    def headers(self) -> dict[str, str]:
        return self._headers


def keys_not_loaded() -> Unavailable:
    """A key (or a session's) the gateway cannot judge yet: it has not read the run-time keys
    since it started (Redis did not answer)."""
    return Unavailable(
        "the API keys are not loaded yet (Redis has not answered since the gateway "
        "started); try again",
        code="keys_not_loaded",
        retry_after_s=AGAIN_AFTER_S,
    )


def bad_event_id(given: str, field: str = "last_event_id") -> BadRequest:
    return BadRequest(
        f"{field} {given[:64]!r} is not an event id: an event id is the `id:` of one of this "
        "stream's events, `<milliseconds>-<sequence>` (two whole numbers below 2^64, as "
        "1795319999764-0); leave it out (or send 0) to read from the beginning",
        code="bad_event_id",
        field=field,
    )


HANDLED = (GatewayError, ValidationException, HTTPException, RedisError, RecursionError, Exception)
"""The exception types the app and each adapter router hand to ``request_error``.
``Exception`` last: anything unexpected is logged with its traceback and answered in the
gateway's format (Litestar's own answer, a bare 500, would go unlogged: the app leaves
logging to the gateway)."""


def over_body_limit(what: str, limit: int) -> str:
    """What was too large, the limit and its setting (bodies, frames, gRPC messages)."""
    kib = f" ({limit // 1024} KiB)" if limit % 1024 == 0 else ""
    return f"{what} is over the limit of {limit} bytes{kib}, set by TOKENSPOUT_MAX_BODY_BYTES"


def body_too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(over_body_limit("the request body", limit), code="too_large")


def not_json(data: bytes, what: str = "the body") -> BadRequest:
    """``invalid_json``: what is wrong with ``data`` as JSON, and where (line, column and
    byte offset)."""
    try:
        data.decode()
    except UnicodeDecodeError as exc:
        return BadRequest(
            f"{what} is not valid JSON: {_where(data, exc.start, 'it is not UTF-8')}",
            code="invalid_json",
        )
    try:
        msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        malformed = MALFORMED_AT.fullmatch(str(exc))
        if malformed is not None:
            reason, at = malformed.group(1), int(malformed.group(2))
        elif data.strip():
            reason, at = "it ends before the JSON value does", len(data)
        else:
            reason, at = "it is empty", len(data)
        return BadRequest(
            f"{what} is not valid JSON: {_where(data, at, reason)}", code="invalid_json"
        )
    return BadRequest(f"{what} is not a JSON object", code="invalid_json")


def _where(data: bytes, at: int, reason: str) -> str:
    before = data[:at]
    line_start = before.rfind(b"\n") + 1
    line = before.count(b"\n") + 1
    column = len(before[line_start:].decode(errors="replace")) + 1
    return f"{reason}, at line {line}, column {column} (byte {at})"


def is_json_syntax_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from: Litestar wraps msgspec's error) says a
    body is not JSON at all, as opposed to JSON of the wrong shape."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, UnicodeDecodeError):
            return True
        if isinstance(seen, msgspec.DecodeError) and not isinstance(seen, msgspec.ValidationError):
            return str(seen).startswith(("Input data was truncated", "JSON is malformed"))
        seen = seen.__cause__
    return False


def request_error(request: AnyRequest, exc: Exception) -> GatewayError:
    """``as_gateway_error`` for an exception handler, which has the request: a body over
    the limit is told the limit and its setting, one that is not JSON where it breaks."""
    if isinstance(exc, HTTPException) and exc.status_code == 413:
        limit = request.route_handler.resolve_request_max_body_size()
        if limit:
            return body_too_large(limit)
    if is_json_syntax_error(exc):
        body = ScopeState.from_scope(request.scope).body
        if isinstance(body, bytes):
            return not_json(body)
    return as_gateway_error(exc)


def as_gateway_error(exc: Exception) -> GatewayError:
    """Any exception a request can end with, as one of the gateway's own errors."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, ValidationException):
        details = exc.extra if isinstance(exc.extra, list) else []
        first = details[0] if details and isinstance(details[0], dict) else {}
        message = str(first.get("message") or exc.detail)
        named = UNKNOWN_FIELD.search(message) or MISSING_FIELD.search(message)
        field = named.group(1) if named else first.get("key") or None
        if field == BODY_KEY:  # the body itself is not the object the route takes
            return BadRequest(f"the body must be a JSON object of the request's fields: {message}")
        if field and field not in message:
            message = f"{field}: {message}"
        return BadRequest(message, field=field)
    if isinstance(exc, UnicodeDecodeError):
        return BadRequest(
            f"the body is not valid JSON: it is not UTF-8 ({exc.reason})", code="invalid_json"
        )
    if isinstance(exc, HTTPException):
        if exc.status_code in (400, 422):
            return BadRequest(str(exc.detail))
        if exc.status_code == 413:
            return PayloadTooLarge(str(exc.detail))
        if exc.status_code == 404:
            return NotFound(str(exc.detail))
        return FrameworkError(exc)
    if isinstance(exc, RecursionError):
        # Litestar decodes JSON bodies before validating them; absurd nesting ends up here.
        return BadRequest("the JSON body is nested too deeply", code="too_deep")
    if isinstance(exc, RedisError):
        log.warning("redis error while handling a request: %s", exc)
        return Unavailable("Redis is unavailable; try again", retry_after_s=AGAIN_AFTER_S)
    log.exception("unexpected error while handling a request", exc_info=exc)
    return GatewayError(f"internal error: {type(exc).__name__}")


async def ending_with_error(
    chunks: AsyncIterator[bytes], error_frames: Callable[[GatewayError], bytes]
) -> AsyncIterator[bytes]:
    """A streamed answer whose failures end it in the adapter's own error format.

    Once the headers are out, an exception can no longer become an error response: left
    alone it would cut the stream off with no error and no end marker, which clients read
    as a network fault. A cancelled task (client gone) is no ``Exception`` and passes."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as exc:
        error = as_gateway_error(exc)
        log.warning("a streamed answer ended early: %s (%s)", error.message, error.code)
        yield error_frames(error)
