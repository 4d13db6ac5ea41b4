"""A key's limits, across replicas: one script on the key's Redis slot admits or refuses
(wire/lua/admit.lua). Real processes (Redis, gateways, a synthetic worker) and real
clients (httpx, openai, huggingface_hub, websockets, tritonclient).

bench/limits.py measures the 60-a-minute case over whole minutes (docs/bench/limits.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
import tritonclient.grpc as grpcclient
from huggingface_hub import AsyncInferenceClient
from huggingface_hub.errors import OverloadedError
from tritonclient.utils import InferenceServerException

from tests.support.http import all_of, cancel, follow
from tests.support.metrics import sample, scrape
from tests.support.stack import Gateway, Stack
from tests.support.tenants import (
    ADMIN_KEY,
    Key,
    keyed_session,
    make_key,
    rate_headers,
    until_known,
)
from tests.support.triton import llm_inputs
from tests.support.ws import open_ws

pytestmark = pytest.mark.timeout(180)

CHAT = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_five_a_minute_across_two_gateways_admits_exactly_five(stack: Stack) -> None:
    """Twelve requests at once, half through each gateway, of a key limited to 5 requests
    a minute: exactly 5 are served, each told how many remain (4, 3, 2, 1, 0 once each),
    and 7 refused 429 with Retry-After (until the first of the five leaves the minute)
    and the headers."""
    stack.synthetic(500)
    gateways = [stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY) for _ in range(2)]
    async with httpx.AsyncClient(timeout=30) as client:
        key = await make_key(client, gateways[0].url, "five", limits={"requests_per_minute": 5})
        await until_known(client, gateways[1].url, key)
        answers = await all_of(
            *(
                client.post(
                    f"{gateways[i % 2].url}/v1/chat/completions", json=CHAT, headers=key.headers
                )
                for i in range(12)
            )
        )
        scraped = [await scrape(client, f"{gateway.url}/metrics") for gateway in gateways]
    served = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert len(served) == 5 and len(refused) == 7, [a.status_code for a in answers]
    # Each gateway counts what it admitted and refused, by the key's name and the limit.
    admitted = "tokenspout_gateway_key_requests_total"
    refusals = "tokenspout_gateway_key_refusals_total"
    limit = {"key": "five", "limit": "requests_per_minute"}
    assert sum(sample(samples, admitted, key="five") or 0 for samples in scraped) == 5
    assert sum(sample(samples, refusals, **limit) or 0 for samples in scraped) == 7
    remaining = sorted(int(a.headers["x-ratelimit-remaining-requests"]) for a in served)
    assert remaining == [0, 1, 2, 3, 4]
    for answer in [*served, *refused]:
        assert answer.headers["x-ratelimit-limit-requests"] == "5"
        assert answer.headers["x-ratelimit-reset-requests"].endswith("s")
    for answer in refused:
        assert 55 <= int(answer.headers["retry-after"]) <= 60
        assert answer.headers["x-ratelimit-remaining-requests"] == "0"
        assert answer.json()["error"]["code"] == "rate_limit_exceeded"


LIMITS: dict[str, dict[str, int]] = {
    "requests_per_minute": {"requests_per_minute": 1},
    "concurrent": {"concurrent": 1},
    "tokens_per_minute": {"tokens_per_minute": 5},
    "tokens_per_day": {"tokens_per_day": 5},
}


@pytest.mark.parametrize("limit", list(LIMITS))
async def test_each_limit_refuses_in_every_apis_own_format(stack: Stack, limit: str) -> None:
    """Once the key is at the limit, a request through each API is refused in that API's
    format, naming the limit, its value and when it admits again: the session API and
    OpenAI (chat and Responses) with 429, Retry-After and the key's x-ratelimit headers;
    TGI as its ``overloaded``; OIP's ``{"error"}``; a WebSocket ``error`` frame with
    ``retry_after_s``; gRPC ``RESOURCE_EXHAUSTED``."""
    stack.synthetic(500)
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY, grpc=True)
    async with httpx.AsyncClient(timeout=30) as client:
        key = await make_key(client, gateway.url, f"at-{limit}", limits=LIMITS[limit])
        async with at_the_limit(client, gateway, key, limit):
            said = await _refusals(client, gateway, key)
    value = next(iter(LIMITS[limit].values()))
    for api, message in said.items():
        assert f"{limit} limit ({value})" in message, (api, message)
        assert "admits again" in message, (api, message)


@asynccontextmanager
async def at_the_limit(
    client: httpx.AsyncClient, gateway: Gateway, key: Key, limit: str
) -> AsyncIterator[None]:
    """The key at ``limit``: one request served (a limit per minute or day: it used 6
    tokens), or one generation running (concurrent: stalled, cancelled after)."""
    if limit != "concurrent":
        served = await client.post(
            f"{gateway.url}/v1/chat/completions",
            json={**CHAT, "max_tokens": 5},
            headers=key.headers,
        )
        assert served.status_code == 200, served.text
        yield
        return
    session = await keyed_session(client, gateway.url, key)
    sent = await client.post(
        f"{session.base}/v1/sessions/{session.session_id}/messages",
        json={"content": "[[stall]] hold the slot"},
        headers=session.headers,
    )
    assert sent.status_code == 202, sent.text
    gid = sent.json()["generation_id"]
    follower = follow(client, session, gid)
    await follower.until_event("started")
    try:
        yield
    finally:
        await cancel(client, session, gid)
        await follower.until_end()


async def _refusals(client: httpx.AsyncClient, gateway: Gateway, key: Key) -> dict[str, str]:
    """Each API's refusal of one request, checked for its format; what each said."""
    said: dict[str, str] = {}
    session = await keyed_session(client, gateway.url, key)
    turn = await client.post(
        f"{session.base}/v1/sessions/{session.session_id}/messages",
        json={"content": "refused"},
        headers=session.headers,
    )
    said["sessions"] = _checked_429(turn)["error"]["message"]
    oip = await client.post(
        f"{gateway.url}/v2/models/synthetic/generate",
        json={"text_input": "refused"},
        headers=key.headers,
    )
    said["oip"] = _checked_429(oip)["error"]
    said.update(await _openai_refusals(gateway, key))
    tgi = AsyncInferenceClient(model=f"{gateway.url}/generate", token=key.secret)
    try:
        with pytest.raises(OverloadedError) as overloaded:
            await tgi.text_generation("refused", max_new_tokens=2)
    finally:
        await tgi.close()
    said["tgi"] = str(overloaded.value)
    said["websocket"] = await _ws_refusal(gateway, key)
    said["grpc"] = await asyncio.to_thread(_grpc_refusal, gateway, key)
    return said


