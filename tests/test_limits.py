"""Limits and backpressure: every bound answers with a clear error, and memory stays bounded."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from tests.support.http import create_session, read_events, send
from tests.support.metrics import scrape, value
from tests.support.oracle import synthetic_text
from tests.support.sse import SSEParser
from tests.support.stack import Stack
from wire import Keys

pytestmark = pytest.mark.timeout(120)


async def test_past_the_inflight_limit_a_request_gets_429_with_retry_after(stack: Stack) -> None:
    stack.synthetic(5, "--capacity", "1")
    gateway = stack.gateway(TOKENSPOUT_MAX_INFLIGHT="3")
    async with httpx.AsyncClient(timeout=30) as client:
        sessions = [await create_session(client, gateway.url) for _ in range(4)]
        accepted = [
            await send(client, s, f"slow {i}", max_tokens=100) for i, s in enumerate(sessions[:3])
        ]
        url = f"{gateway.url}/v1/sessions/{sessions[3].session_id}/messages"
        refused = await client.post(
            url, json={"content": "one too many"}, headers=sessions[3].headers
        )
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
        cancel = await client.post(
            f"{gateway.url}/v1/sessions/{sessions[0].session_id}/generations/{accepted[0]}/cancel",
            headers=sessions[0].headers,
        )
        assert cancel.json()["state"] in ("cancelled", "cancelling")  # the worker confirms
        ended = await read_events(client, sessions[0], until_final_of=accepted[0])
        assert ended.final(accepted[0]).event == "cancelled"
        again = await client.post(
            url, json={"content": "now there is room"}, headers=sessions[3].headers
        )
        assert again.status_code == 202


async def test_a_burst_of_one_shot_requests_through_two_gateways_keeps_the_inflight_limit(
    stack: Stack,
) -> None:
    """On one Redis the SUBMIT script itself admits a one-shot request, so the limit holds
    across gateways: 20 streamed chat requests at once, half through each of two gateways,
    and exactly 5 run. (Each gateway reading the counts first, both read none in flight
    and let 5 in each.)"""
    stack.synthetic(5, "--capacity", "50")
    gateways = [stack.gateway(TOKENSPOUT_MAX_INFLIGHT="5") for _ in range(2)]
    chat = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "a long one"}],
        "max_tokens": 1000,  # 200 s at 5 tokens/s: every one admitted is still running
        "stream": True,
    }
    limits = httpx.Limits(max_connections=40)
    async with (
        httpx.AsyncClient(timeout=30, limits=limits) as client,
        contextlib.AsyncExitStack() as streams,
    ):

        async def status(base: str) -> int:
            url = f"{base}/v1/chat/completions"
            response = await streams.enter_async_context(client.stream("POST", url, json=chat))
            return response.status_code

        codes = await asyncio.gather(*(status(g.url) for g in gateways for _ in range(10)))
    assert sorted(codes) == [200] * 5 + [429] * 15, codes


async def test_a_session_holds_a_bounded_history(stack: Stack) -> None:
    stack.synthetic(500)
    gateway = stack.gateway(TOKENSPOUT_MAX_HISTORY_MESSAGES="4")
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        for turn in range(2):
            generation = await send(client, session, f"turn {turn}", max_tokens=2)
            await read_events(client, session, until_final_of=generation)
        full = await client.post(
            f"{gateway.url}/v1/sessions/{session.session_id}/messages",
            json={"content": "turn 3"},
            headers=session.headers,
        )
        assert full.status_code == 422
        assert full.json()["error"]["code"] == "history_full"


STALL_TOKENS = 20_000
STALL_WORD = 400
"""Characters per token of the stalled reader's generation: 20,000 events of ~650 bytes."""
STALL_RSS_BOUND_KIB = 4 * 1024
"""Measured: +0.6 MiB with the 8-event buffer; +12.6 MiB when the buffer is unbounded (the
gateway keeping every event for the stalled reader), three times this bound."""


