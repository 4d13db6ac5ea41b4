"""Hostile input: hypothesis strategies for any JSON value a client might send, and what
an error answer to bad input must say."""

from __future__ import annotations

import httpx
from hypothesis import strategies as st

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=12,
)


def error_of(response: httpx.Response) -> tuple[str, str | None, str | None]:
    """An error answer in any of the gateway's formats: its message, the field it names
    (``field``, OpenAI's ``param``) and its code (TGI's ``error_type``; OIP has none)."""
    assert response.headers["content-type"].startswith("application/json"), response.text
    body = response.json()
    error = body["error"]
    if isinstance(error, dict):  # the session API's and OpenAI's
        return error["message"], error.get("field") or error.get("param"), error.get("code")
    return error, None, body.get("error_type")


WHAT_TO_FIX = {
    "too_large": "TOKENSPOUT_MAX_BODY_BYTES",
    "frame_too_large": "TOKENSPOUT_MAX_BODY_BYTES",
    "invalid_json": ", column ",
    "too_deep": "nested",
    "invalid_request": "the body must be a JSON object",
    "generation_running": "still running",
    "unknown_session": "POST /v1/sessions",
    "bad_session_token": "token",
    "history_full": "TOKENSPOUT_MAX_HISTORY_MESSAGES",
    "overloaded": "TOKENSPOUT_MAX_INFLIGHT",
}
"""What the message of an error that names no field must say: the limit's setting, where
the body breaks, or what to do."""


def names_the_fix(response: httpx.Response, *names: str) -> None:
    """A 4xx whose message says what to change: each of ``names`` (a field as the client
    sent it, a limit, a setting); the field it names, if any; else what ``WHAT_TO_FIX``
    asks of its code."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    message, field, code = error_of(response)
    for name in names:
        assert name in message, (name, message)
    if field is not None:
        assert field in message, (field, message)
    elif not names:
        assert code in WHAT_TO_FIX, f"a {code} error names no field: {message!r}"
        assert WHAT_TO_FIX[code] in message, (code, message)
