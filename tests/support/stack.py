"""A test's processes: stack/rig.py's rig, and what a test waits for on it."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from stack.rig import VLLM_LOCK, Gateway, Rig
from tests.support.redis_probes import async_client, live_readers
from wire import Keys

__all__ = ["VLLM_LOCK", "Gateway", "Stack", "VllmStack"]


class Stack(Rig):
    """Processes of one test, all on one Redis key prefix; stopped when the test ends."""

    synthetic_drain_s = "1"
    """A reply still running when the test ends is cancelled a second after the stop's
    SIGTERM. With the worker's default (30 s) the stop waited its whole 15 s for it, then
    killed the worker; the tests that are about the drain give their own ``--drain-s``."""

    async def wait_live_readers(self, session_id: str, count: int = 1) -> None:
        """Until Redis confirms ``count`` gateways' subscriptions to the session's live
        channel: from then on its events reach those gateways' readers live."""
        channel = Keys(self.prefix).live_channel(session_id)
        client = async_client(self.redis_url)
        try:
            async with asyncio.timeout(30):
                while await live_readers(client, channel) < count:
                    await asyncio.sleep(0.01)
        finally:
            await client.aclose()


@dataclass
class VllmStack:
    stack: Stack
    gateway: Gateway
    engine: subprocess.Popen[bytes]


@contextmanager
def synthetic_stack(
    redis_url: str, logs: Path, tokens_per_s: float, **env: str
) -> Iterator[tuple[Stack, Gateway]]:
    """A gateway (``env``: its settings) and a synthetic engine on a fresh key prefix: one
    rig that a module's tests share (every browser profile is an owner of its own)."""
    stack = Stack(redis_url, f"web-{secrets.token_hex(4)}", logs)
    try:
        stack.synthetic(tokens_per_s=tokens_per_s)
        yield stack, stack.gateway(**env)
    finally:
        stack.stop()
