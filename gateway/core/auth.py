"""API keys: who a request serves (its tenant), checked in memory, never logged.

The keys are the ones made at run time (``/v1/admin/keys``, ``python -m gateway keys``)
and those of ``TOKENSPOUT_API_KEYS`` / ``TOKENSPOUT_API_KEYS_FILE`` (read once at
start-up); every gateway process keeps them in memory (gateway/tenants/directory.py). A
key is required once a static key or ``TOKENSPOUT_ADMIN_KEY`` is configured; then the API
endpoints (OpenAI, TGI, OIP) and the creation of a session (``POST /v1/sessions``, a
WebSocket ``generate`` without ``session_id``) want one; a session's own endpoints want
only its token, which only a key holder was given, and its turns serve the key that made
it. Without a required key, a request serves the key it shows, else ``anonymous``.

An HTTP router or handler that wants a key says so once, with
``before_request=api_key_check``; a WebSocket one with ``guards=[api_key_guard]``. Either
check runs before the request's body (or the socket's first frame) is read, and names the
key's tenant on the request's caller (gateway/tenants/caller.py).
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from litestar.connection import ASGIConnection, Request
from litestar.handlers import BaseRouteHandler

from gateway.core.errors import Forbidden, Unauthorized, keys_not_loaded
from gateway.core.settings import Settings, env_name
from gateway.tenants.caller import Caller, caller_of
from gateway.tenants.directory import TenantDirectory
from gateway.tenants.records import ANONYMOUS, Tenant
from wire import Keys


class ConfigError(Exception):
    """A setting the gateway cannot start with; the message names the variable."""


class ApiKeys:
    """The key check every transport makes, over the process's ``TenantDirectory``
    (``repr`` shows how many keys, never which)."""

    def __init__(self, directory: TenantDirectory, admin_key: str = "") -> None:
        self.directory = directory
        self._admin = admin_key.encode()

    @property
    def required(self) -> bool:
        return self.directory.required

    def __repr__(self) -> str:
        return f"ApiKeys({self.directory!r})"

    def tenant(self, given: str | None) -> Tenant | None:
        """The tenant ``given`` (a key, or None) serves; None when it is refused (or cannot
        be told yet: no anonymous service for a key whose limits are not known)."""
        found = self.directory.find(given)
        if isinstance(found, Tenant):
            return found
        return None if self.required or found == "unloaded" else ANONYMOUS

    def serve(self, caller: Caller, given: str | None) -> bool:
        """``caller`` serves ``given``'s tenant, unless it is refused (False)."""
        tenant = self.tenant(given)
        if tenant is None:
            return False
        caller.tenant = tenant
        return True

    def require(self, caller: Caller, given: str | None) -> None:
        """``serve``, or 401 when ``given`` is refused; 503 while the keys are not loaded
        yet."""
        if self.serve(caller, given):
            return
        miss = self.directory.find(given)
        if miss == "unloaded":
            raise keys_not_loaded()
        raise Unauthorized(
            "this API key was revoked"
            if miss == "revoked"
            else "a valid API key is required (Authorization: Bearer <key>)",
            code="invalid_api_key",
        )

    def require_admin(self, given: str | None) -> None:
        """403 while no admin key is configured, 401 unless ``given`` is it (compared in
        constant time)."""
        if not self._admin:
            raise Forbidden(
                f"the admin API is off: set {env_name('admin_key')} to use it",
                code="admin_api_off",
            )
        if not hmac.compare_digest((given or "").encode(), self._admin):
            raise Unauthorized(
                f"the admin key ({env_name('admin_key')}) is required "
                "(Authorization: Bearer <admin key>)",
                code="invalid_admin_key",
            )


def tenant_directory(redis: aioredis.Redis, settings: Settings) -> TenantDirectory:
    """The process's keys: the static ones read now (ConfigError for a key file that is
    missing, unreadable or empty), the run-time ones loaded from Redis by the lifespan."""
    static = {key.strip() for key in settings.api_keys.split(",") if key.strip()}
    if settings.api_keys_file:
        static |= read_key_file(settings.api_keys_file)
    required = bool(static) or bool(settings.admin_key)
    return TenantDirectory(redis, Keys(settings.key_prefix), frozenset(static), required=required)


def require_api_key(connection: ASGIConnection[Any, Any, Any, Any], api_keys: ApiKeys) -> None:
    """401 unless ``Authorization: Bearer <key>`` names a key (none required: its tenant,
    or anonymous)."""
    api_keys.require(caller_of(connection.scope), bearer(connection.headers.get("authorization")))


API_KEYS_STATE = "api_keys"
"""Where ``create_app`` keeps the app's ``ApiKeys`` in its state, for ``api_key_guard``."""


async def api_key_check(request: Request[Any, Any, Any]) -> None:
    """A Litestar ``before_request`` hook: ``require_api_key`` with the app's keys. Not a
    guard on HTTP routes: Litestar hands each guard a copy of its route handler, a shallow
    copy of a large object on every request (3 % of the gateway's CPU per one-shot
    request, docs/bench.md: bench.requests); the hook gets the request alone, and
    runs before the body is read as well. A coroutine function, though it awaits nothing:
    Litestar runs a plain function hook in a worker thread, a hop there and back."""
    require_api_key(request, _app_keys(request))


async def api_key_guard(
    connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler
) -> None:
    """``api_key_check`` as a Litestar guard, for WebSocket routes (which have no
    ``before_request``): once per connection. A coroutine function for the same reason."""
    require_api_key(connection, _app_keys(connection))


async def admin_key_check(request: Request[Any, Any, Any]) -> None:
    """``api_key_check`` for the admin API: the admin key (``TOKENSPOUT_ADMIN_KEY``)."""
    _app_keys(request).require_admin(bearer(request.headers.get("authorization")))


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
