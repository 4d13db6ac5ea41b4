"""The TGI-compatible API (gateway/apis/tgi.py) driven by ``huggingface_hub``'s
``InferenceClient`` and ``AsyncInferenceClient``, against a real gateway, real Redis and the
synthetic engine."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from huggingface_hub import AsyncInferenceClient, InferenceClient
from huggingface_hub.errors import (
    GenerationError,
    HfHubHTTPError,
    OverloadedError,
    UnknownError,
    ValidationError,
)

from tests.support.oracle import synthetic_text, synthetic_tokens
from tests.support.stack import Stack

pytestmark = pytest.mark.timeout(120)


def test_sync_client_streams_tokens_with_ids_logprobs_and_final_details(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    client = InferenceClient(model=f"{gateway.url}/generate")
    expected = synthetic_tokens("hello there", 6)

    events = list(
        client.text_generation("hello there", max_new_tokens=6, stream=True, details=True, seed=7)
    )
    assert [e.token.text for e in events] == [t.text for t in expected]
    assert [e.token.id for e in events] == [t.id for t in expected]
    assert [e.token.logprob for e in events] == [t.logprob for t in expected]
    assert [e.index for e in events] == list(range(1, 7))
    assert not any(e.token.special for e in events)
    # Only the last event carries the whole text and the details.
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    last = events[-1]
    assert last.generated_text == synthetic_text("hello there", 6)
    assert last.details is not None
    assert last.details.finish_reason == "length"
    assert last.details.generated_tokens == 6
    assert last.details.input_length == 2
    assert last.details.seed == 7

    plain = list(client.text_generation("hello there", max_new_tokens=3, stream=True))
    assert plain == [t.text for t in expected[:3]]


def test_sync_client_answers_whole_with_details_stop_and_full_text(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    client = InferenceClient(model=f"{gateway.url}/generate")
    full = synthetic_text("hi", 20)

    whole = client.text_generation("hi", max_new_tokens=20, stop=["lazy"], details=True)
    assert whole.generated_text == full[: full.index("lazy")]
    assert whole.details is not None
    assert whole.details.finish_reason == "stop_sequence"
    assert whole.details.generated_tokens == 8
    assert [t.logprob for t in whole.details.tokens] == [
        t.logprob for t in synthetic_tokens("hi", 8)
    ]
    assert [t.id for t in whole.details.tokens] == [t.id for t in synthetic_tokens("hi", 8)]

    text = client.text_generation("hi", max_new_tokens=4, return_full_text=True)
    assert text == "hi" + synthetic_text("hi", 4)
    assert client.text_generation("hi", max_new_tokens=2, do_sample=True, top_k=5) == (
        synthetic_text("hi", 2)
    )

    with pytest.raises(ValidationError, match="watermark"):
        client.text_generation("hi", max_new_tokens=2, watermark=True)
    with pytest.raises(ValidationError, match="typical_p"):
        client.text_generation("hi", max_new_tokens=2, typical_p=0.5, stream=True)
    # repetition_penalty reaches the engine (the synthetic one says it ignores it).
    assert client.text_generation("hi", max_new_tokens=2, repetition_penalty=1.3) == (
        synthetic_text("hi", 2)
    )


async def test_async_client_streams_and_generate_stream_route_matches(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    expected = synthetic_tokens("async please", 5)
    for url in (f"{gateway.url}/generate", f"{gateway.url}/generate_stream"):
        client = AsyncInferenceClient(model=url)
        try:
            stream = await client.text_generation(
                "async please", max_new_tokens=5, stream=True, details=True
            )
            events = [event async for event in stream]
        finally:
            await client.close()
        assert [e.token.text for e in events] == [t.text for t in expected]
        assert [e.token.logprob for e in events] == [t.logprob for t in expected]
        assert events[-1].details is not None and events[-1].details.finish_reason == "length"
        assert events[-1].generated_text == "".join(t.text for t in expected)


async def test_overload_answers_429_overloaded_which_the_client_raises(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway(TOKENSPOUT_MAX_INFLIGHT="1")
    # One generation that never ends holds the only in-flight slot (TGI writes a token
    # when the next one comes, so the stall comes after two).
    async with (
        httpx.AsyncClient(timeout=30) as raw,
        raw.stream(
            "POST",
            f"{gateway.url}/generate_stream",
            json={"inputs": "hold [[stall:2]]", "parameters": {"max_new_tokens": 50}},
        ) as held,
    ):
        assert held.status_code == 200
        lines = held.aiter_lines()
        while not (await asyncio.wait_for(anext(lines), 30)).startswith("data:"):
            pass
        refused = await raw.post(f"{gateway.url}/generate", json={"inputs": "hi"})
        assert refused.status_code == 429
        assert refused.json()["error_type"] == "overloaded"
        assert refused.headers["retry-after"]
        client = AsyncInferenceClient(model=f"{gateway.url}/generate")
        try:
            with pytest.raises(OverloadedError):
                await client.text_generation("hi", max_new_tokens=2)
        finally:
            await client.close()
    # The held stream closed: its generation is aborted and the slot frees up.
    client = AsyncInferenceClient(model=f"{gateway.url}/generate")
    try:
        for _ in range(100):
            try:
                text = await client.text_generation("hi", max_new_tokens=2)
                break
            except OverloadedError:
                await asyncio.sleep(0.1)
        assert text == synthetic_text("hi", 2)
    finally:
        await client.close()


def test_an_engine_failure_mid_stream_raises_generation_error(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    client = InferenceClient(model=f"{gateway.url}/generate_stream")
    texts = []
    with pytest.raises(GenerationError, match="synthetic failure"):
        for text in client.text_generation("break [[fail:3]]", max_new_tokens=10, stream=True):
            texts.append(text)
    # Every token the engine made arrives before the error.
    assert texts == ["You", " said:", " break"]


def test_a_wrong_api_key_raises_unknown_error_from_a_401(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway(TOKENSPOUT_API_KEYS="tgi-key")
    wrong = InferenceClient(model=f"{gateway.url}/generate", token="wrong")
    # TGI has no 401 error type: huggingface_hub raises UnknownError for the gateway's
    # `invalid_api_key`, chained to the HTTP error that holds the status.
    for stream in (False, True):
        with pytest.raises(UnknownError, match="API key") as caught:
            wrong.text_generation("hi", max_new_tokens=2, stream=stream)
        cause = caught.value.__cause__
        assert isinstance(cause, HfHubHTTPError) and cause.response is not None
        assert cause.response.status_code == 401
        assert cause.response.json()["error_type"] == "invalid_api_key"
    right = InferenceClient(model=f"{gateway.url}/generate", token="tgi-key")
    assert right.text_generation("hi", max_new_tokens=2) == synthetic_text("hi", 2)


def test_a_client_pointed_at_the_base_url_streams_answers_whole_and_reads_info(
    stack: Stack,
) -> None:
    """TGI's documentation points clients at the server's root: ``POST /`` (by ``stream``)
    and ``GET /info``; the web chat stays at ``GET /``."""
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    client = InferenceClient(gateway.url)
    expected = synthetic_tokens("from the root", 5)

    events = list(
        client.text_generation("from the root", max_new_tokens=5, stream=True, details=True)
    )
    assert [e.token.text for e in events] == [t.text for t in expected]
    assert events[-1].details is not None and events[-1].details.finish_reason == "length"
    assert events[-1].generated_text == synthetic_text("from the root", 5)

    whole = client.text_generation("from the root", max_new_tokens=5, details=True)
    assert whole.generated_text == synthetic_text("from the root", 5)
    assert whole.details is not None and whole.details.generated_tokens == 5
    assert [t.id for t in whole.details.tokens] == [t.id for t in expected]

    info = InferenceClient(gateway.url, provider="hf-inference").get_endpoint_info()
    assert info["model_id"] == "synthetic"
    assert info["max_input_tokens"] < info["max_total_tokens"]
    assert info["max_stop_sequences"] == 8 and info["max_best_of"] == 1
    assert info["router"] == "tokenspout" and info["version"]
    page = httpx.get(f"{gateway.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    bad = httpx.post(f"{gateway.url}/", json={"inputs": ""})
    assert bad.status_code == 422 and bad.json()["error_type"] == "validation"


def test_top_n_tokens_give_each_tokens_alternatives_stream_and_whole(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    client = InferenceClient(gateway.url)
    expected = synthetic_tokens("alternatives", 4)
    events = list(
        client.text_generation(
            "alternatives", max_new_tokens=4, stream=True, details=True, top_n_tokens=3
        )
    )
    assert [len(e.top_tokens or []) for e in events] == [3, 3, 3, 3]
    # The sampled token first (the synthetic engine's own is its most likely), each less
    # likely than the one before.
    assert [e.top_tokens[0].id for e in events] == [t.id for t in expected]  # type: ignore[index]
    for event in events:
        logprobs = [top.logprob for top in event.top_tokens or []]
        assert logprobs == sorted(logprobs, reverse=True)
    whole = client.text_generation("alternatives", max_new_tokens=4, details=True, top_n_tokens=2)
    assert whole.details is not None
    assert [len(tops) for tops in whole.details.top_tokens or []] == [2, 2, 2, 2]
    assert [t.logprob for t in whole.details.tokens] == [t.logprob for t in expected]
    plain = client.text_generation("alternatives", max_new_tokens=2, details=True)
    assert plain.details is not None and not plain.details.top_tokens