async def test_a_stalled_reader_costs_bounded_memory_and_still_gets_every_event(
    stack: Stack,
) -> None:
    """With an 8-event buffer, a reader that stops reading during a 20,000-token generation
    falls back to Redis: its feed overflows (counted), the gateway's RSS stays within a
    bound that keeping every event would exceed, and the reader still gets every byte."""
    stack.synthetic(10_000)
    big = str(STALL_TOKENS * (STALL_WORD + 1) + 10_000)
    limits = {
        "TOKENSPOUT_MAX_TOKENS_LIMIT": str(STALL_TOKENS),
        "TOKENSPOUT_EVENTS_MAXLEN": str(2 * STALL_TOKENS),
        "TOKENSPOUT_MAX_MESSAGE_CHARS": big,
        "TOKENSPOUT_MAX_BODY_BYTES": big,
    }
    # The multi-megabyte message goes in through another gateway: the one measured only
    # relays the reply, so its RSS shows what the reader costs, not the request's garbage.
    entry = stack.gateway(**limits)
    gateway = stack.gateway(TOKENSPOUT_STREAM_BUFFER_EVENTS="8", **limits)
    content = " ".join(f"{n:06d}" + "w" * (STALL_WORD - 6) for n in range(STALL_TOKENS))
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, entry.url)
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", gateway.port))
        stalled.sendall(
            f"GET /v1/sessions/{session.session_id}/events?token={session.token} HTTP/1.1\r\n"
            f"Host: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n".encode()
        )
        await wait_for_streams(client, gateway.url, 1)
        await stack.wait_live_readers(session.session_id)  # events arrive live from here
        baseline = rss_kib(gateway.process.pid)
        generation = await send(client, session, content, max_tokens=STALL_TOKENS)
        # Everyone else is served while that reader sleeps.
        other = await create_session(client, gateway.url)
        quick = await send(client, other, "meanwhile", max_tokens=5)
        assert (await read_events(client, other, until_final_of=quick)).final(quick)
        peak = await peak_rss_until_final(
            stack, gateway.process.pid, session.session_id, generation
        )
        growth = peak - baseline
        samples = await scrape(client, f"{gateway.url}/metrics")
        fell_behind = value(samples, "tokenspout_gateway_relay_fell_behind_total")
        print(
            f"\nstalled reader: {STALL_TOKENS} events, RSS {baseline} KiB -> peak {peak} KiB "
            f"(+{growth} KiB), feeds fell behind {fell_behind:.0f} times"
        )
        assert fell_behind >= 1, "the stalled reader's buffer never overflowed"
        assert growth < STALL_RSS_BOUND_KIB
        text = await asyncio.to_thread(read_raw_until_done, stalled)
        assert text == synthetic_text(content, STALL_TOKENS)


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])


async def wait_for_streams(client: httpx.AsyncClient, gateway_url: str, streams: int) -> None:
    async with asyncio.timeout(20):
        while True:
            samples = await scrape(client, f"{gateway_url}/metrics")
            if value(samples, "tokenspout_gateway_active_streams") == streams:
                return
            await asyncio.sleep(0.1)


async def peak_rss_until_final(stack: Stack, pid: int, session_id: str, generation: str) -> int:
    """The gateway's highest RSS, sampled until the generation's final event is in Redis."""
    redis = aioredis.Redis.from_url(stack.redis_url)
    key = Keys(stack.prefix).generation(session_id, generation)
    peak = 0
    try:
        async with asyncio.timeout(100):
            while True:
                peak = max(peak, rss_kib(pid))
                if await redis.hexists(key, "final"):
                    return max(peak, rss_kib(pid))
                await asyncio.sleep(0.1)
    finally:
        await redis.aclose()


