"""API keys for tests, made and read the way an operator does: the admin API over HTTP."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from tests.support.http import Session

ADMIN_KEY = "admin-key-for-tests-7c1d"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@dataclass(frozen=True)
class Key:
    id: str
    secret: str
    name: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}


async def make_key(client: httpx.AsyncClient, base: str, name: str, **fields: Any) -> Key:
    """A key made through ``POST /v1/admin/keys`` (``fields``: models, weight, limits),
    once the gateway at ``base`` knows it (it reads the keys every 250 ms)."""
    made = await client.post(f"{base}/v1/admin/keys", json={"name": name, **fields}, headers=ADMIN)
    assert made.status_code == 201, made.text
    body = made.json()
    key = Key(body["id"], body["key"], body["name"])
    await until_known(client, base, key)
    return key


async def until_known(
    client: httpx.AsyncClient, base: str, key: Key, *, known: bool = True, within_s: float = 2
) -> float:
    """Wait until the gateway at ``base`` takes ``key`` (``known``), or refuses it; the
    seconds it took. ``GET /v1/models`` wants a key and costs no generation."""
    began = time.monotonic()
    async with asyncio.timeout(within_s):
        while True:
            answer = await client.get(f"{base}/v1/models", headers=key.headers)
            if (answer.status_code != 401) == known:
                return time.monotonic() - began
            await asyncio.sleep(0.01)


async def usage_total(client: httpx.AsyncClient, base: str, key_id: str) -> dict[str, int]:
    """The key's usage of the last two days, summed (``GET /v1/admin/usage``)."""
    answer = await client.get(
        f"{base}/v1/admin/usage", params={"key": key_id, "granularity": "day"}, headers=ADMIN
    )
    assert answer.status_code == 200, answer.text
    total: dict[str, int] = answer.json()["total"]
    return total


async def until_usage(
    client: httpx.AsyncClient, base: str, key_id: str, total_tokens: int, within_s: float = 10
) -> dict[str, int]:
    """``usage_total`` once it reaches ``total_tokens`` (on a Redis Cluster a generation's
    usage is counted right after its final event, which a reader may see first)."""
    async with asyncio.timeout(within_s):
        while (total := await usage_total(client, base, key_id))["total_tokens"] < total_tokens:
            await asyncio.sleep(0.02)
    assert total["total_tokens"] == total_tokens, total
    return total


def rate_headers(response: httpx.Response) -> dict[str, str]:
    """A response's ``x-ratelimit-*`` headers."""
    return {k: v for k, v in response.headers.items() if k.startswith("x-ratelimit-")}


async def keyed_session(client: httpx.AsyncClient, base: str, key: Key) -> Session:
    """A session made with ``key``: its turns serve (and are billed to) that key."""
    made = await client.post(f"{base}/v1/sessions", headers=key.headers)
    assert made.status_code == 201, made.text
    body = made.json()
    return Session(base, body["session_id"], body["token"])
