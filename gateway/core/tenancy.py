"""The core's door to tenants (gateway/tenants/): whom a generation serves, whether its key
may use the model, and its admission against the key's limits, in the gateway's errors.

The sessions store makes these calls and nothing else of tenants:

    tenant = gate.caller_tenant()              # a new session or one-shot request's
    tenant = gate.of_session(tenant_id)        # a session turn's: the key that made it
    gate.check_model(tenant, asked, model)     # 403 model_not_allowed
    admitted = await gate.admit(tenant, [gid], session_id=sid)  # 429, or the key's counts
    await gate.release(tenant, [gid])          # it was admitted, and not queued after all

or, on one Redis, a one-shot request's admission inside SUBMIT: ``in_submit`` gives the
limits it takes, ``settle`` reads its answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import redis.asyncio as aioredis

from gateway.core.errors import Forbidden, RateLimited, Unauthorized, keys_not_loaded
from gateway.tenants import caller
from gateway.tenants.directory import TenantDirectory
from gateway.tenants.limits import LimitReached, TenantLimits
from gateway.tenants.records import ANONYMOUS, Tenant
from wire import Keys
from wire.limits import Counts, Limits


class TenantObserver(Protocol):
    """Told of each admission and refusal, by key (gateway/server/metrics.py)."""

    def admitted(self, key: str) -> None: ...

    def refused(self, key: str, limit: str) -> None: ...


class TenantGate:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        directory: TenantDirectory,
        observer: TenantObserver | None = None,
    ) -> None:
        self.directory = directory
        self.observer = observer
        self.limits = TenantLimits(redis, keys)

    @staticmethod
    def caller_tenant() -> Tenant:
        """The tenant the request being served showed the key of (gateway/core/auth.py)."""
        return caller.current().tenant

    def of_session(self, tenant_id: str | None) -> Tenant:
        """The tenant a session's turns serve: the one that made it (401 once its key is
        revoked: a key holder's session tokens stop with the key; 503 while this process
        has not read the keys yet)."""
        if not tenant_id:
            return ANONYMOUS  # made by a gateway from before tenants
        tenant = self.directory.by_id(tenant_id)
        if tenant is None and not self.directory.loaded:
            raise keys_not_loaded()
        if tenant is None:
            raise Unauthorized(
                "the API key this session was made with was revoked", code="invalid_api_key"
            )
        return tenant

    def weight_of(self, tenant_id: str) -> float:
        """A tenant's weight in a model's fair share (one whose key is gone: 1)."""
        tenant = self.directory.by_id(tenant_id)
        return tenant.weight if tenant is not None else 1.0

    def check_model(self, tenant: Tenant, asked: str, model: str) -> None:
        """403 unless ``tenant`` may use ``model`` (asked for as ``asked``)."""
        if tenant.may_use(asked, model):
            return
        if self.observer is not None:
            self.observer.refused(self.directory.label(tenant), "models")
        allowed = ", ".join(sorted(tenant.models))
        raise Forbidden(
            f"key {tenant.name!r} may not use model {asked!r}; it may use: {allowed}",
            code="model_not_allowed",
            field="model",
        )

    async def admit(
        self,
        tenant: Tenant,
        generation_ids: Sequence[str],
        *,
        session_id: str,
        count_request: bool = True,
    ) -> bool:
        """Admit the generations, submitted to ``session_id`` next, against the key's
        limits in a round trip of their own (429 ``rate_limit_exceeded`` at one of them),
        the key's counts left for the response's headers. Whether anything was taken that
        ``release`` gives back (or, the gateway lost before its submit, the reaper:
        gateway/recovery/admissions.py)."""
        if not tenant.limits.any:
            self.settle(tenant, None, count_request=count_request)
            return False
        counts = await self.limits.counts(
            tenant, generation_ids, session_id=session_id, count_request=count_request
        )
        self.settle(tenant, counts, count_request=count_request)
        return True

    @staticmethod
    def in_submit(tenant: Tenant) -> Limits | None:
        """The limits SUBMIT admits with a one-shot request on one Redis (saving the round
        trip of ``admit``), then ``settle``d; None: the key has none."""
        return tenant.limits if tenant.limits.any else None

    def settle(self, tenant: Tenant, counts: Counts | None, *, count_request: bool) -> None:
        """What an admission found (``counts``; None: the key has no limits): the key's
        quota for the response's headers, its metrics, and 429 when it refused."""
        label = self.directory.label(tenant)
        try:
            quota = None if counts is None else self.limits.quota(tenant, counts)
        except LimitReached as refusal:
            caller.current().quota = refusal.quota
            if self.observer is not None:
                self.observer.refused(label, refusal.limit)
            raise RateLimited(
                str(refusal), limit=refusal.limit, retry_after_s=refusal.retry_after_s
            ) from None
        if count_request and self.observer is not None:
            self.observer.admitted(label)
        if quota is not None:
            caller.current().quota = quota

    async def release(
        self, tenant: Tenant, generation_ids: Sequence[str], *, count_request: bool = True
    ) -> None:
        await self.limits.release(tenant, generation_ids, count_request=count_request)

    def with_concurrency_limit(self) -> list[Tenant]:
        """The keys whose running generations are counted (a concurrent limit)."""
        return [tenant for tenant in self.directory.tenants() if tenant.limits.concurrent]
