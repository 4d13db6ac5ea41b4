"""Cancel with the real vLLM engine on the CPU (engine/worker.py, engine/backends/vllm_backend.py):
over the WebSocket and over the REST cancel, the engine request is aborted and no token follows."""

from __future__ import annotations

import asyncio
import subprocess
import time
import urllib.request

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis

from engine.contract import Keys, WorkerInfo
from tests.client import Session, create_session, read_events, send
from tests.conftest import VllmStack
from tests.test_cancel import after_final, stream_events
from tests.ws_client import open_ws

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = "Write a long story about a lighthouse keeper, the sea and a storm."
MAX_TOKENS = 1500
"""Minutes of decoding at 10-20 tokens/s: the generation cannot end by itself in the test."""
STOP_WITHIN_S = 10
"""How soon after the cancel vLLM must hold no request: one decode step is well under a
second here; the rest is slack for a shared CPU and the worker's 1 s heartbeat."""
WASTE = "tokenspout_engine_tokens_after_cancel_total"


def engine_arg(process: subprocess.Popen[bytes], flag: str) -> str:
    args = [str(arg) for arg in process.args]  # type: ignore[union-attr]
    return args[args.index(flag) + 1]


def metric(port: str, name: str, unset: float | None = None) -> float:
    """A sample of the worker's Prometheus ``/metrics`` (a counter's ``_total``); ``unset``
    for a labelled counter that has no sample yet."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    if unset is not None:
        return unset
    raise AssertionError(f"no metric {name}")


async def engine_running(redis: aioredis.Redis, prefix: str, worker_id: str) -> int:
    """The ``running`` field of the worker's heartbeat: requests vLLM holds unfinished."""
    raw = await redis.get(Keys(prefix).worker(worker_id))
    assert raw is not None
    return msgspec.json.decode(raw, type=WorkerInfo).running


async def wait_running(redis: aioredis.Redis, prefix: str, worker_id: str, value: int) -> None:
    async with asyncio.timeout(60):
        while await engine_running(redis, prefix, worker_id) != value:
            await asyncio.sleep(0.1)


async def engine_stops(
    redis: aioredis.Redis, prefix: str, worker_id: str, port: str, cancel_sent: float, waste: float
) -> None:
    """vLLM holds no request within STOP_WITHIN_S of the cancel, and made at most one decode
    step's worth of tokens (one, for one request) after the worker received it."""
    while (running := await engine_running(redis, prefix, worker_id)) != 0:
        elapsed = time.monotonic() - cancel_sent
        assert elapsed < STOP_WITHIN_S, f"vLLM still runs {running} request(s) {elapsed:.1f} s on"
        await asyncio.sleep(0.1)
    wasted = metric(port, WASTE) - waste
    print(f"\nvLLM idle {time.monotonic() - cancel_sent:.2f} s after the cancel; {wasted:g} wasted")
    assert wasted <= 1


async def test_vllm_aborts_a_generation_cancelled_after_its_third_token_over_ws_and_rest(
    vllm_stack: VllmStack,
) -> None:
    stack, gateway = vllm_stack.stack, vllm_stack.gateway
    worker_id = engine_arg(vllm_stack.engine, "--worker-id")
    port = engine_arg(vllm_stack.engine, "--metrics-port")
    redis = aioredis.Redis.from_url(stack.redis_url)
    cancels_before = metric(port, 'tokenspout_engine_cancels_total{reason="user"}', unset=0)
    async with httpx.AsyncClient(timeout=60) as client:
        # 1. Over the WebSocket: cancel as the third token arrives.
        ws = await open_ws(gateway.url)
        try:
            ack = await ws.generate("story", PROMPT, max_tokens=MAX_TOKENS, temperature=0)
            assert ack["type"] == "ack", ack
            third = await ws.until(
                lambda f: f.get("id") == "story" and f["type"] == "token" and f["count"] >= 3,
                timeout_s=300,
            )
            waste, cancel_sent = metric(port, WASTE), time.monotonic()
            await ws.send(type="cancel", id="story")
            cancelled = await ws.final_of("story", timeout_s=60)
            assert cancelled["type"] == "cancelled" and cancelled["reason"] == "user"
            tokens = ws.tokens("story")
            assert ws.frames["story"].index(cancelled) > ws.frames["story"].index(tokens[-1])
            assert cancelled["usage"]["completion_tokens"] == tokens[-1]["count"] >= third["count"]
            assert cancelled["usage"]["completion_tokens"] < MAX_TOKENS
        finally:
            await ws.conn.close()
        await engine_stops(redis, stack.prefix, worker_id, port, cancel_sent, waste)

        # The same generation on the session's SSE stream: same text, one final event.
        ws_session = Session(gateway.url, ack["session_id"], ack["token"])
        ws_gid = ack["generation_id"]
        reading = await read_events(client, ws_session, until_final_of=ws_gid)
        assert reading.text(ws_gid) == ws.text("story") != ""
        assert reading.final(ws_gid).id == cancelled["event_id"]

        # 2. Over the REST cancel, while the SSE stream is read; the engine held it until then.
        session = await create_session(client, gateway.url)
        gid = await send(client, session, PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        rest = await read_events(client, session, limit=5, timeout_s=300)
        assert [e.event for e in rest.events] == ["queued", "started", "token", "token", "token"]
        await wait_running(redis, stack.prefix, worker_id, 1)
        waste, cancel_sent = metric(port, WASTE), time.monotonic()
        response = await client.post(
            f"{gateway.url}/v1/sessions/{session.session_id}/generations/{gid}/cancel",
            headers=session.headers,
        )
        assert response.status_code == 200, response.text
        assert response.json()["state"] == "cancelled"
        await read_events(client, session, until_final_of=gid, reading=rest)
        final = rest.final(gid).json()
        assert final == response.json()["final"]
        assert final["usage"]["completion_tokens"] == rest.of(gid)[-2].json()["count"]
        await engine_stops(redis, stack.prefix, worker_id, port, cancel_sent, waste)
        assert metric(port, "tokenspout_engine_running") == 0

        # 3. Nothing follows either final event in Redis, and the worker counted both aborts.
        await asyncio.sleep(1.0)
        for sid, generation in ((ack["session_id"], ws_gid), (session.session_id, gid)):
            events = await stream_events(stack.redis_url, stack.prefix, sid)
            assert after_final(events, generation) == []
        cancels = metric(port, 'tokenspout_engine_cancels_total{reason="user"}')
        assert cancels == cancels_before + 2
    await redis.aclose()
