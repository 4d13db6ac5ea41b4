"""Who a request (or WebSocket connection, or gRPC call) is for, and what its admission
found: one ``Caller`` per request, passed along, never looked up.

The outermost ASGI layer (gateway/server/middleware.py) makes one per request and keeps it
in the request's scope (``caller_of``); the key check of each transport names its tenant
(gateway/core/auth.py, the hot routes, the WebSocket, the gRPC service, which makes one per
call); an API puts it on the ask it builds (``GenerationAsk.caller``), so the admission
knows whom the ask serves and leaves the key's ``Quota`` on it; the outermost layer writes
the quota's headers where the response starts.
"""

from __future__ import annotations

from litestar.types import HTTPScope, WebSocketScope

from gateway.tenants.limits import Quota
from gateway.tenants.records import ANONYMOUS, Tenant

CALLER = "tokenspout.caller"
"""Where a request's scope keeps its caller (in its ``state``, as Litestar reads it)."""


class Caller:
    __slots__ = ("quota", "tenant")

    def __init__(self, tenant: Tenant = ANONYMOUS) -> None:
        self.tenant = tenant
        """Whom it serves: the anonymous tenant until a key check says otherwise."""
        self.quota: Quota | None = None
        """The key's counts after this request's admission (None: no limits, or none yet)."""

    def headers(self) -> list[tuple[str, str]]:
        return self.quota.headers() if self.quota is not None else []


def caller_of(scope: HTTPScope | WebSocketScope) -> Caller:
    """The caller of the request whose ASGI scope is ``scope`` (one made now if none was:
    a request that entered below the outermost layer, as in-process tests do)."""
    state = scope.setdefault("state", {})
    caller = state.get(CALLER)
    if not isinstance(caller, Caller):
        caller = state[CALLER] = Caller()
    return caller