def read_raw_until_done(sock: socket.socket) -> str:
    parser, pieces, buffer = SSEParser(), [], b""
    sock.settimeout(30)
    with sock:
        head, _, buffer = sock.recv(65536).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        while True:
            chunk = sock.recv(65536)
            assert chunk, "the stream ended early"
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                line = raw.decode().rstrip("\r")
                if all(c in "0123456789abcdef" for c in line) and line:
                    continue  # a chunked-encoding size line
                event = parser.line(line)
                if event is None:
                    continue
                if event.event == "token":
                    pieces.append(event.json()["text"])
                if event.event == "done":
                    return "".join(pieces)


async def test_every_session_key_expires_and_every_stream_is_capped(stack: Stack) -> None:
    stack.synthetic(3000)
    gateway = stack.gateway(TOKENSPOUT_EVENTS_MAXLEN="100", TOKENSPOUT_STATELESS_TTL_S="120")
    async with httpx.AsyncClient(timeout=30) as client:
        one_shot = await client.post(
            f"{gateway.url}/v1/chat/completions",
            json={"model": "synthetic", "messages": [{"role": "user", "content": "x"}]},
        )
        assert one_shot.status_code == 200, one_shot.text
        one_shot_id = one_shot.json()["id"].removeprefix("chatcmpl-")
        session = await create_session(client, gateway.url)
        generation = await send(client, session, "many events", max_tokens=1000)
        full = await read_events(client, session, until_final_of=generation)
        assert full.final(generation).event == "done"
        gone = await client.get(
            session.events_url, headers={**session.headers, "Last-Event-ID": "1-0"}
        )
        assert gone.status_code == 410
        assert gone.json()["error"]["code"] == "events_expired"
        # A cancel of a running generation writes the shared cancels stream.
        long = await send(client, session, "cancel me", max_tokens=4000)
        await read_events(client, session, limit=3, last_event_id=full.events[-1].id)
        cancel = await client.post(
            f"{gateway.url}/v1/sessions/{session.session_id}/generations/{long}/cancel",
            headers=session.headers,
        )
        assert cancel.status_code == 200, cancel.text

    redis = aioredis.Redis.from_url(stack.redis_url)
    try:
        names = Keys(stack.prefix)
        keys = [key.decode() async for key in redis.scan_iter(f"{names.prefix}:*")]
        assert any(":events" in key for key in keys)
        shared = {names.requests("synthetic"), names.models, names.cancels, names.workers}
        assert shared <= set(keys), "the test did not make every shared key"
        for key in keys:
            assert await redis.ttl(key) > 0, f"{key} never expires"
        # A one-shot request's keys live TOKENSPOUT_STATELESS_TTL_S, a session's a day.
        one_shot_key = next(key for key in keys if key.endswith(f":gen:{one_shot_id}"))
        assert 60 < await redis.ttl(one_shot_key) <= 120
        turn = next(key for key in keys if key.endswith(f":gen:{generation}"))
        assert await redis.ttl(turn) > 120
        events = next(key for key in keys if key.endswith(":events"))
        assert await redis.xlen(events) < 400  # ~100, trimmed in whole nodes
        # The shared streams are capped too (and expire when unused); the worker set trims
        # itself.
        assert await redis.xlen(names.requests("synthetic")) <= 256 * 20 + 100
    finally:
        await redis.aclose()


async def test_cors_is_closed_by_default_and_opens_for_configured_origins(
    stack: Stack,
) -> None:
    closed, open_ = stack.gateway(), stack.gateway(TOKENSPOUT_CORS_ORIGINS="https://chat.example")
    preflight = {"Origin": "https://chat.example", "Access-Control-Request-Method": "POST"}
    async with httpx.AsyncClient(timeout=10) as client:
        refused = await client.options(f"{closed.url}/v1/sessions", headers=preflight)
        assert "access-control-allow-origin" not in refused.headers
        allowed = await client.options(f"{open_.url}/v1/sessions", headers=preflight)
        assert allowed.headers["access-control-allow-origin"] == "https://chat.example"
        other = await client.options(
            f"{open_.url}/v1/sessions", headers={**preflight, "Origin": "https://evil.example"}
        )
        assert other.headers.get("access-control-allow-origin") != "https://evil.example"