def _checked_429(answer: httpx.Response) -> Any:
    assert answer.status_code == 429, answer.text
    assert int(answer.headers["retry-after"]) >= 1
    assert rate_headers(answer), answer.headers
    return answer.json()


async def _openai_refusals(gateway: Gateway, key: Key) -> dict[str, str]:
    said = {}
    async with openai.AsyncOpenAI(
        base_url=f"{gateway.url}/v1", api_key=key.secret, max_retries=0
    ) as sdk:
        with pytest.raises(openai.RateLimitError) as chat:
            await sdk.chat.completions.create(**CHAT, stream=True)
        with pytest.raises(openai.RateLimitError) as responses:
            await sdk.responses.create(model="synthetic", input="refused", max_output_tokens=2)
    for api, refusal in (("openai chat", chat.value), ("openai responses", responses.value)):
        body = _checked_429(refusal.response)
        assert body["error"]["code"] == "rate_limit_exceeded", body
        said[api] = body["error"]["message"]
    return said


async def _ws_refusal(gateway: Gateway, key: Key) -> str:
    ws = await open_ws(gateway.url)
    try:
        frame = await ws.generate("q1", "refused", api_key=key.secret, max_tokens=2)
    finally:
        await ws.conn.close()
    assert frame["type"] == "error" and frame["code"] == "rate_limit_exceeded", frame
    assert frame["retry_after_s"] >= 1
    return str(frame["message"])


def _grpc_refusal(gateway: Gateway, key: Key) -> str:
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.infer(
                "synthetic",
                llm_inputs("refused", 2),
                headers={"authorization": f"Bearer {key.secret}"},
            )
    finally:
        client.close()
    assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    return str(refused.value.message())


async def test_every_response_of_a_limited_key_carries_its_counts(stack: Stack) -> None:
    """Streamed and whole, through the hot route and Litestar's, the session API's 202,
    TGI and OIP: each names the key's limits, what remains and when it resets (OpenAI's
    spelling: 1m0s); a key without limits gets none."""
    stack.synthetic(500)
    gateway = stack.gateway(TOKENSPOUT_ADMIN_KEY=ADMIN_KEY, TOKENSPOUT_CORS_ORIGINS="http://x")
    limits = {"requests_per_minute": 100, "tokens_per_minute": 10_000, "tokens_per_day": 10**6}
    async with httpx.AsyncClient(timeout=30) as client:
        key = await make_key(client, gateway.url, "counted", limits={**limits, "concurrent": 9})
        free = await make_key(client, gateway.url, "free")
        answers = await _answers(client, gateway, key)
        unlimited = await client.post(
            f"{gateway.url}/v1/chat/completions", json=CHAT, headers=free.headers
        )
    assert unlimited.status_code == 200 and not rate_headers(unlimited)
    seen = []
    for name, answer in answers.items():
        headers = rate_headers(answer)
        assert headers["x-ratelimit-limit-requests"] == "100", name
        assert headers["x-ratelimit-limit-tokens"] == "10000", name
        assert headers["x-ratelimit-limit-tokens-day"] == "1000000", name
        assert headers["x-ratelimit-limit-concurrent"] == "9", name
        assert headers["x-ratelimit-reset-requests"] == "1m0s", name  # it was just admitted
        seen.append(int(headers["x-ratelimit-remaining-requests"]))
    assert sorted(seen, reverse=True) == list(range(99, 99 - len(answers), -1))


async def _answers(
    client: httpx.AsyncClient, gateway: Gateway, key: Key
) -> dict[str, httpx.Response]:
    """One answer of each kind, in turn (so each is told one request fewer remains)."""
    url, headers = gateway.url, key.headers
    answers = {
        "hot route, whole": await client.post(
            f"{url}/v1/chat/completions", json=CHAT, headers=headers
        ),
        # An Origin header sends it past the hot route, to Litestar's.
        "litestar, whole": await client.post(
            f"{url}/v1/chat/completions", json=CHAT, headers={**headers, "Origin": "http://x"}
        ),
        "tgi": await client.post(f"{url}/generate", json={"inputs": "hi"}, headers=headers),
        "oip": await client.post(
            f"{url}/v2/models/synthetic/generate", json={"text_input": "hi"}, headers=headers
        ),
    }
    async with client.stream(
        "POST",
        f"{url}/v1/completions",
        json={"model": "synthetic", "prompt": "hi", "max_tokens": 2, "stream": True},
        headers=headers,
    ) as streamed:
        await streamed.aread()
    answers["hot route, streamed"] = streamed
    session = await keyed_session(client, url, key)
    answers["session message"] = await client.post(
        f"{url}/v1/sessions/{session.session_id}/messages",
        json={"content": "hi", "max_tokens": 2},
        headers=session.headers,
    )
    for name, answer in answers.items():
        assert answer.status_code in (200, 202), (name, answer.text)
    return answers
