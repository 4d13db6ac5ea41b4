"""A key's limits, as the scripts that admit its requests take them (wire/lua/admit_core.lua:
ADMIT on the key's slot, or SUBMIT on one Redis), and the counts they answer."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

RUNNING_HOLD_S = 3_600
"""The longest a generation counts as running for a concurrency limit: only a generation
whose final event never came (Redis lost it) is dropped by this."""

LimitName = Literal["concurrent", "requests", "tokens", "tokens_day"]
_Count = Annotated[int, msgspec.Meta(ge=0, le=1_000_000_000_000)]


class Limits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A key's limits; 0: none."""

    concurrent: _Count = 0
    """Generations queued or running at once."""
    requests_per_minute: _Count = 0
    """Requests admitted in any 60 s (a request with ``n`` choices is one)."""
    tokens_per_minute: _Count = 0
    """Prompt plus completion tokens of the generations that ended in the last 60 s."""
    tokens_per_day: _Count = 0
    """The same, per UTC day."""

    @property
    def any(self) -> bool:
        return bool(
            self.concurrent
            or self.requests_per_minute
            or self.tokens_per_minute
            or self.tokens_per_day
        )

    def of(self, limit: LimitName) -> int:
        """The value of one limit, by the name ADMIT gives it."""
        match limit:
            case "concurrent":
                return self.concurrent
            case "requests":
                return self.requests_per_minute
            case "tokens":
                return self.tokens_per_minute
        return self.tokens_per_day


class Counts(msgspec.Struct, frozen=True):
    """What ADMIT found (and took, when it admitted): a tenant's counts against its limits."""

    refused: LimitName | None
    """The limit that refused the request; None: admitted."""
    retry_after_ms: int
    """When the limit that refused admits again (0 when admitted)."""
    requests: int
    """Requests admitted in the last minute, this one included."""
    requests_reset_ms: int
    """Until every one of them has left the minute."""
    tokens: int
    """Tokens of the last minute."""
    tokens_reset_ms: int
    tokens_today: int
    day_reset_ms: int
    """Until the UTC day ends."""
    running: int
    """Generations queued or running, these included (counted with a concurrency limit)."""


USAGE_COUNTS_ALL = "held tpm"
"""What a generation's end keeps besides its usage when nobody said (wire/lua/usage_core.lua
``add_usage``): it left the key's running generations, its tokens join the last minute's."""


def usage_counts(limits: Limits | None) -> str:
    """What the end of a generation admitted against ``limits`` keeps besides its usage:
    ``held`` for a concurrency limit (it leaves the running generations), ``tpm`` for a
    tokens-per-minute limit (the minute's per-second buckets); "" for a key with neither
    (no call for them); None, not known: both. A tokens-per-day limit reads the day's
    usage, which every generation counts."""
    if limits is None:
        return USAGE_COUNTS_ALL
    held = ["held"] if limits.concurrent else []
    return " ".join([*held, "tpm"] if limits.tokens_per_minute else held)
