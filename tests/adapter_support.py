"""Shared by the API adapter tests: what the synthetic engine answers, and what Redis says
about the one generation a test started."""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import redis

from engine.backends.synthetic import FILLER
from tests.client import create_session, send


@dataclass(frozen=True)
class SyntheticToken:
    text: str
    id: int
    logprob: float


def synthetic_tokens(prompt: str, max_tokens: int) -> list[SyntheticToken]:
    """The synthetic engine's reply to ``prompt`` (engine/backends/synthetic.py), token by
    token: ``You said: <prompt> |`` then the filler, one word per token."""
    words = ["You", "said:", *prompt.split(), "|"]
    words += [FILLER[i % len(FILLER)] for i in range(len(words), max_tokens)]
    return [
        SyntheticToken(
            word if i == 0 else " " + word,
            zlib.crc32(word.encode()) % 50_000,
            -0.05 * (i % 7),
        )
        for i, word in enumerate(words[:max_tokens])
    ]


def synthetic_text(prompt: str, max_tokens: int) -> str:
    return "".join(token.text for token in synthetic_tokens(prompt, max_tokens))


def only_generation(redis_url: str, prefix: str, timeout_s: float = 30) -> tuple[str, str]:
    """(session id, generation id) of the one generation under ``prefix``."""
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            keys = [k.decode() for k in client.scan_iter(match=f"{prefix}:*:gen:*")]
            if keys:
                assert len(keys) == 1, keys
                key = keys[0]
                session_id = key[key.index("{") + 1 : key.index("}")]
                return session_id, key.rsplit(":", 1)[1]
            time.sleep(0.05)
    finally:
        client.close()
    raise TimeoutError(f"no generation appeared under {prefix}")


def wait_final(redis_url: str, prefix: str, timeout_s: float = 60) -> dict[str, Any]:
    """The final event of the one generation under ``prefix``, once it has one."""
    session_id, generation_id = only_generation(redis_url, prefix)
    client = redis.Redis.from_url(redis_url)
    key = f"{prefix}:{{{session_id}}}:gen:{generation_id}"
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            final = client.hget(key, "final")
            if final is not None:
                return dict(json.loads(final))
            time.sleep(0.05)
    finally:
        client.close()
    raise TimeoutError(f"generation {generation_id} did not end")


def workers_running(redis_url: str, prefix: str) -> int:
    """Requests the live workers report running in their heartbeats."""
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:worker:*"))
        return sum(json.loads(raw)["running"] for raw in client.mget(keys) if raw is not None)
    finally:
        client.close()


@asynccontextmanager
async def slot_held(base: str) -> AsyncIterator[None]:
    """A session generation that never ends (``[[stall]]``) holds one in-flight slot until
    the block ends; it is then cancelled and its slot freed."""
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, base)
        generation_id = await send(client, session, "hold [[stall]]", max_tokens=50)
        try:
            yield
        finally:
            cancel = await client.post(
                f"{base}/v1/sessions/{session.session_id}/generations/{generation_id}/cancel",
                headers=session.headers,
            )
            assert cancel.status_code == 200, cancel.text
