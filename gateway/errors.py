"""The gateway's errors, and the one table that maps them to HTTP and WebSocket.

GatewayError
 ├── ProtocolViolation     400  a WebSocket client broke the protocol past a limit (4400)
 ├── BadRequest            422  a field is wrong (names the field)
 ├── PayloadTooLarge       413  body or message over its limit
 ├── Unauthorized          401  API key missing or wrong
 ├── Forbidden             403  session token missing or wrong
 ├── NotFound              404  unknown session or generation
 ├── Conflict              409  the session is already generating
 ├── Overloaded            429  too many generations in flight (Retry-After)
 ├── BadEngineOutput       502  the engine sent what it must not (no logprobs when asked)
 └── Unavailable           503  Redis unreachable or no engine can take work

Every error body is ``{"error": {"code": ..., "message": ..., "field": ...}}``; the
OpenAI and TGI adapters reshape it into their own clients' error formats.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec


class ErrorBody(msgspec.Struct, omit_defaults=True):
    code: str
    message: str
    field: str | None = None


class ErrorEnvelope(msgspec.Struct):
    error: ErrorBody


class GatewayError(Exception):
    status: ClassVar[int] = 500
    ws_close_code: ClassVar[int] = 4500
    default_code: ClassVar[str] = "internal_error"

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


class BadRequest(GatewayError):
    status = 422
    ws_close_code = 4422
    default_code = "invalid_request"


class PayloadTooLarge(GatewayError):
    status = 413
    ws_close_code = 4413
    default_code = "too_large"


class Unauthorized(GatewayError):
    status = 401
    ws_close_code = 4401
    default_code = "unauthorized"


class Forbidden(GatewayError):
    status = 403
    ws_close_code = 4403
    default_code = "forbidden"


class NotFound(GatewayError):
    status = 404
    ws_close_code = 4404
    default_code = "not_found"


class Conflict(GatewayError):
    status = 409
    ws_close_code = 4409
    default_code = "busy"


class Overloaded(GatewayError):
    status = 429
    ws_close_code = 4429
    default_code = "overloaded"


class BadEngineOutput(GatewayError):
    status = 502
    default_code = "bad_engine_output"


class Unavailable(GatewayError):
    status = 503
    ws_close_code = 4503
    default_code = "unavailable"
