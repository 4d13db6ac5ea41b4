"""What vLLM's own OpenAI server takes, through the gateway: ``n``, logprobs with
top alternatives, structured outputs, ``logit_bias`` and continuous usage, driven by the
official ``openai`` SDK against real gateway processes and real Redis, on both backends
(the synthetic engine, also on a Redis Cluster, and vLLM on the CPU: the ``engine`` fixture).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.support.engines import LONG, PROMPT, EngineUnderTest
from tests.support.oracle import synthetic_text

pytestmark = pytest.mark.timeout(900)

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer"},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}


def _client(engine: EngineUnderTest) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{engine.url}/v1", api_key="unused", max_retries=0)


def _chat(engine: EngineUnderTest, content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": engine.model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": engine.short_max_tokens,
        **engine.sampling,
        **extra,
    }


async def test_n_choices_stream_and_whole_each_with_its_index_finish_and_summed_usage(
    engine: EngineUnderTest,
) -> None:
    client = _client(engine)
    try:
        whole = await client.chat.completions.create(**_chat(engine, "Name a colour.", n=2))
        assert [choice.index for choice in whole.choices] == [0, 1]
        assert all(choice.message.content for choice in whole.choices)
        assert all(choice.finish_reason in ("stop", "length") for choice in whole.choices)
        assert whole.usage is not None
        # Each choice is a generation of its own; the prompt is counted once.
        stream = await client.chat.completions.create(
            **_chat(engine, "Name a colour.", n=2, stream=True),
            stream_options={"include_usage": True},
        )
        texts: dict[int, str] = {0: "", 1: ""}
        finishes: dict[int, list[str | None]] = {0: [], 1: []}
        roles: dict[int, int] = {0: 0, 1: 0}
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                finishes[choice.index].append(choice.finish_reason)
                roles[choice.index] += choice.delta.role == "assistant"
        assert roles == {0: 1, 1: 1}, "each choice's first delta carries the role, once"
        for index in (0, 1):
            assert finishes[index][-1] in ("stop", "length") and set(finishes[index][:-1]) == {None}
        assert usage is not None
        completion = usage.completion_tokens
        assert completion <= 2 * engine.short_max_tokens and usage.prompt_tokens > 0
        if engine.backend != "vllm":
            # The synthetic engine's script does not depend on the seed: both the same.
            assert texts[0] == texts[1] == synthetic_text("Name a colour.", 20)
            assert completion == 40
            assert whole.usage.completion_tokens == 40
        else:
            assert texts[0] == whole.choices[0].message.content  # greedy: the same reply
    finally:
        await client.close()


async def test_chat_logprobs_with_top_alternatives_stream_and_whole(
    engine: EngineUnderTest,
) -> None:
    client = _client(engine)
    try:
        whole = await client.chat.completions.create(
            **_chat(engine, "Say hello.", logprobs=True, top_logprobs=2)
        )
        content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None and whole.usage is not None
        assert len(content) == whole.usage.completion_tokens
        for entry in content:
            assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
            assert len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
            # The sampled token is at most as likely as the most likely one.
            assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-4
        if engine.backend == "vllm":  # greedy: the sampled token is the most likely
            assert all(e.token == e.top_logprobs[0].token for e in content)
        stream = await client.chat.completions.create(
            **_chat(engine, "Say hello.", logprobs=True, top_logprobs=2, stream=True)
        )
        streamed = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs is not None:
                streamed += chunk.choices[0].logprobs.content or []
        assert [(e.token, len(e.top_logprobs)) for e in streamed] == [(e.token, 2) for e in content]
    finally:
        await client.close()


async def test_completions_logprobs_give_tokens_offsets_and_top_alternatives(
    engine: EngineUnderTest,
) -> None:
    client = _client(engine)
    try:
        whole = await client.completions.create(
            model=engine.model,
            prompt="The sky is",
            max_tokens=8,
            logprobs=2,
            **engine.sampling,
        )
        logprobs = whole.choices[0].logprobs
        assert logprobs is not None and logprobs.tokens and logprobs.top_logprobs
        assert len(logprobs.tokens) == len(logprobs.token_logprobs or []) == 8
        assert len(logprobs.top_logprobs) == 8
        assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
        offsets = logprobs.text_offset or []
        assert offsets[0] == 0
        assert offsets == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(8)]
    finally:
        await client.close()


async def test_structured_outputs_in_every_spelling_give_valid_output(
    engine: EngineUnderTest,
) -> None:
    client = _client(engine)
    try:
        schema_format = {
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": CITY, "strict": True},
        }
        answers = await asyncio.gather(
            client.chat.completions.create(
                **_chat(
                    engine,
                    "Give a city and its population as JSON.",
                    max_tokens=60,
                    response_format=schema_format,
                )
            ),
            client.chat.completions.create(
                **_chat(
                    engine,
                    "Give a city as JSON.",
                    max_tokens=60,
                    extra_body={"structured_outputs": {"json": CITY}},
                )
            ),
            client.chat.completions.create(
                **_chat(
                    engine,
                    "Is the sky blue?",
                    max_tokens=10,
                    extra_body={"guided_choice": ["yes", "no"]},
                )
            ),
        )
        for answer in answers[:2]:
            assert answer.choices[0].finish_reason == "stop", answer
            jsonschema.validate(json.loads(answer.choices[0].message.content or ""), CITY)
        assert answers[2].choices[0].message.content in ("yes", "no")

        stream = await client.chat.completions.create(
            **_chat(
                engine,
                "Give a city as JSON.",
                max_tokens=60,
                response_format=schema_format,
                stream=True,
            )
        )
        chunks = [c async for c in stream if c.choices]
        assert chunks[-1].choices[0].finish_reason == "stop"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        jsonschema.validate(json.loads(text), CITY)
        # Any JSON object: unbounded, so the reply may be cut by max_tokens (SmolLM2 keeps
        # writing one for hundreds of tokens, with vLLM's own server too); it begins as an
        # object, and a reply that stops is one whole object.
        anything = await client.chat.completions.create(
            **_chat(
                engine,
                "Reply with an empty JSON object.",
                max_tokens=40,
                response_format={"type": "json_object"},
            )
        )
        text = anything.choices[0].message.content or ""
        assert text.lstrip().startswith("{"), text
        if anything.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)

        regex = {"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}
        if engine.backend == "vllm":
            answer = await client.chat.completions.create(
                **_chat(engine, "A phone number:", max_tokens=20, extra_body=regex)
            )
            assert re.fullmatch("[0-9]{3}-[0-9]{4}", answer.choices[0].message.content or "")
        else:  # a constraint the synthetic engine cannot script is a clear error
            with pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(
                    **_chat(engine, "A phone number:", extra_body=regex)
                )
            assert isinstance(caught.value.body, dict)
            assert caught.value.body["code"] == "unsupported_constraint"
    finally:
        await client.close()


async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(
    engine: EngineUnderTest,
) -> None:
    client = _client(engine)
    try:
        stream = await client.chat.completions.create(
            **_chat(engine, "Count to five.", stream=True),
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
        chunks = [chunk async for chunk in stream]
        usages = [chunk.usage for chunk in chunks]
        assert all(usage is not None for usage in usages)
        completion = [usage.completion_tokens for usage in usages if usage is not None]
        assert completion == sorted(completion) and completion[-1] > 0
        last = usages[-1]
        assert last is not None and last.total_tokens == last.prompt_tokens + completion[-1]
    finally:
        await client.close()


async def test_logit_bias_is_applied_by_vllm_and_refused_when_malformed(
    engine: EngineUnderTest,
) -> None:
    client = _client(engine)
    try:
        bad = {"logit_bias": {"not-a-token": 5}}
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(**_chat(engine, "hi", **bad))
        assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "logit_bias"
        # Token 30 pushed up by 100: vLLM samples nothing else (the synthetic engine's
        # script ignores it, as it ignores penalties; docs/api.md).
        answer = await client.completions.create(
            model=engine.model,
            prompt="Hello",
            max_tokens=4,
            logprobs=0,
            logit_bias={"30": 100},
            **engine.sampling,
        )
        assert answer.choices[0].finish_reason == "length"
        if engine.backend == "vllm":
            logprobs = answer.choices[0].logprobs
            assert logprobs is not None and logprobs.tokens is not None
            assert len(set(logprobs.tokens)) == 1, logprobs.tokens
    finally:
        await client.close()


async def test_closing_an_n_stream_stops_every_choice_in_the_engine(
    engine: EngineUnderTest,
) -> None:
    client = _client(engine)
    try:
        stream = await client.chat.completions.create(
            **_chat(engine, PROMPT, n=2, max_tokens=LONG, stream=True)
        )
        seen = 0
        async for chunk in stream:
            seen += len(chunk.choices)
            if seen >= 3:
                break
        await stream.close()
        await engine.stops(time.monotonic(), "n=2 stream closed")
    finally:
        await client.close()


async def test_tokenize_and_detokenize_answer_with_the_workers_tokenizer(
    engine: EngineUnderTest,
) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    client = _client(engine)
    try:
        chat = await client.chat.completions.create(
            model=engine.model, messages=messages, max_tokens=1, **engine.sampling
        )
    finally:
        await client.close()
    async with httpx.AsyncClient(timeout=120) as http:
        tokenized = (
            await http.post(
                f"{engine.url}/tokenize", json={"model": engine.model, "messages": messages}
            )
        ).json()
        # The same ids the engine saw: the chat template applied, counted as usage counts.
        assert chat.usage is not None and tokenized["count"] == chat.usage.prompt_tokens
        assert len(tokenized["tokens"]) == tokenized["count"]
        plain = (
            await http.post(
                f"{engine.url}/tokenize", json={"model": engine.model, "prompt": "Hello world"}
            )
        ).json()
        assert 0 < plain["count"] < tokenized["count"]
        back = await http.post(
            f"{engine.url}/detokenize", json={"model": engine.model, "tokens": plain["tokens"]}
        )
        if engine.backend == "vllm":
            assert plain["max_model_len"] == 2048
            assert back.status_code == 200 and back.json() == {"prompt": "Hello world"}
        else:  # the synthetic engine's ids are hashes of words: nothing to decode them with
            assert plain["max_model_len"] is None
            assert back.status_code == 400 and back.json()["error"]["code"] == "unsupported_task"
        # /v1/models reports the same context length the worker registered.
        models = (await http.get(f"{engine.url}/v1/models")).json()["data"]
        listed = next(model for model in models if model["id"] == engine.model)
        assert listed["max_model_len"] == plain["max_model_len"]
        bad = await http.post(f"{engine.url}/tokenize", json={"model": engine.model})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
