"""The keys made at run time, in Redis: make, list, show, change, revoke; and their usage.

One store for the admin API (gateway/apis/admin/routes.py) and the CLI (gateway/apis/admin/cli.py).
Every change writes the key's record and bumps the version in one transaction on the keys'
slot; every gateway process reads the version every 250 ms and reloads the records when it
moved (gateway/tenants/directory.py), so a change is in force everywhere within a second.
"""

from __future__ import annotations

import logging
import secrets
import time

import msgspec
import redis.asyncio as aioredis

from gateway.tenants.records import (
    KEY_ID_PREFIX,
    SECRET_PREFIX,
    KeyChange,
    KeyRecord,
    NewKey,
    digest,
)
from wire import Keys
from wire.replies import text
from wire.tenancy import Granularity, UsagePeriod, read_usage

log = logging.getLogger("tokenspout.tenants")
_record_decoder = msgspec.json.Decoder(KeyRecord)


class TenantsError(Exception):
    """A request of the keys store that cannot be done; the message says why (and
    ``field`` names the parameter at fault, when one is)."""

    code = "invalid_request"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class UnknownKey(TenantsError):
    code = "unknown_key"

    def __init__(self, key_id: str) -> None:
        super().__init__(f"no key {key_id!r} (list them: GET /v1/admin/keys)")


class KeyRevoked(TenantsError):
    code = "key_revoked"

    def __init__(self, key_id: str, *, again: bool = False) -> None:
        what = "revoked already" if again else "revoked: it can no longer be changed"
        super().__init__(f"key {key_id!r} is {what} (make a new one: POST /v1/admin/keys)")


class KeyStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def create(self, new: NewKey) -> tuple[KeyRecord, str]:
        """A new key and its secret (shown this once: Redis keeps its digest only)."""
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        now = time.time()
        record = KeyRecord(
            id=KEY_ID_PREFIX + secrets.token_hex(8),
            name=new.name,
            digest=digest(secret),
            hint=f"{secret[:8]}…{secret[-4:]}",
            models=list(new.models),
            weight=new.weight,
            limits=new.limits,
            created=now,
            changed=now,
        )
        await self._write(record)
        return record, secret

    async def all(self) -> list[KeyRecord]:
        """Every key, revoked ones too, by name."""
        _, records = await self.records_at()
        return sorted(records, key=lambda record: (record.name, record.id))

    async def get(self, key_id: str) -> KeyRecord:
        raw = await self.redis.hget(self.keys.tenant_records, key_id)
        if raw is None:
            raise UnknownKey(key_id)
        return _record_decoder.decode(raw)

    async def update(self, key_id: str, change: KeyChange) -> KeyRecord:
        """The key with ``change`` applied. Two changes of one key at once: the last wins."""
        record = await self.get(key_id)
        if record.revoked is not None:
            raise KeyRevoked(key_id)
        changed = change.applied(record, time.time())
        await self._write(changed)
        return changed

    async def revoke(self, key_id: str) -> KeyRecord:
        """Revoke it (``KeyRevoked`` again, as for any change of a revoked key). Its record
        stays, for its usage."""
        record = await self.get(key_id)
        if record.revoked is not None:
            raise KeyRevoked(key_id, again=True)
        now = time.time()
        revoked = msgspec.structs.replace(record, revoked=now, changed=now)
        await self._write(revoked)
        return revoked

    async def version(self) -> int:
        """The version every change bumps (0: no key was ever made)."""
        return int(await self.redis.get(self.keys.tenant_version) or 0)

    async def records_at(self) -> tuple[int, list[KeyRecord]]:
        """The version and the records, read in one transaction (they match). A record
        that cannot be read (written by hand?) is logged and left out."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.get(self.keys.tenant_version)
            pipe.hgetall(self.keys.tenant_records)
            version, raw = await pipe.execute()
        records = []
        for key_id, value in raw.items():
            try:
                records.append(_record_decoder.decode(value))
            except msgspec.DecodeError as exc:
                log.error("key %s: its record cannot be read (%s); left out", text(key_id), exc)
        return int(text(version)) if version else 0, records

    async def usage(
        self, tenant_id: str, granularity: Granularity, start_s: int, end_s: int
    ) -> list[UsagePeriod]:
        """A tenant's usage per UTC hour or day over [``start_s``, ``end_s``)."""
        return await read_usage(self.redis, self.keys, tenant_id, granularity, start_s, end_s)

    async def _write(self, record: KeyRecord) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.tenant_records, record.id, msgspec.json.encode(record))
            pipe.incr(self.keys.tenant_version)
            await pipe.execute()
