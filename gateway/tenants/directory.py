"""Every key a gateway process knows, in memory: a request finds its tenant with no round
trip to Redis.

The keys of ``TOKENSPOUT_API_KEYS`` (and ``_FILE``) are read at start-up; the keys made at
run time (gateway/tenants/keystore.py) are reloaded whenever the version in Redis moves,
read every ``REFRESH_S``: a new, changed or revoked key is in force on every replica within
a second of the change. Keys are looked up by the SHA-256 digest of what the client sent,
so no secret is kept in memory and the lookup's timing says nothing about any secret.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.tenants.keystore import KeyStore
from gateway.tenants.records import ANONYMOUS, KeyRecord, Tenant, digest, static_tenant, tenant_of
from wire import Keys

log = logging.getLogger("tokenspout.tenants")

REFRESH_S = 0.25
"""How often each gateway process reads the keys' version."""
LABELLED_KEYS = 100
"""Keys whose metrics carry their own name: the first ones by name; the rest: ``other``."""
Miss = Literal["missing", "unknown", "revoked", "unloaded"]
"""Why a request found no tenant: no key given, a key nobody made, a revoked one, or one
that is not a static key while the run-time keys are not loaded yet (Redis has not
answered since the process started)."""


class TenantDirectory:
    def __init__(
        self, redis: aioredis.Redis, keys: Keys, static: frozenset[str], *, required: bool
    ) -> None:
        """``static``: the keys of ``TOKENSPOUT_API_KEYS``; ``required``: every request
        needs a valid key (a static or an admin key is configured)."""
        self.store = KeyStore(redis, keys)
        self.required = required
        self.version = -1
        """The keys' version loaded (-1: none yet)."""
        self._static = {digest(secret): static_tenant(secret) for secret in static}
        self._by_digest: dict[str, Tenant] = dict(self._static)
        self._revoked: frozenset[str] = frozenset()
        self._by_id: dict[str, Tenant] = {t.id: t for t in (ANONYMOUS, *self._static.values())}
        self._labelled: frozenset[str] = frozenset(self._by_id)

    def __repr__(self) -> str:
        return f"TenantDirectory({len(self._by_digest)} keys, version {self.version})"

    @property
    def loaded(self) -> bool:
        """Whether the run-time keys were read since the process started."""
        return self.version >= 0

    def find(self, secret: str | None) -> Tenant | Miss:
        """The tenant of a key, or why there is none."""
        if not secret:
            return "missing"
        given = digest(secret)
        tenant = self._by_digest.get(given)
        if tenant is not None:
            return tenant
        if not self.loaded:
            return "unloaded"
        return "revoked" if given in self._revoked else "unknown"

    def by_id(self, tenant_id: str) -> Tenant | None:
        """A tenant by its id (a session's), None once its key is revoked (or gone)."""
        return self._by_id.get(tenant_id)

    def weight_of(self, tenant_id: str) -> float:
        """A tenant's weight in a model's fair share (one whose key is gone: 1)."""
        tenant = self.by_id(tenant_id)
        return tenant.weight if tenant is not None else 1.0

    def tenants(self) -> list[Tenant]:
        """Every tenant in force (revoked keys' are gone)."""
        return list(self._by_id.values())

    def label(self, tenant: Tenant) -> str:
        """Its name in the metrics: bounded, whatever the number of keys."""
        return tenant.name if tenant.id in self._labelled else "other"

    async def load(self) -> bool:
        """Read the version and reload the keys if it moved; whether they changed."""
        if await self.store.version() == self.version:
            return False
        version, records = await self.store.records_at()
        self._use(records)
        self.version = version
        return True

    def _use(self, records: list[KeyRecord]) -> None:
        live = [record for record in records if record.revoked is None]
        by_digest = {record.digest: tenant_of(record) for record in live}
        by_digest.update(self._static)  # a static key is always itself
        self._by_digest = by_digest
        self._revoked = frozenset(r.digest for r in records if r.revoked is not None)
        fixed = (ANONYMOUS, *self._static.values())
        self._by_id = {t.id: t for t in (*by_digest.values(), *fixed)}
        named = sorted(records, key=lambda record: (record.name, record.id))[:LABELLED_KEYS]
        self._labelled = frozenset([*(r.id for r in named), *(t.id for t in fixed)])

    async def first_load(self) -> None:
        """Load the keys before the process serves, when Redis answers; when it does not,
        the process serves without them (``refresh_forever`` loads them once it does)."""
        try:
            await self.load()
        except (RedisError, OSError) as exc:
            log.warning(
                "the run-time API keys are not loaded: Redis does not answer (%s); serving, "
                "with keys other than static ones told to try again until they load",
                exc,
            )

    async def refresh_forever(self, interval_s: float = REFRESH_S) -> None:
        """Load the keys whenever their version moves (until the first load, a key that is
        not a static one is told to try again: ``find``'s "unloaded")."""
        failing = False
        while True:
            await asyncio.sleep(interval_s)
            try:
                if await self.load():
                    log.info("keys reloaded", extra={"version": self.version})
                failing = False
            except (RedisError, OSError) as exc:
                if not failing:  # once per outage: the keys loaded before stay in force
                    log.warning("reading the keys failed (%s); retrying", exc)
                failing = True
            except Exception:
                log.exception("reading the keys failed; retrying")
