"""The OpenAI-compatible API (gateway/apis/openai/routes.py) driven by the official ``openai`` SDK,
sync and async, against a real gateway process, real Redis and the synthetic engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.support import metrics
from tests.support.http import slot_held
from tests.support.oracle import synthetic_text, synthetic_tokens
from tests.support.stack import Stack

pytestmark = pytest.mark.timeout(120)

MESSAGES: list[dict[str, str]] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello there"},
]


def test_sync_chat_streams_deltas_a_usage_chunk_and_answers_whole_alike(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
        chunks = list(
            client.chat.completions.create(
                model="synthetic",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert {c.object for c in chunks} == {"chat.completion.chunk"}
        assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
        assert {c.model for c in chunks} == {"synthetic"}
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == synthetic_text("hello there", 6)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
        # include_usage: one last chunk with no choices and the usage; the others carry none.
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
        usage = chunks[-1].usage
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (4, 6)
        assert usage.total_tokens == 10

        whole = client.chat.completions.create(
            model="synthetic",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_completion_tokens=6,
        )
        assert whole.object == "chat.completion"
        assert whole.choices[0].message.role == "assistant"
        assert whole.choices[0].message.content == text
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage is not None and whole.usage.completion_tokens == 6


def test_sync_chat_stops_at_a_stop_sequence_and_returns_engine_logprobs(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
        full = synthetic_text("hi", 20)

        stream = client.chat.completions.create(
            model="synthetic",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=20,
            stop="lazy",
            stream=True,
            logprobs=True,
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == full[: full.index("lazy")]
        assert chunks[-1].choices[0].finish_reason == "stop"
        logprobs = [
            entry.logprob
            for c in chunks
            if c.choices[0].logprobs and c.choices[0].logprobs.content
            for entry in c.choices[0].logprobs.content
        ]
        # The synthetic engine's own logprobs, one per token it produced (the stop one too).
        assert logprobs == [t.logprob for t in synthetic_tokens("hi", 8)]

        whole = client.chat.completions.create(
            model="synthetic",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=20,
            stop=["dog", "streams"],
            logprobs=True,
        )
        assert whole.choices[0].message.content == full[: full.index("dog")]
        assert whole.choices[0].finish_reason == "stop"
        assert whole.choices[0].logprobs is not None
        content = whole.choices[0].logprobs.content or []
        assert [entry.logprob for entry in content] == [
            t.logprob for t in synthetic_tokens("hi", 9)
        ]


async def test_async_completions_stream_and_whole_match_the_engine(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    expected = synthetic_tokens("tell me a story", 7)
    try:
        stream = await client.completions.create(
            model="synthetic",
            prompt="tell me a story",
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=0,
            seed=3,
            temperature=0.2,
            top_p=0.9,
            frequency_penalty=0.5,
            presence_penalty=0.5,
            user="tester",
            extra_body={"top_k": 20},
        )
        chunks = [chunk async for chunk in stream]
        assert {c.object for c in chunks} == {"text_completion"}
        assert "".join(c.choices[0].text for c in chunks if c.choices) == "".join(
            t.text for t in expected
        )
        token_logprobs = [
            lp
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for lp in c.choices[0].logprobs.token_logprobs or []
        ]
        assert token_logprobs == [t.logprob for t in expected]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
        assert chunks[-1].usage.prompt_tokens == 4

        whole = await client.completions.create(
            model="synthetic", prompt=["tell me a story"], max_tokens=7
        )
        assert whole.object == "text_completion"
        assert whole.choices[0].text == "".join(t.text for t in expected)
        assert whole.choices[0].finish_reason == "length"
        assert whole.model == "synthetic"
    finally:
        await client.close()


async def test_async_client_sees_unsupported_and_invalid_parameters_as_400(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    chat = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}]}
    try:
        cases: list[tuple[dict[str, object], str]] = [
            ({"n": 17}, "n"),  # past TOKENSPOUT_MAX_CHOICES
            ({"temperature": 5}, "temperature"),
            ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
            ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
            ({"max_tokens": 10**6}, "max_tokens"),
            ({"extra_body": {"guided_json": {"type": 5}}}, "guided_json"),
            ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
            ({"logit_bias": {"word": 1}}, "logit_bias"),
        ]
        for extra, param in cases:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(**chat, **extra)  # type: ignore[call-overload]
            assert caught.value.status_code == 400
            body = caught.value.body
            assert isinstance(body, dict)
            assert body["type"] == "invalid_request_error" and body["param"] == param, body
            assert body["message"]
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model="synthetic", prompt="hi", echo=True)
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "echo"
        # A refused request started nothing; a valid one still works.
        ok = await client.chat.completions.create(**chat, max_tokens=2)  # type: ignore[call-overload]
        assert ok.choices[0].message.content == synthetic_text("hi", 2)
    finally:
        await client.close()


async def test_api_keys_refuse_a_wrong_or_missing_key_with_401_and_list_models(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway(TOKENSPOUT_API_KEYS="key-one,key-two")
    wrong = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="nope", max_retries=0)
    right = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="key-two", max_retries=0)
    try:
        with pytest.raises(openai.AuthenticationError) as caught:
            await wrong.chat.completions.create(
                model="synthetic", messages=[{"role": "user", "content": "hi"}]
            )
        assert caught.value.status_code == 401
        assert isinstance(caught.value.body, dict)
        assert caught.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()
        async with httpx.AsyncClient() as raw:
            missing = await raw.post(f"{gateway.url}/generate", json={"inputs": "hi"})
            assert missing.status_code == 401
            assert missing.json()["error"]
            answered = await raw.post(
                f"{gateway.url}/v1/completions",
                json={"model": "synthetic", "prompt": "hi", "max_tokens": 2},
                headers={"Authorization": "Bearer key-one"},
            )
            assert answered.status_code == 200, answered.text
            assert answered.json()["choices"][0]["text"] == synthetic_text("hi", 2)

        models = await right.models.list()
        assert [m.id for m in models.data] == ["synthetic"]
        reply = await right.chat.completions.create(
            model="synthetic", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert reply.choices[0].message.content == synthetic_text("hi", 3)
    finally:
        await wrong.close()
        await right.close()


def test_an_engine_failure_reaches_the_sdk_as_an_error_in_and_out_of_streams(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
        messages = [{"role": "user", "content": "break [[fail:2]]"}]

        received = []
        with pytest.raises(openai.APIError, match="synthetic failure") as caught:
            for chunk in client.chat.completions.create(
                model="synthetic",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=10,
                stream=True,
            ):
                received.append(chunk.choices[0].delta.content)
        assert received == ["You", " said:"]
        assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "engine_error"

        with pytest.raises(openai.InternalServerError) as whole:
            client.chat.completions.create(
                model="synthetic",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=10,
            )
        assert whole.value.status_code == 503


def test_sync_completions_stream_and_whole_end_at_a_stop_sequence(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
        full = synthetic_text("hi", 20)
        assert "lazy" in full and full.index("dog") < full.index("streams")

        chunks = list(
            client.completions.create(
                model="synthetic",
                prompt="hi",
                max_tokens=20,
                stop="lazy",
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert {c.object for c in chunks} == {"text_completion"}
        assert len({c.id for c in chunks}) == 1
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full[: full.index("lazy")]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        # The engine made the stop sequence's token too (8 in all); none of its text is sent.
        assert chunks[-1].usage.completion_tokens == 8

        whole = client.completions.create(
            model="synthetic", prompt="hi", max_tokens=20, stop=["streams", "dog"]
        )
        assert whole.object == "text_completion"
        assert whole.choices[0].text == full[: full.index("dog")]
        assert whole.choices[0].finish_reason == "stop"
        assert whole.usage is not None and whole.usage.prompt_tokens == 1

        # Without a stop sequence it runs to max_tokens.
        plain = client.completions.create(model="synthetic", prompt="hi", max_tokens=5)
        assert plain.choices[0].text == synthetic_text("hi", 5)
        assert plain.choices[0].finish_reason == "length"


async def test_async_chat_streams_deltas_and_a_usage_chunk(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="synthetic",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    finally:
        await client.close()
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    deltas = [c.choices[0].delta.content for c in chunks if c.choices]
    # One delta per token (the synthetic engine makes one per step), then the finish chunk.
    assert deltas[:-1] == [t.text for t in synthetic_tokens("hello there", 5)]
    assert not deltas[-1]
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (4, 5)


async def test_too_many_generations_in_flight_raise_rate_limit_error(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway(TOKENSPOUT_MAX_INFLIGHT="1")
    chat: dict[str, Any] = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
        async with slot_held(gateway.url):
            for stream in (False, True):
                with pytest.raises(openai.RateLimitError) as caught:
                    await asyncio.to_thread(client.chat.completions.create, **chat, stream=stream)
                assert caught.value.status_code == 429
                assert caught.value.response.headers["retry-after"] == "1"
                body = caught.value.body
                assert isinstance(body, dict), body
                assert body["type"] == "rate_limit_error" and body["code"] == "overloaded"
                assert "in flight" in body["message"]
            with pytest.raises(openai.RateLimitError):
                await asyncio.to_thread(
                    client.completions.create, model="synthetic", prompt="hi", max_tokens=2
                )
        # The held generation was cancelled: its slot frees up once its worker acknowledges
        # the request (just after the final event the cancel waited for).
        for _ in range(100):
            try:
                reply = await asyncio.to_thread(client.chat.completions.create, **chat)
                break
            except openai.RateLimitError:
                await asyncio.sleep(0.1)
        assert reply.choices[0].message.content == synthetic_text("hi", 2)


async def test_a_chat_with_more_messages_than_a_session_may_hold_is_refused(stack: Stack) -> None:
    """``messages`` is capped like a session's history (TOKENSPOUT_MAX_HISTORY_MESSAGES)."""
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway(TOKENSPOUT_MAX_HISTORY_MESSAGES="4")
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(5)]
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="synthetic", messages=turns)  # type: ignore[arg-type]
        assert caught.value.status_code == 400
        body = caught.value.body
        assert isinstance(body, dict)
        assert (body["type"], body["param"], body["code"]) == (
            "invalid_request_error",
            "messages",
            "too_many_messages",
        )
        ok = await client.chat.completions.create(
            model="synthetic",
            messages=turns[:4],  # type: ignore[arg-type]
            max_tokens=2,
        )
        assert ok.choices[0].finish_reason == "length"
    finally:
        await client.close()


