"""What the admin API answers and the CLI prints, written once for both: a key as shown
(never its secret or digest, but at its making), and a tenant's usage over a time range.
"""

from __future__ import annotations

import datetime as dt
import re
import time

import msgspec

from gateway.tenants.keystore import KeyStore, TenantsError
from gateway.tenants.records import KEY_ID_PREFIX, KeyRecord
from wire.limits import Limits
from wire.tenancy import DAY_S, HOUR_S, Granularity, UsagePeriod

MAX_PERIODS = 10_000
"""The most hours or days one usage answer holds."""
_AT_PATH = re.compile(r"(.*) - at `\$\.?(.*)`")


class KeyView(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A key as the admin API and the CLI show it (its secret only when it is made)."""

    id: str
    name: str
    hint: str
    """The secret's first characters and last four."""
    models: list[str]
    weight: float
    limits: Limits
    created_at: int
    changed_at: int
    revoked_at: int | None
    """When it was revoked (null: it is in force)."""
    key: str | None = None
    """The secret: only in the answer that made it. Keep it now; it is never shown again."""

    @classmethod
    def of(cls, record: KeyRecord, secret: str | None = None) -> KeyView:
        return cls(
            id=record.id,
            name=record.name,
            hint=record.hint,
            models=record.models,
            weight=record.weight,
            limits=record.limits,
            created_at=int(record.created),
            changed_at=int(record.changed),
            revoked_at=None if record.revoked is None else int(record.revoked),
            key=secret,
        )


class KeyList(msgspec.Struct, frozen=True):
    keys: list[KeyView]


def check_json_types(kind: type[msgspec.Struct], body: bytes) -> None:
    """``TenantsError`` naming the field unless ``body`` is ``kind`` in JSON's own types.

    Litestar decodes a body leniently, turning ``"2"`` into 2; the admin API's contract is
    that a wrong type is refused, so each body is checked again, strictly."""
    try:
        msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        found = _AT_PATH.fullmatch(str(exc))
        problem, field = (found[1], found[2]) if found else (str(exc), "")
        hint = " (send the value itself, not a string of it)" if "got `str`" in problem else ""
        raise TenantsError(f"{field or 'the body'}: {problem}{hint}", field or None) from None


class UsageRow(msgspec.Struct, frozen=True):
    start: str
    """The hour or day's first second, ISO 8601 in UTC."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    generations: int


class UsageReport(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    granularity: Granularity
    start: str
    end: str
    data: list[UsageRow]
    """Every hour or day of the range, oldest first (with no usage too)."""
    total: UsageRow
    """The range's sum (its ``start``: the range's)."""


def iso(unix_s: int) -> str:
    return dt.datetime.fromtimestamp(unix_s, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str, field: str) -> int:
    """Unix seconds from unix seconds or ISO 8601 (a date, or a date and time; UTC unless
    it says otherwise)."""
    text = value.strip()
    if text.isdigit():
        return int(text)
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise TenantsError(
            f"{field}: {value!r} is neither unix seconds nor ISO 8601 "
            "(2026-05-01 or 2026-05-01T10:00:00Z)",
            field,
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return int(when.timestamp())


def usage_window(
    granularity: str, start: str | None, end: str | None, now: float | None = None
) -> tuple[Granularity, int, int]:
    """The range a usage request asks for (default: the last day by hour, the last 30 days
    by day), checked: a known granularity, start before end, at most ``MAX_PERIODS``."""
    if granularity not in ("hour", "day"):
        raise TenantsError(
            f"granularity: {granularity!r} is neither 'hour' nor 'day'", "granularity"
        )
    period = HOUR_S if granularity == "hour" else DAY_S
    end_s = parse_time(end, "end") if end else int(now if now is not None else time.time())
    start_s = (
        parse_time(start, "start") if start else end_s - (DAY_S if period == HOUR_S else 30 * DAY_S)
    )
    if start_s >= end_s:
        raise TenantsError(f"start ({iso(start_s)}) must come before end ({iso(end_s)})", "start")
    if (end_s - start_s) // period > MAX_PERIODS:
        raise TenantsError(
            f"at most {MAX_PERIODS} {granularity}s in one answer; narrow the range", "start"
        )
    return ("hour" if granularity == "hour" else "day"), start_s, end_s


def _row(start: int, periods: list[UsagePeriod]) -> UsageRow:
    prompt = sum(p.prompt_tokens for p in periods)
    completion = sum(p.completion_tokens for p in periods)
    made = sum(p.generations for p in periods)
    return UsageRow(iso(start), prompt, completion, prompt + completion, made)


async def usage_report(
    store: KeyStore, tenant_id: str, granularity: str, start: str | None, end: str | None
) -> UsageReport:
    """A tenant's usage per hour or day (kept 45 and 400 days: ``wire.tenancy.USAGE_KEPT_S``);
    ``UnknownKey`` for the id of a key nobody made (a revoked one answers)."""
    kind, start_s, end_s = usage_window(granularity, start, end)
    if tenant_id.startswith(KEY_ID_PREFIX):
        await store.get(tenant_id)
    periods = await store.usage(tenant_id, kind, start_s, end_s)
    return UsageReport(
        key=tenant_id,
        granularity=kind,
        start=iso(start_s),
        end=iso(end_s),
        data=[_row(period.start, [period]) for period in periods],
        total=_row(start_s, periods),
    )
