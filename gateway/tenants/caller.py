"""Who the request being served is for, and what its admission found: one value per
request (or WebSocket connection, or gRPC call), in a context variable.

The key check of each transport sets the tenant (``serve``: gateway/core/auth.py, the hot
routes, the WebSocket, the gRPC service); the sessions store reads it when it makes a
session or queues a one-shot generation, and leaves the key's ``Quota`` on it; the
outermost ASGI layer (gateway/server/middleware.py) makes a fresh one per request and
writes the quota's headers where the response starts. So no handler passes a tenant along
or adds a header: an API's code does not change for tenants.
"""

from __future__ import annotations

from contextvars import ContextVar

from gateway.tenants.limits import Quota
from gateway.tenants.records import ANONYMOUS, Tenant


class Caller:
    __slots__ = ("quota", "tenant")

    def __init__(self, tenant: Tenant = ANONYMOUS) -> None:
        self.tenant = tenant
        self.quota: Quota | None = None
        """The key's counts after this request's admission (None: no limits, or none yet)."""

    def headers(self) -> list[tuple[str, str]]:
        return self.quota.headers() if self.quota is not None else []


_CALLER: ContextVar[Caller | None] = ContextVar("tokenspout_caller", default=None)


def begin() -> Caller:
    """A fresh caller for a request starting in this context (the anonymous tenant until a
    key check says otherwise)."""
    caller = Caller()
    _CALLER.set(caller)
    return caller


def current() -> Caller:
    """The caller of the request being served (one made now if none was begun: a request
    that entered below the outermost layer, as in-process tests do)."""
    caller = _CALLER.get()
    return caller if caller is not None else begin()


def serve(tenant: Tenant) -> Caller:
    """The request being served is for ``tenant``."""
    caller = current()
    caller.tenant = tenant
    return caller
