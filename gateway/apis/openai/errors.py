"""Errors the way the ``openai`` SDK expects them: ``{"error": {"message", "type", "param",
"code"}}``, its ``type`` from the HTTP status (a 422 answers 400, as OpenAI's API does).
The Responses API and vLLM's tokenize routes answer in the same format."""

from __future__ import annotations

from litestar import Response

from gateway.apis.openai.schema import ErrorDetail, ErrorOut
from gateway.core.errors import AnyRequest, as_gateway_error, request_error

ERROR_TYPES = {401: "invalid_request_error", 429: "rate_limit_error"}


def error_body(exc: Exception) -> ErrorOut:
    """The error object OpenAI's API answers with (its ``type`` from the HTTP status)."""
    error = as_gateway_error(exc)
    status = 400 if error.status == 422 else error.status
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return ErrorOut(ErrorDetail(error.message, kind, error.field, error.code))


def error_answer(exc: Exception) -> tuple[int, ErrorOut, dict[str, str]]:
    """An error's answer in OpenAI's format: its status, body and headers."""
    error = as_gateway_error(exc)
    status = 400 if error.status == 422 else error.status
    return status, error_body(error), error.headers()


def openai_error(request: AnyRequest, exc: Exception) -> Response[ErrorOut]:
    status, body, headers = error_answer(request_error(request, exc))
    return Response(body, status_code=status, headers=headers)
