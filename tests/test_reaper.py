"""The gateway's background loops outlive any failure of one pass (gateway/watchdog.py)."""

from __future__ import annotations

import asyncio
import logging
import secrets

import pytest
import redis.asyncio as aioredis

from engine.contract import Keys
from gateway.watchdog import Reaper

pytestmark = pytest.mark.timeout(30)


async def test_a_reaper_pass_that_raises_is_logged_and_the_reaper_goes_on(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Not only Redis errors: any exception of one pass (a bug, a malformed entry) is
    logged with its traceback, and both duties keep running."""
    reaper = Reaper(redis, Keys(f"t-{secrets.token_hex(4)}"), 2.0, 100, 600)
    passes = {"reap_once": 0, "expire_queued": 0}

    async def reap_once() -> int:
        passes["reap_once"] += 1
        if passes["reap_once"] == 1:
            raise ValueError("a malformed pending entry")
        return 0

    async def expire_queued() -> int:
        passes["expire_queued"] += 1
        raise KeyError("b'r'")

    monkeypatch.setattr(reaper, "reap_once", reap_once)
    monkeypatch.setattr(reaper, "expire_queued", expire_queued)
    caplog.set_level(logging.WARNING, "tokenspout.watchdog")
    task = asyncio.create_task(reaper.run_forever(interval_s=0.01))
    try:
        while min(passes.values()) < 3:
            await asyncio.sleep(0.01)
            assert not task.done(), "the reaper loop ended"
    finally:
        task.cancel()
    assert "a malformed pending entry" in caplog.text
    assert "expire_queued failed" in caplog.text
    assert any(record.exc_info for record in caplog.records), "no traceback logged"
