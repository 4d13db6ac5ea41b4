"""One gateway, many models (gateway/core/store/models.py): two synthetic workers serving two
names on one Redis, driven by the official ``openai`` client and plain HTTP."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from stack import processes
from tests.support.http import Session, create_session, read_events, send
from tests.support.metrics import scrape, until_sample, value
from tests.support.oracle import synthetic_text
from tests.support.stack import Stack
from tests.support.ws import open_ws

pytestmark = pytest.mark.timeout(120)


def _two_models(stack: Stack, *alpha_args: str, **gateway_env: str) -> str:
    stack.synthetic(200, "--served-model-name", "alpha", *alpha_args)
    stack.synthetic(200, "--served-model-name", "beta", "--served-model-name", "b,bee")
    return stack.gateway(**gateway_env).url


def _client(base: str) -> openai.AsyncOpenAI:
    # Its own connection pool per test; no retries, so a 429 or 503 shows at once.
    return openai.AsyncOpenAI(
        base_url=f"{base}/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)),
    )


async def _chat(client: openai.AsyncOpenAI, model: str, content: str, **extra: Any) -> list[Any]:
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=4,
        stream=True,
        **extra,
    )
    return [chunk async for chunk in stream]


async def test_each_request_is_answered_by_the_model_it_names(stack: Stack) -> None:
    base = _two_models(stack)
    client = _client(base)
    answers = await asyncio.gather(
        *(_chat(client, name, f"to {name}") for name in ["alpha", "beta", "b", "bee", "alpha"])
    )
    for name, chunks in zip(["alpha", "beta", "b", "bee", "alpha"], answers, strict=True):
        owner = "alpha" if name == "alpha" else "beta"  # aliases answer as their model
        assert {chunk.model for chunk in chunks} == {owner}
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == synthetic_text(f"to {name}", 4)

    listed = await client.models.list()
    assert [(m.id, m.model_extra or {}) for m in listed.data] == [
        # max_model_len: vLLM's field; the synthetic engine has no fixed context.
        ("alpha", {"root": "alpha", "max_model_len": None}),
        ("b", {"root": "beta", "max_model_len": None}),
        ("bee", {"root": "beta", "max_model_len": None}),
        ("beta", {"root": "beta", "max_model_len": None}),
    ]
    async with httpx.AsyncClient(timeout=30) as http:
        ready = (await http.get(f"{base}/ready")).json()
        assert ready["ready"] and ready["models"] == {"alpha": 1, "beta": 1}
        assert (await http.get(f"{base}/v2/models/bee/ready")).status_code == 200
        oip = await http.post(
            f"{base}/v2/models/alpha/generate",
            json={"text_input": "via oip", "parameters": {"max_tokens": 3}},
        )
        assert oip.json()["model_name"] == "alpha"

        # A session keeps the model it was created with; without one it must name one.
        created = await http.post(f"{base}/v1/sessions", json={"model": "b"})
        assert created.status_code == 201 and created.json()["model"] == "beta"
        unnamed = await http.post(f"{base}/v1/sessions")
        assert unnamed.status_code == 422
        assert unnamed.json()["error"]["code"] == "model_required"
        assert "alpha, beta" in unnamed.json()["error"]["message"]
        body = created.json()
        session = Session(base, body["session_id"], body["token"])
        for turn in ("first", "second"):
            generation = await send(http, session, turn, max_tokens=2)
            reading = await read_events(http, session, until_final_of=generation)
            (started,) = [e for e in reading.of(generation) if e.event == "started"]
            assert started.json()["model"] == "beta"
        samples = await scrape(http, f"{base}/metrics")
    value(samples, "tokenspout_gateway_model_generations_submitted_total", model="beta")
    value(samples, "tokenspout_gateway_model_generations_queued", model="alpha")


async def test_a_request_without_a_model_takes_the_default_model(stack: Stack) -> None:
    base = _two_models(stack, TOKENSPOUT_DEFAULT_MODEL="bee")
    async with httpx.AsyncClient(timeout=30) as http:
        session = await create_session(http, base)
        generation = await send(http, session, "which model", max_tokens=3)
        reading = await read_events(http, session, until_final_of=generation)
        (started,) = [e for e in reading.of(generation) if e.event == "started"]
        assert started.json()["model"] == "beta"
        tgi = await http.post(f"{base}/generate", json={"inputs": "tgi", "parameters": {}})
        assert tgi.status_code == 200, tgi.text
        info = (await http.get(f"{base}/info")).json()
        assert info["model_id"] == "beta"


async def test_an_unknown_model_is_not_found_in_each_api(stack: Stack) -> None:
    base = _two_models(stack)
    client = _client(base)
    with pytest.raises(openai.NotFoundError) as caught:
        await client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert caught.value.code == "model_not_found"
    assert "'gpt-4'" in caught.value.message and "alpha" in caught.value.message
    async with httpx.AsyncClient(timeout=30) as http:
        oip = await http.post(f"{base}/v2/models/gpt-4/generate", json={"text_input": "hi"})
        assert oip.status_code == 404 and "gpt-4" in oip.json()["error"]
        assert (await http.get(f"{base}/v2/models/gpt-4/ready")).status_code == 404
        session = await http.post(f"{base}/v1/sessions", json={"model": "gpt-4"})
        assert session.status_code == 404
        assert session.json()["error"]["code"] == "model_not_found"


async def test_a_slow_model_never_delays_another_and_limits_hold_per_model(
    stack: Stack,
) -> None:
    """alpha's one slot is held by a stalled generation, a second alpha request waits in
    alpha's queue, and beta still answers at once; the per-model limit refuses alpha only."""
    base = _two_models(stack, "--capacity", "1", TOKENSPOUT_MAX_INFLIGHT_PER_MODEL="2")
    client = _client(base)
    async with httpx.AsyncClient(timeout=30) as http:
        metrics = f"{base}/metrics"
        # One after the other: sent together, the quick one might take the slot first.
        stalled = asyncio.create_task(_chat(client, "alpha", "hold [[stall]]"))
        running = "tokenspout_gateway_model_generations_running"
        await until_sample(http, metrics, 1.0, running, "alpha never ran", model="alpha")
        waiting = asyncio.create_task(_chat(client, "alpha", "waits its turn"))
        queued = "tokenspout_gateway_model_generations_queued"
        await until_sample(
            http, metrics, 1.0, queued, "the second alpha request was not queued", model="alpha"
        )
    began = time.monotonic()
    beta = await _chat(client, "beta", "not delayed")
    assert time.monotonic() - began < 2.0
    assert "".join(c.choices[0].delta.content or "" for c in beta if c.choices)
    with pytest.raises(openai.RateLimitError, match="'alpha'"):
        await _chat(client, "alpha", "one too many")
    assert not waiting.done() and not stalled.done()
    for task in (stalled, waiting):
        task.cancel()
    await asyncio.gather(stalled, waiting, return_exceptions=True)