def test_vllms_extra_sampling_fields_reach_the_engine_through_extra_body(stack: Stack) -> None:
    """Clients moving from ``vllm serve`` send vLLM's fields through ``extra_body``; the
    synthetic engine honours those that shape its script and logs the ones it ignores."""
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    full = synthetic_text("hi", 20)  # "You said: hi | jumps over the lazy dog while streams"

    def complete(**extra: Any) -> openai.types.Completion:
        return client.completions.create(
            model="synthetic", prompt="hi", max_tokens=20, stop=["lazy"], extra_body=extra
        )

    assert complete().choices[0].text == full[: full.index("lazy")]
    kept = complete(include_stop_str_in_output=True).choices[0].text
    assert kept == full[: full.index("lazy") + len("lazy")]
    # min_tokens: no stop before it ("lazy" is token 8); then token 11 is a stop token.
    later = complete(min_tokens=9, stop_token_ids=[synthetic_tokens("hi", 11)[10].id])
    assert later.choices[0].finish_reason == "stop"
    assert later.usage is not None and later.usage.completion_tokens == 11
    assert later.choices[0].text == synthetic_text("hi", 10)
    ignored = complete(
        min_p=0.1,
        repetition_penalty=1.2,
        ignore_eos=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        length_penalty=1.0,
    )
    assert ignored.choices[0].text == full[: full.index("lazy")]
    (engine_log,) = stack.logs.glob("engine-*.log")
    assert "ignores min_p, repetition_penalty" in engine_log.read_text()

    for field, value in (("length_penalty", 2.0), ("use_beam_search", True)):
        with pytest.raises(openai.BadRequestError) as caught:
            complete(**{field: value})
        assert caught.value.body["param"] == field  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        complete(min_tokens=21)
    with pytest.raises(openai.BadRequestError) as caught:
        complete(min_p=2)
    assert caught.value.body["param"] == "min_p"  # type: ignore[index]
    client.close()


