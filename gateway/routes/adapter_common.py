"""What the OpenAI, TGI and OIP adapters share besides the generation stream: the API key
check, and every error of a request reduced to one ``GatewayError`` that each adapter then
spells in its own clients' error format."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

from litestar.connection import Request
from litestar.exceptions import HTTPException, ValidationException
from redis.exceptions import RedisError

from gateway.errors import (
    BadRequest,
    GatewayError,
    NotFound,
    PayloadTooLarge,
    Unavailable,
)

log = logging.getLogger("tokenspout.adapters")
AnyRequest = Request[Any, Any, Any]
UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`")


def as_gateway_error(exc: Exception) -> GatewayError:
    """Any exception a request can end with, as one of the gateway's own errors."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, ValidationException):
        details = exc.extra if isinstance(exc.extra, list) else []
        first = details[0] if details and isinstance(details[0], dict) else {}
        message = str(first.get("message") or exc.detail)
        unknown = UNKNOWN_FIELD.search(message)
        field = unknown.group(1) if unknown else first.get("key") or None
        return BadRequest(message, field=field)
    if isinstance(exc, HTTPException):
        if exc.status_code == 413:
            return PayloadTooLarge(str(exc.detail))
        if exc.status_code == 404:
            return NotFound(str(exc.detail))
        if exc.status_code < 500:
            return BadRequest(str(exc.detail))
        return Unavailable(str(exc.detail))
    if isinstance(exc, RecursionError):
        # Litestar decodes JSON bodies before validating them; absurd nesting ends up here.
        return BadRequest("the JSON body is nested too deeply", code="too_deep")
    if isinstance(exc, RedisError):
        log.warning("redis error while handling an API request: %s", exc)
        return Unavailable("Redis is unavailable; try again", retry_after_s=1)
    log.exception("unexpected error in an API adapter", exc_info=exc)
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


HANDLED = (GatewayError, ValidationException, HTTPException, RedisError, RecursionError)
"""The exception types each adapter router maps to its own error format."""