async def test_a_model_whose_last_worker_left_ends_its_queue_and_refuses_new_requests(
    stack: Stack,
) -> None:
    alpha = stack.synthetic(200, "--served-model-name", "alpha", "--capacity", "1")
    stack.synthetic(200, "--served-model-name", "beta")
    base = stack.gateway(TOKENSPOUT_QUEUE_TIMEOUT_S="2", TOKENSPOUT_WORKER_TIMEOUT_S="2").url
    async with httpx.AsyncClient(timeout=30) as http:
        created = await http.post(f"{base}/v1/sessions", json={"model": "alpha"})
        body = created.json()
        headers = {"X-Session-Token": body["token"]}
        other = await http.post(f"{base}/v1/sessions", json={"model": "alpha"})
        other_headers = {"X-Session-Token": other.json()["token"]}
        messages = f"{base}/v1/sessions/{body['session_id']}/messages"
        other_messages = f"{base}/v1/sessions/{other.json()['session_id']}/messages"
        running = await http.post(messages, json={"content": "[[stall]]"}, headers=headers)
        queued = await http.post(other_messages, json={"content": "later"}, headers=other_headers)
        assert running.status_code == queued.status_code == 202
        processes.kill(alpha)

        deadline = time.monotonic() + 20
        while (await http.get(f"{base}/v2/models/alpha/ready")).status_code != 503:
            assert time.monotonic() < deadline, "alpha still ready after its worker left"
            await asyncio.sleep(0.1)
        refused = await http.post(messages, json={"content": "anyone?"}, headers=headers)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "model_unavailable"
        assert "'alpha'" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) > 0
        client = _client(base)
        with pytest.raises(openai.InternalServerError) as caught:
            await client.completions.create(model="alpha", prompt="hi", max_tokens=2)
        assert caught.value.status_code == 503
        assert (await http.get(f"{base}/ready")).json()["models"] == {"alpha": 0, "beta": 1}
        assert await _chat(client, "beta", "still here")

        session = Session(base, other.json()["session_id"], other.json()["token"])
        gid = queued.json()["generation_id"]
        reading = await read_events(http, session, until_final_of=gid, timeout_s=20)
        assert reading.final(gid).json()["code"] == "queue_timeout"


async def test_a_websocket_generate_names_the_model_of_the_session_it_creates(
    stack: Stack,
) -> None:
    base = _two_models(stack)
    ws = await open_ws(base)
    try:
        ack = await ws.generate("q", "over a socket", max_tokens=3, model="bee")
        assert ack["type"] == "ack"
        await ws.final_of("q")
        (started,) = [f for f in ws.frames["q"] if f["type"] == "started"]
        assert started["model"] == "beta"
        refused = await ws.generate("r", "nobody", model="gpt-4")
        assert refused["type"] == "error" and refused["code"] == "model_not_found"
        unnamed = await ws.generate("s", "which one")
        assert unnamed["type"] == "error" and unnamed["code"] == "model_required"
    finally:
        await ws.conn.close()