def chat_piece(chunk: dict[str, Any]) -> str:
    return str(chunk["choices"][0]["delta"].get("content", ""))


def completion_piece(chunk: dict[str, Any]) -> str:
    return str(chunk["choices"][0].get("text", ""))


@pytest.mark.parametrize(
    ("path", "asked", "id_prefix", "piece", "whole_text"),
    [
        pytest.param(
            "/v1/chat/completions",
            {"messages": MESSAGES},
            "chatcmpl-",
            chat_piece,
            lambda answer: answer["choices"][0]["message"]["content"],
            id="chat",
        ),
        pytest.param(
            "/v1/completions",
            {"prompt": "hello there"},
            "cmpl-",
            completion_piece,
            lambda answer: answer["choices"][0]["text"],
            id="completion",
        ),
    ],
)
async def test_a_hot_route_answers_what_the_app_answers_and_is_counted_alike(
    stack: Stack,
    path: str,
    asked: dict[str, Any],
    id_prefix: str,
    piece: Callable[[dict[str, Any]], str],
    whole_text: Callable[[dict[str, Any]], str],
) -> None:
    """A chat or (legacy) completion takes its hot route (gateway/apis/openai/hot.py); with CORS
    configured, a browser's cross-origin one goes through Litestar. Both answer the same
    headers (but CORS's) and the same chunks, or the same whole answer (but their ids and
    times), and both are counted under the route's template."""
    stack.synthetic(tokens_per_s=200)
    origin = "https://chat.example"
    gateway = stack.gateway(TOKENSPOUT_CORS_ORIGINS=origin)
    request = {
        "model": "synthetic",
        **asked,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    url = f"{gateway.url}{path}"

    async def streamed(headers: dict[str, str]) -> tuple[httpx.Headers, list[dict[str, Any]]]:
        async with client.stream("POST", url, json=request, headers=headers) as response:
            assert response.status_code == 200, await response.aread()
            lines = [line async for line in response.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        for chunk in chunks:
            assert chunk.pop("id").startswith(id_prefix) and chunk.pop("created") > 0
        return response.headers, chunks

    async def whole(headers: dict[str, str]) -> tuple[httpx.Headers, dict[str, Any]]:
        response = await client.post(url, json={**request, "stream": False}, headers=headers)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer.pop("id").startswith(id_prefix) and answer.pop("created") > 0
        return response.headers, answer

    async with httpx.AsyncClient(timeout=30) as client:
        hot_headers, hot_chunks = await streamed({})
        app_headers, app_chunks = await streamed({"Origin": origin})
        hot_whole_headers, hot_whole = await whole({})
        app_whole_headers, app_whole = await whole({"Origin": origin})
        samples = await metrics.scrape(client, f"{gateway.url}/metrics")
    assert app_headers["access-control-allow-origin"] == origin
    assert "access-control-allow-origin" not in hot_headers

    def comparable(headers: httpx.Headers) -> dict[str, str]:
        return {
            name: value
            for name, value in headers.items()
            if name not in ("date", "x-request-id", "vary") and not name.startswith("access-")
        }

    expected = synthetic_text("hello there", 5)
    assert comparable(hot_headers) == comparable(app_headers)
    assert hot_headers["content-type"] == "text/event-stream; charset=utf-8"
    assert hot_chunks == app_chunks
    assert "".join(piece(c) for c in hot_chunks if c["choices"]) == expected
    assert comparable(hot_whole_headers) == comparable(app_whole_headers)
    assert hot_whole_headers["content-type"] == "application/json"
    assert hot_whole == app_whole
    assert whole_text(hot_whole) == expected
    assert hot_whole["usage"]["completion_tokens"] == 5
    counted = metrics.value(
        samples, "tokenspout_gateway_requests_total", method="POST", route=path, status="200"
    )
    assert counted == 4
