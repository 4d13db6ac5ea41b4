"""Every API adapter's stream (OpenAI, TGI, OIP) read raw: valid, uncompressed SSE framed
the way its clients expect, and a client that disconnects aborts its generation in the
engine (gateway/core/generation_stream.py)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.redis_probes import async_client, only_generation, wait_final, wait_running
from tests.support.sse import SSEParser, parse
from tests.support.stack import Stack

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class Endpoint:
    name: str
    path: str
    ends_with_done: bool

    def body(self, text: str, max_tokens: int) -> dict[str, Any]:
        if self.name == "openai-chat":
            return {
                "model": "synthetic",
                "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        if self.name == "openai-completions":
            return {"model": "synthetic", "prompt": text, "max_tokens": max_tokens, "stream": True}
        if self.name == "tgi":
            return {"inputs": text, "parameters": {"max_new_tokens": max_tokens, "details": True}}
        return {"text_input": text, "parameters": {"max_tokens": max_tokens}}


ENDPOINTS = [
    Endpoint("openai-chat", "/v1/chat/completions", True),
    Endpoint("openai-completions", "/v1/completions", True),
    Endpoint("tgi", "/generate_stream", False),
    Endpoint("oip", "/v2/models/synthetic/generate_stream", False),
]


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: e.name)
async def test_stream_is_strict_uncompressed_sse_with_done_only_where_expected(
    stack: Stack, endpoint: Endpoint
) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway(TOKENSPOUT_SSE_HEARTBEAT_S="0.05")
    parser = SSEParser()
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream(
            "POST",
            gateway.url + endpoint.path,
            json=endpoint.body("check the framing", 5),
            headers={"Accept-Encoding": "gzip, br"},
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert "content-encoding" not in response.headers
        assert response.headers["cache-control"] == "no-cache"
        assert response.headers["x-accel-buffering"] == "no"
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    lines = raw.decode().split("\n")
    assert raw.endswith(b"\n\n")

    async def iterate() -> Any:
        for line in lines:
            yield line

    events = [event async for event in parse(iterate(), parser)]
    assert all(event.event == "message" for event in events)
    data = [event.data for event in events]
    if endpoint.ends_with_done:
        assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
        data = data[:-1]
    else:
        assert "[DONE]" not in data
    assert len(data) >= 5
    assert all(event.json() for event in events if event.data != "[DONE]")


@asynccontextmanager
async def stalled_stream(stack: Stack, url: str, endpoint: Endpoint) -> AsyncIterator[None]:
    """A stream of ``endpoint`` whose reply stalls after 3 tokens (it runs until aborted),
    open from its first data line and its generation running; closed (the client gone)
    on exit."""
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream(
            "POST", url + endpoint.path, json=endpoint.body("keep going [[stall:3]]", 500)
        ) as response,
    ):
        assert response.status_code == 200
        lines = response.aiter_lines()
        while not (await asyncio.wait_for(anext(lines), 30)).startswith("data:"):
            pass
        await asyncio.to_thread(wait_running, stack.redis_url, stack.prefix, 1)
        yield


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda e: e.name)
async def test_a_client_that_disconnects_aborts_its_generation(
    stack: Stack, endpoint: Endpoint
) -> None:
    # A long abandon grace: only the disconnect can have stopped the generation.
    env = {"TOKENSPOUT_ABANDON_GRACE_S": "600"}
    stack.synthetic(50, **env)
    gateway = stack.gateway(**env)
    async with stalled_stream(stack, gateway.url, endpoint):
        only_generation(stack.redis_url, stack.prefix)
        # The client is gone (the response is closed, the connection dropped).
    final = wait_final(stack.redis_url, stack.prefix)
    assert final["type"] == "cancelled"
    assert final["reason"] == "disconnected"
    await asyncio.to_thread(wait_running, stack.redis_url, stack.prefix, 0)


async def test_a_disconnect_whose_abort_redis_refuses_at_first_aborts_once_redis_answers(
    stack: Stack,
) -> None:
    """A client gone while Redis refuses its gateway (a failover under way): the abort is
    tried again (gateway/core/generation_stream.py ABORT_RETRY_FOR_S), not dropped with the
    reply left to run unread. Redis refuses for real: the gateway's user loses its commands
    by ACL, and gets them back 1.5 s after the client left."""
    env = {"TOKENSPOUT_ABANDON_GRACE_S": "600"}
    stack.synthetic(50, **env)
    admin = async_client(stack.redis_url)
    user, password = f"gw-{secrets.token_hex(3)}", secrets.token_hex(8)
    everything = {"keys": ["*"], "channels": ["*"], "passwords": [f"+{password}"]}
    await admin.acl_setuser(user, enabled=True, commands=["+@all"], **everything)
    try:
        url = stack.redis_url.replace("redis://", f"redis://{user}:{password}@", 1)
        gateway = stack.gateway(REDIS_URL=url, **env)
        async with stalled_stream(stack, gateway.url, ENDPOINTS[0]):
            await admin.acl_setuser(user, enabled=True, commands=["-@all"], **everything)
        await asyncio.sleep(1.5)  # the client is gone; its gateway's abort is refused
        await admin.acl_setuser(user, enabled=True, commands=["+@all"], **everything)
        final = await asyncio.to_thread(wait_final, stack.redis_url, stack.prefix)
        assert (final["type"], final["reason"]) == ("cancelled", "disconnected")
    finally:
        await admin.acl_deluser(user)
        await admin.aclose()
