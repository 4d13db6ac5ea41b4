"""The Open Inference Protocol generate extension (gateway/apis/oip/routes.py) over httpx, against
a real gateway, real Redis and the synthetic engine."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.http import slot_held
from tests.support.oracle import synthetic_text
from tests.support.sse import parse
from tests.support.stack import Stack

pytestmark = pytest.mark.timeout(120)


async def test_generate_and_generate_stream_return_the_engine_text(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    base = f"{gateway.url}/v2/models/synthetic"
    body = {"text_input": "open protocol", "parameters": {"max_tokens": 6, "stop": "never"}}
    async with httpx.AsyncClient(timeout=30) as client:
        whole = await client.post(f"{base}/generate", json={**body, "id": "req-1"})
        assert whole.status_code == 200, whole.text
        assert whole.json() == {
            "model_name": "synthetic",
            "text_output": synthetic_text("open protocol", 6),
            "finish_reason": "length",
            "id": "req-1",
        }

        async with client.stream("POST", f"{base}/generate_stream", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = [event.json() async for event in parse(response.aiter_lines())]
        assert {e["model_name"] for e in events} == {"synthetic"}
        assert "".join(e["text_output"] for e in events) == synthetic_text("open protocol", 6)
        assert len(events) == 7  # one per token, then the ending
        assert events[-1]["finish_reason"] == "length"
        assert all("finish_reason" not in e for e in events[:-1])


async def test_ready_says_whether_a_live_worker_serves_the_model_and_404s_others(
    stack: Stack,
) -> None:
    gateway = stack.gateway()
    async with httpx.AsyncClient(timeout=30) as client:
        before = await client.get(f"{gateway.url}/v2/models/synthetic/ready")
        assert before.status_code == 503 and before.json() == {"name": "synthetic", "ready": False}
        stack.synthetic()
        ready = await client.get(f"{gateway.url}/v2/models/synthetic/ready")
        assert ready.status_code == 200 and ready.json() == {"name": "synthetic", "ready": True}
        other = await client.get(f"{gateway.url}/v2/models/llama/ready")
        assert other.status_code == 404 and "synthetic" in other.json()["error"]


async def test_bad_requests_answer_the_protocol_error_shape(stack: Stack) -> None:
    stack.synthetic()
    gateway = stack.gateway()
    base = f"{gateway.url}/v2/models/synthetic"
    async with httpx.AsyncClient(timeout=30) as client:
        for body in (
            {"text_input": "hi", "parameters": {"temperature": -1}},
            {"text_input": "hi", "parameters": {"beam_width": 4}},
            {"text_input": "  "},
            {"inputs": "hi"},
        ):
            response = await client.post(f"{base}/generate_stream", json=body)
            assert response.status_code == 422, body
            error = response.json()
            assert list(error) == ["error"] and isinstance(error["error"], str) and error["error"]
        unknown = await client.post(
            f"{base}/generate", json={"text_input": "hi", "parameters": {"beam_width": 4}}
        )
        assert "beam_width" in unknown.json()["error"]


async def test_with_api_keys_a_missing_or_wrong_key_answers_401(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway(TOKENSPOUT_API_KEYS="oip-key")
    base = f"{gateway.url}/v2/models/synthetic"
    body = {"text_input": "hi", "parameters": {"max_tokens": 2}}
    async with httpx.AsyncClient(timeout=30) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            for path in ("generate", "generate_stream"):
                refused = await client.post(f"{base}/{path}", json=body, headers=headers)
                assert refused.status_code == 401, (path, headers)
                error = refused.json()
                assert list(error) == ["error"] and "API key" in error["error"]
            ready = await client.get(f"{base}/ready", headers=headers)
            assert ready.status_code == 401
        keyed = {"Authorization": "Bearer oip-key"}
        answered = await client.post(f"{base}/generate", json=body, headers=keyed)
        assert answered.status_code == 200, answered.text
        assert answered.json()["text_output"] == synthetic_text("hi", 2)
        assert (await client.get(f"{base}/ready", headers=keyed)).status_code == 200


async def test_too_many_generations_in_flight_answer_429_with_retry_after(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway(TOKENSPOUT_MAX_INFLIGHT="1")
    base = f"{gateway.url}/v2/models/synthetic"
    body = {"text_input": "hi", "parameters": {"max_tokens": 2}}
    async with httpx.AsyncClient(timeout=30) as client:
        async with slot_held(gateway.url):
            for path in ("generate", "generate_stream"):
                refused = await client.post(f"{base}/{path}", json=body)
                assert refused.status_code == 429, path
                assert refused.headers["retry-after"] == "1"
                error = refused.json()
                assert list(error) == ["error"] and "in flight" in error["error"]
        # The held generation was cancelled; its slot frees up once its worker lets it go.
        for _ in range(100):
            answered = await client.post(f"{base}/generate", json=body)
            if answered.status_code != 429:
                break
            await asyncio.sleep(0.1)
        assert answered.status_code == 200, answered.text
        assert answered.json()["text_output"] == synthetic_text("hi", 2)
