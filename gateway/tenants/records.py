"""What a key is: its record in Redis (``KeyRecord``), what the admin API may change of it
(``KeyChange``), and the tenant a request resolves to (``Tenant``).

A key's secret is shown once, when it is made; Redis keeps only its SHA-256 digest.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated

import msgspec

from wire.keys import MODEL_NAME
from wire.limits import Limits

KEY_ID_PREFIX = "k_"
"""Every key made at run time has an id that starts so."""
SECRET_PREFIX = "tsk_"
"""Every secret made at run time starts so: a scanner (or a person) can tell what it is."""
ANONYMOUS_ID = "anonymous"
"""The tenant of every request while no key is required and none (or an unknown one) is
given."""
STATIC_PREFIX = "static-"
"""Ids of the keys of ``TOKENSPOUT_API_KEYS`` / ``_FILE``: ``static-`` and 16 hex digits of
the key's digest, the same on every replica and across restarts."""

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=100)]
ModelName = Annotated[str, msgspec.Meta(pattern=f"^{MODEL_NAME.pattern}$")]
"""A served model's name, whole (msgspec searches a pattern: anchored, a name with a space
or a brace, which no model can have, is refused rather than kept for ever unmatched)."""
Weight = Annotated[float, msgspec.Meta(gt=0, le=1_000)]
NO_LIMITS = Limits()


def digest(secret: str) -> str:
    """The SHA-256 digest of a key's secret, in hex: all Redis and memory keep of it."""
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A key made at run time, as Redis keeps it (``Keys.tenant_records``) and the admin API
    shows it (without its digest)."""

    id: str
    name: str
    digest: str
    hint: str
    """The secret's first characters and last four (``tsk_…a1B2``): which key it is."""
    models: list[str] = []
    """The models (names or aliases) it may use; empty: every model."""
    weight: float = 1.0
    """Its share of the engine against other keys waiting for the same model."""
    limits: Limits = Limits()
    created: float
    changed: float
    revoked: float | None = None


_Limit = Annotated[int, msgspec.Meta(ge=0, le=1_000_000_000_000)] | msgspec.UnsetType


class LimitsChange(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The limits an update changes (0: none); those left out stay as they are."""

    concurrent: _Limit = msgspec.UNSET
    requests_per_minute: _Limit = msgspec.UNSET
    tokens_per_minute: _Limit = msgspec.UNSET
    tokens_per_day: _Limit = msgspec.UNSET

    def applied(self, limits: Limits) -> Limits:
        return msgspec.structs.replace(limits, **_given(self))


class KeyChange(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What an update changes; fields left out stay as they are."""

    name: Name | msgspec.UnsetType = msgspec.UNSET
    models: list[ModelName] | msgspec.UnsetType = msgspec.UNSET
    """The whole list (``[]``: every model)."""
    weight: Weight | msgspec.UnsetType = msgspec.UNSET
    limits: LimitsChange | msgspec.UnsetType = msgspec.UNSET

    def applied(self, record: KeyRecord, now: float) -> KeyRecord:
        fields = _given(self)
        if isinstance(self.limits, LimitsChange):
            fields["limits"] = self.limits.applied(record.limits)
        return msgspec.structs.replace(record, **fields, changed=now)


def _given(change: msgspec.Struct) -> dict[str, object]:
    """The fields of a change that were given."""
    fields = {name: getattr(change, name) for name in change.__struct_fields__}
    return {name: value for name, value in fields.items() if value is not msgspec.UNSET}


class NewKey(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What making a key takes."""

    name: Name
    models: list[ModelName] = []
    weight: Weight = 1.0
    limits: Limits = Limits()


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a request serves and is billed to, as every gateway process knows it in memory."""

    id: str
    name: str
    models: frozenset[str] = frozenset()
    """Models it may use (names or aliases); empty: every model."""
    weight: float = 1.0
    limits: Limits = NO_LIMITS

    def may_use(self, asked: str, model: str) -> bool:
        """Whether it may use ``model``, asked for as ``asked`` (the name or an alias)."""
        return not self.models or asked in self.models or model in self.models


ANONYMOUS = Tenant(ANONYMOUS_ID, ANONYMOUS_ID)


def static_tenant(secret: str) -> Tenant:
    """A key of ``TOKENSPOUT_API_KEYS``: weight 1, no limits, every model."""
    tenant_id = STATIC_PREFIX + digest(secret)[:16]
    return Tenant(tenant_id, tenant_id)


def tenant_of(record: KeyRecord) -> Tenant:
    return Tenant(record.id, record.name, frozenset(record.models), record.weight, record.limits)
