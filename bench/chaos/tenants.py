"""The API keys of a chaos run, made the way an operator makes them: the admin API.

The fleet's gateways start with ``TOKENSPOUT_ADMIN_KEY``, so every request wants a key.
Four keys share the engine with different weights; one of them has a modest limit on its
concurrent generations, so the run also admits, refuses (429 ``rate_limit_exceeded`` with
``Retry-After``, which its clients wait out) and releases under faults. No other key has a
limit: a refusal naming one is an anomaly."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

KEY_PLAN: tuple[tuple[str, float, dict[str, int]], ...] = (
    ("chaos-w1", 1.0, {}),
    ("chaos-w2", 2.0, {}),
    ("chaos-w4", 4.0, {}),
    ("chaos-limited", 1.0, {"concurrent": 3}),
)
"""(name, weight, limits) of each key: a client loop serves the key of its index modulo 4."""
RATE_LIMITED = "rate_limit_exceeded"
"""The error code of a refusal by a key's limits (docs/api.md)."""


def admin_key() -> str:
    return f"chaos-admin-{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ApiKey:
    """A key as its clients hold it."""

    name: str
    id: str
    secret: str
    weight: float
    limits: dict[str, int] = field(default_factory=dict)

    @property
    def bearer(self) -> dict[str, str]:
        """Its header (none for a key with no secret: requests to gateways that take none)."""
        return {"Authorization": f"Bearer {self.secret}"} if self.secret else {}


IN_FORCE_S = 1.0
"""A new key is in force on every process of every gateway within this long (each process
reads the keys every 250 ms: gateway/tenants/directory.py)."""
CHECKS_PER_URL = 8
"""New connections per gateway and key in the check: a port served by several processes
(``--workers``) hands each connection to one of them."""


def make_keys(urls: list[str], admin: str, within_s: float = 10.0) -> list[ApiKey]:
    """The run's keys, made through ``POST /v1/admin/keys`` at the first gateway, once
    every gateway at ``urls`` takes them. A check through a port reaches one of its
    processes, so the run also waits the second the product promises for every process
    (a run that did not: clients of the two-process gateway refused with 401 at 0.05 s)."""
    headers = {"Authorization": f"Bearer {admin}"}
    keys: list[ApiKey] = []
    with httpx.Client(timeout=10, headers={"Connection": "close"}) as client:
        for name, weight, limits in KEY_PLAN:
            body: dict[str, Any] = {"name": name, "weight": weight, "limits": limits}
            made = client.post(f"{urls[0]}/v1/admin/keys", json=body, headers=headers)
            if made.status_code != 201:
                raise RuntimeError(f"making key {name}: {made.status_code} {made.text[:300]}")
            answer = made.json()
            keys.append(ApiKey(name, answer["id"], answer["key"], weight, limits))
        made_at = time.monotonic()
        deadline = made_at + within_s
        for url in urls:
            for key in keys:
                taken = 0
                while taken < CHECKS_PER_URL:
                    ok = client.get(f"{url}/v1/models", headers=key.bearer).status_code != 401
                    taken = taken + 1 if ok else 0
                    if not ok and time.monotonic() > deadline:
                        raise TimeoutError(f"{url} did not take key {key.name} in {within_s} s")
                    if not ok:
                        time.sleep(0.05)
        time.sleep(max(0.0, made_at + IN_FORCE_S - time.monotonic()))
    return keys
