"""Function calling through the gateway, with the official ``openai`` SDK over real
gateway processes and real Redis: a named function and ``required`` give arguments that
validate against the function's parameters (the engine is constrained to them), stream and
whole alike; ``auto`` finds calls with the worker's tool parser; calls and their results
in the history reach the chat template; a named call survives its worker killed mid-reply.
Both backends where the engine matters (the ``engine`` fixture)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from stack import processes
from tests.support.engines import EngineUnderTest
from tests.support.oracle import synthetic_text
from tests.support.redis_probes import lease_trusted
from tests.support.stack import Stack

pytestmark = pytest.mark.timeout(900)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _ask(model: str, content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "tools": TOOLS,
        "max_tokens": 80,
        **extra,
    }


async def _streamed_calls(stream: Any) -> tuple[dict[int, dict[str, str]], str | None, str]:
    """The calls a stream made, assembled from its ``delta.tool_calls`` pieces, with its
    finish reason and content."""
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                if piece.id:
                    assert not call["id"], "a call's id comes once, in its first piece"
                    call["id"] = piece.id
                    call["name"] = piece.function.name
                call["arguments"] += piece.function.arguments or ""
    return calls, finish, content


async def test_a_named_function_gives_valid_arguments_stream_and_whole(
    engine: EngineUnderTest,
) -> None:
    client = _client(engine.url)
    try:
        whole = await client.chat.completions.create(
            **_ask(engine.model, "What is the weather in Paris?", tool_choice=NAMED),
            **engine.sampling,
        )
        choice = whole.choices[0]
        assert choice.finish_reason == "stop"  # as OpenAI ends a named call
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)  # type: ignore[union-attr]
        assert calls[0].id.startswith("call_")

        stream = await client.chat.completions.create(
            **_ask(engine.model, "What is the weather in Paris?", tool_choice=NAMED, stream=True),
            **engine.sampling,
        )
        streamed, finish, content = await _streamed_calls(stream)
        assert finish == "stop" and content == ""
        assert [c["name"] for c in streamed.values()] == ["get_weather"]
        jsonschema.validate(json.loads(streamed[0]["arguments"]), WEATHER)
        if engine.backend == "vllm":  # greedy: the same call as the whole answer
            assert streamed[0]["arguments"] == calls[0].function.arguments  # type: ignore[union-attr]
    finally:
        await client.close()


async def test_required_gives_one_valid_call_per_function_chosen(
    engine: EngineUnderTest,
) -> None:
    client = _client(engine.url)
    try:
        whole = await client.chat.completions.create(
            **_ask(
                engine.model,
                "What time is it in Tokyo?",
                tool_choice="required",
                parallel_tool_calls=False,
            ),
            **engine.sampling,
        )
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls or []
        assert len(calls) == 1  # parallel_tool_calls: false
        name = calls[0].function.name  # type: ignore[union-attr]
        jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[name])  # type: ignore[union-attr]

        stream = await client.chat.completions.create(
            **_ask(engine.model, "Weather in Oslo and the time there?", tool_choice="required"),
            stream=True,
            **engine.sampling,
        )
        streamed, finish, _ = await _streamed_calls(stream)
        assert finish == "tool_calls" and streamed
        assert [index for index in streamed] == list(range(len(streamed)))
        assert len({call["id"] for call in streamed.values()}) == len(streamed)
        for call in streamed.values():
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    finally:
        await client.close()


async def test_calls_and_their_results_in_the_history_reach_the_model(
    engine: EngineUnderTest,
) -> None:
    client = _client(engine.url)
    try:
        answer = await client.chat.completions.create(
            model=engine.model,
            messages=[
                {"role": "user", "content": "What is the weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {
                                "name": "get_weather",
                                "arguments": '{"city": "Paris", "unit": "celsius"}',
                            },
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
                {"role": "user", "content": [{"type": "text", "text": "So, how is it?"}]},
            ],
            tools=TOOLS,
            tool_choice="none",
            max_tokens=engine.short_max_tokens,
            **engine.sampling,
        )
        assert answer.choices[0].message.content
        assert not answer.choices[0].message.tool_calls
        # The history grew the prompt (the call and its result are in it).
        short = await client.chat.completions.create(
            model=engine.model,
            messages=[{"role": "user", "content": "So, how is it?"}],
            max_tokens=2,
            **engine.sampling,
        )
        assert answer.usage is not None and short.usage is not None
        assert answer.usage.prompt_tokens > short.usage.prompt_tokens + 5

        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=engine.model,
                messages=[{"role": "tool", "content": "orphan"}],
            )
        assert isinstance(caught.value.body, dict)
        assert caught.value.body["param"] == "messages[0].tool_call_id"
    finally:
        await client.close()


async def test_auto_finds_calls_with_the_workers_parser_and_refuses_without_one(
    stack: Stack,
) -> None:
    stack.synthetic(100, "--tool-call-parser", "hermes")
    with_parser = stack.gateway()
    client = _client(with_parser.url)
    call = '<tool_call>{"name": "get_time", "arguments": {"timezone": "UTC"}}</tool_call>'
    try:
        # The synthetic engine echoes the message, so the reply holds the call.
        whole = await client.chat.completions.create(**_ask("synthetic", call, max_tokens=8))
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "You said: "  # what precedes the call
        made = choice.message.tool_calls or []
        assert [(c.function.name, json.loads(c.function.arguments)) for c in made] == [  # type: ignore[union-attr]
            ("get_time", {"timezone": "UTC"})
        ]
        stream = await client.chat.completions.create(
            **_ask("synthetic", call, max_tokens=8, stream=True)
        )
        streamed, finish, content = await _streamed_calls(stream)
        assert finish == "tool_calls" and content == "You said: "
        assert streamed[0]["name"] == "get_time" and streamed[0]["id"].startswith("call_")

        plain = await client.chat.completions.create(**_ask("synthetic", "no call", max_tokens=4))
        assert plain.choices[0].finish_reason == "length"
        assert plain.choices[0].message.content == synthetic_text("no call", 4)
        assert not plain.choices[0].message.tool_calls
    finally:
        await client.close()

    other = Stack(stack.redis_url, stack.prefix + "-bare", stack.logs)
    try:
        other.synthetic(100)
        client = _client(other.gateway().url)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(**_ask("synthetic", "hi"))
        assert isinstance(caught.value.body, dict)
        assert caught.value.body["code"] == "auto_tool_choice_unsupported"
        await client.close()
    finally:
        other.stop()


async def test_bad_tools_are_refused_before_anything_is_queued(stack: Stack) -> None:
    stack.synthetic(100)
    client = _client(stack.gateway().url)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "tools[0].function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]},
            "tools[0].function.parameters",
        ),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ]
    try:
        for extra, param in bad:
            body = {**_ask("synthetic", "hi"), **extra}
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(**body)
            assert isinstance(caught.value.body, dict)
            assert caught.value.body["param"] == param, caught.value.body
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model="synthetic",
                messages=[{"role": "user", "content": "hi"}],
                tool_choice="required",
            )
    finally:
        await client.close()


async def test_a_named_call_taken_over_mid_reply_streams_the_same_arguments(
    stack: Stack,
) -> None:
    doomed = stack.synthetic(5)
    client = _client(stack.gateway().url)
    try:
        stream = await client.chat.completions.create(
            **_ask("synthetic", "weather?", tool_choice=NAMED, stream=True)
        )
        pieces: list[Any] = []
        killed = False
        async for chunk in stream:
            for choice in chunk.choices:
                pieces += choice.delta.tool_calls or []
            if not killed and len(pieces) >= 2:
                stack.synthetic(5)
                await lease_trusted(stack.redis_url)
                processes.kill(doomed)
                killed = True
        assert killed
    finally:
        await client.close()
    assert [p.id for p in pieces if p.id] == [pieces[0].id]  # one call, named once
    arguments = "".join(p.function.arguments or "" for p in pieces)
    assert json.loads(arguments) == {"city": "x", "unit": "celsius"}  # the synthetic instance
