"""API keys: read once at start-up, compared in constant time, never logged.

With no key configured every endpoint is open. With keys, the API endpoints (OpenAI, TGI,
OIP) and the creation of a session (``POST /v1/sessions``, a WebSocket ``generate`` without
``session_id``) want one; a session's own endpoints want only its token, which only a key
holder was given.

An HTTP router or handler that wants a key says so once, with
``before_request=api_key_check``; a WebSocket one with ``guards=[api_key_guard]``. Either
check runs before the request's body (or the socket's first frame) is read.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any

from litestar.connection import ASGIConnection, Request
from litestar.handlers import BaseRouteHandler

from gateway.core.errors import Unauthorized
from gateway.core.settings import Settings, env_name


class ConfigError(Exception):
    """A setting the gateway cannot start with; the message names the variable."""


class ApiKeys:
    """The configured keys (``repr`` shows how many, never which)."""

    def __init__(self, keys: frozenset[str]) -> None:
        self._keys = tuple(key.encode() for key in sorted(keys))

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiKeys:
        keys = {key.strip() for key in settings.api_keys.split(",") if key.strip()}
        if settings.api_keys_file:
            keys |= read_key_file(settings.api_keys_file)
        return cls(frozenset(keys))

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._keys)} keys)"

    def valid(self, given: str | None) -> bool:
        """True when no key is configured, or ``given`` is one of the keys."""
        if not self._keys:
            return True
        candidate = (given or "").encode()
        # Compare with every key (no early exit), so timing tells nothing about which matched.
        matches = [hmac.compare_digest(candidate, key) for key in self._keys]
        return bool(given) and any(matches)

    def require(self, given: str | None) -> None:
        if not self.valid(given):
            raise Unauthorized(
                "a valid API key is required (Authorization: Bearer <key>)",
                code="invalid_api_key",
            )


def require_api_key(connection: ASGIConnection[Any, Any, Any, Any], api_keys: ApiKeys) -> None:
    """401 unless ``Authorization: Bearer <key>`` names a configured key (none configured:
    open)."""
    api_keys.require(bearer(connection.headers.get("authorization")))


API_KEYS_STATE = "api_keys"
"""Where ``create_app`` keeps the app's ``ApiKeys`` in its state, for ``api_key_guard``."""


async def api_key_check(request: Request[Any, Any, Any]) -> None:
    """A Litestar ``before_request`` hook: ``require_api_key`` with the app's keys. Not a
    guard on HTTP routes: Litestar hands each guard a copy of its route handler, a shallow
    copy of a large object on every request (3 % of the gateway's CPU per one-shot
    request, docs/bench.md "What a request costs"); the hook gets the request alone, and
    runs before the body is read as well. A coroutine function, though it awaits nothing:
    Litestar runs a plain function hook in a worker thread, a hop there and back."""
    require_api_key(request, _app_keys(request))


async def api_key_guard(
    connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler
) -> None:
    """``api_key_check`` as a Litestar guard, for WebSocket routes (which have no
    ``before_request``): once per connection. A coroutine function for the same reason."""
    require_api_key(connection, _app_keys(connection))


def _app_keys(connection: ASGIConnection[Any, Any, Any, Any]) -> ApiKeys:
    api_keys = connection.app.state.get(API_KEYS_STATE)
    if not isinstance(api_keys, ApiKeys):
        raise TypeError(f"the app's state holds no ApiKeys under {API_KEYS_STATE!r}")
    return api_keys


def bearer(authorization: str | None) -> str | None:
    """The credential of an ``Authorization: Bearer <credential>`` header."""
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip() or None
    return None


def read_key_file(path: str) -> set[str]:
    """One key per line; blank lines and lines starting with ``#`` are skipped."""
    variable = env_name("api_keys_file")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{variable}={path}: cannot read the key file ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{variable}={path}: the key file is not UTF-8 text") from None
    keys = {line.strip() for line in text.splitlines()}
    keys = {key for key in keys if key and not key.startswith("#")}
    if not keys:
        raise ConfigError(f"{variable}={path}: the key file holds no key")
    return keys
