"""The OpenAI Responses API, with the official ``openai`` SDK over real gateway
processes and real Redis, the synthetic engine's script as the oracle: create (whole,
streamed, background), the events in OpenAI's order numbered from 0, a resume with
``starting_after`` on another replica that gives exactly the events after N, a cancel
through another replica, ``previous_response_id`` across replicas, a worker SIGKILLed
mid-response, delete, input items, ``store: false``, ``text.format`` and logprobs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from stack import processes
from tests.support.engines import EngineUnderTest
from tests.support.oracle import synthetic_text, synthetic_tokens
from tests.support.redis_probes import lease_trusted
from tests.support.responses import check_order, client_of, dumped, ended
from tests.support.stack import Stack

pytestmark = pytest.mark.timeout(180)


async def test_a_plain_response_is_the_synthetic_reply_and_can_be_retrieved_elsewhere(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=200)
    first, second = stack.gateway(), stack.gateway()
    one, other = client_of(first.url), client_of(second.url)
    try:
        response = await one.responses.create(
            model="synthetic",
            input="hello there",
            max_output_tokens=8,
            instructions="be brief",
            metadata={"case": "plain"},
            temperature=0.5,
        )
        assert response.status == "incomplete"
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.output_text == synthetic_text("hello there", 8)
        assert response.usage is not None and response.usage.output_tokens == 8
        assert response.metadata == {"case": "plain"}
        assert response.instructions == "be brief"
        assert response.temperature == 0.5

        again = await other.responses.retrieve(response.id)
        assert again.model_dump() == response.model_dump()
        items = await other.responses.input_items.list(response.id)
        assert [item.model_dump(exclude_unset=True)["content"] for item in items.data] == [
            [{"type": "input_text", "text": "hello there"}]
        ]
    finally:
        await one.close()
        await other.close()


async def test_a_stream_has_openais_order_and_a_resume_elsewhere_gives_exactly_what_follows(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=100)
    first, second = stack.gateway(), stack.gateway()
    one, other = client_of(first.url), client_of(second.url)
    prompt, n = "tell me a story", 12
    try:
        stream = await one.responses.create(
            model="synthetic", input=prompt, max_output_tokens=n, stream=True
        )
        events = dumped([event async for event in stream])
        check_order(events, "response.incomplete", synthetic_text(prompt, n))
        rid = events[0]["response"]["id"]
        assert events[0]["response"]["status"] == "in_progress"

        for after in (0, 3, 7, len(events) - 2):
            resumed = await other.responses.retrieve(rid, stream=True, starting_after=after)
            assert dumped([event async for event in resumed]) == events[after + 1 :]
    finally:
        await one.close()
        await other.close()


async def test_a_background_response_outlives_its_reader_and_replica_a_foreground_one_stops(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=20)
    # A short abandon grace (a watch mark of 2 s): a reply of 3 s without a reader is
    # abandoned unless it is a background one.
    first = stack.gateway(TOKENSPOUT_ABANDON_GRACE_S="1")
    second = stack.gateway(TOKENSPOUT_ABANDON_GRACE_S="1")
    one, other = client_of(first.url), client_of(second.url)
    prompt, n = "a long walk", 60
    try:
        created = await one.responses.create(
            model="synthetic", input=prompt, max_output_tokens=n, background=True
        )
        assert created.status in ("queued", "in_progress") and created.background
        # Read a few events on the first replica, then leave mid-reply.
        stream = await one.responses.retrieve(created.id, stream=True)
        seen = []
        async for event in stream:
            seen.append(event.model_dump(exclude_unset=True))
            if event.type == "response.output_text.delta" and len(seen) > 6:
                break
        await stream.close()
        assert seen[0]["type"] == "response.created"
        assert seen[0]["response"]["status"] == "queued"
        processes.kill(first.process)  # the replica that made it is gone, too

        done = await ended(other, created.id)
        assert done.status == "incomplete" and done.output_text == synthetic_text(prompt, n)
        resumed = await other.responses.retrieve(
            created.id, stream=True, starting_after=seen[-1]["sequence_number"]
        )
        whole = seen + dumped([event async for event in resumed])
        check_order(whole, "response.incomplete", synthetic_text(prompt, n))

        # The same reply in the foreground: its client leaves, so it is cancelled.
        foreground = await other.responses.create(
            model="synthetic", input=prompt, max_output_tokens=n, stream=True
        )
        rid = ""
        async for event in foreground:
            if event.type == "response.created":
                rid = event.response.id
            if event.type == "response.output_text.delta":
                break
        await foreground.close()
        left = await ended(other, rid)
        assert left.status == "cancelled"
        assert 0 < len(left.output_text) < len(synthetic_text(prompt, n))
    finally:
        await one.close()
        await other.close()


async def test_a_response_left_at_response_created_is_never_stuck(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=50)
    gateway = stack.gateway(TOKENSPOUT_ABANDON_GRACE_S="1")
    client = client_of(gateway.url)
    prompt, n = "left at once", 150  # 3 s: longer than the 2 s watch mark
    try:
        ids = {}
        for background in (False, True):
            stream = await client.responses.create(
                model="synthetic",
                input=prompt,
                max_output_tokens=n,
                stream=True,
                background=background,
            )
            async for event in stream:
                assert event.type == "response.created"
                ids[background] = event.response.id
                break
            await stream.close()
        # Foreground: cancelled; background: runs to its end. Neither stays queued.
        assert (await ended(client, ids[False])).status == "cancelled"
        kept = await ended(client, ids[True])
        assert kept.status == "incomplete" and kept.output_text == synthetic_text(prompt, n)
    finally:
        await client.close()


async def test_a_cancel_through_another_replica_ends_the_stream_as_cancelled(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=20)
    first, second = stack.gateway(), stack.gateway()
    one, other = client_of(first.url), client_of(second.url)
    try:
        stream = await one.responses.create(
            model="synthetic", input="go on and on", max_output_tokens=500, stream=True
        )
        events: list[dict[str, Any]] = []
        cancelled = None
        async for event in stream:
            events.append(event.model_dump(exclude_unset=True))
            if cancelled is None and event.type == "response.output_text.delta":
                cancelled = await other.responses.cancel(events[0]["response"]["id"])
        assert cancelled is not None and cancelled.status == "cancelled"
        assert events[-1]["type"] == "response.incomplete"
        assert events[-1]["response"]["status"] == "cancelled"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        text = events[-4]["text"]
        assert 0 < len(text) < len(synthetic_text("go on and on", 500))
        assert cancelled.output_text == text
        assert (await one.responses.retrieve(cancelled.id)).status == "cancelled"
    finally:
        await one.close()
        await other.close()


async def test_previous_response_id_continues_the_conversation_on_another_replica(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=200)
    first, second = stack.gateway(), stack.gateway()
    one, other = client_of(first.url), client_of(second.url)
    try:
        earlier = await one.responses.create(
            model="synthetic", input="first question", max_output_tokens=5, instructions="x y"
        )
        later = await other.responses.create(
            model="synthetic",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "and then"}]}],
            max_output_tokens=5,
            previous_response_id=earlier.id,
        )
        assert later.previous_response_id == earlier.id
        assert later.output_text == synthetic_text("and then", 5)
        # The synthetic engine counts a prompt's words: the earlier turn, its reply and the
        # new input (not the earlier instructions, which OpenAI does not carry over).
        words = len(f"first question {earlier.output_text} and then".split())
        assert later.usage is not None and later.usage.input_tokens == words
        assert earlier.usage is not None and earlier.usage.input_tokens == 4

        # A response that has not ended cannot be continued yet.
        running = await one.responses.create(
            model="synthetic", input="long", max_output_tokens=2000, background=True
        )
        with pytest.raises(openai.BadRequestError) as refused:
            await other.responses.create(
                model="synthetic", input="next", previous_response_id=running.id
            )
        assert "previous_response_in_progress" in str(refused.value.body)
        assert (await other.responses.cancel(running.id)).status == "cancelled"
    finally:
        await one.close()
        await other.close()


async def test_a_response_survives_its_worker_killed_mid_reply(stack: Stack) -> None:
    doomed = stack.synthetic(20)
    gateway = stack.gateway()
    client = client_of(gateway.url)
    prompt, n = "keep going whatever happens", 40
    try:
        stream = await client.responses.create(
            model="synthetic", input=prompt, max_output_tokens=n, stream=True
        )
        events = []
        killed = False
        async for event in stream:
            events.append(event.model_dump(exclude_unset=True))
            text = "".join(e.get("delta", "") for e in events)
            if not killed and event.type == "response.output_text.delta" and len(text) > 20:
                stack.synthetic(20)
                await lease_trusted(stack.redis_url)
                processes.kill(doomed)
                killed = True
        assert killed
    finally:
        await client.close()
    check_order(events, "response.incomplete", synthetic_text(prompt, n))


async def test_delete_store_false_and_unknown_ids(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    client = client_of(gateway.url)
    try:
        kept = await client.responses.create(model="synthetic", input="hi", max_output_tokens=3)
        await client.responses.delete(kept.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(kept.id)
        unstored = await client.responses.create(
            model="synthetic", input="hi", max_output_tokens=3, store=False
        )
        assert unstored.output_text == synthetic_text("hi", 3) and unstored.store is False
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)
        streamed = await client.responses.create(
            model="synthetic", input="hi", max_output_tokens=3, store=False, stream=True
        )
        events = [event async for event in streamed]
        rid = events[0].response.id  # type: ignore[union-attr]
        async with httpx.AsyncClient(timeout=10) as http:
            # The stream's end runs after its last byte: wait for the key to go.
            for _ in range(100):
                if (await http.get(f"{gateway.url}/v1/responses/{rid}")).status_code == 404:
                    break
                await http.get(f"{gateway.url}/health")
            assert (await http.get(f"{gateway.url}/v1/responses/{rid}")).status_code == 404
        for bad in ("resp_nothing", "nope", "resp_s_x.g_y"):
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(bad)
        with pytest.raises(openai.BadRequestError):
            await client.responses.create(
                model="synthetic", input="hi", background=True, store=False
            )
    finally:
        await client.close()


async def test_bad_requests_are_refused_with_the_field_named(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway(TOKENSPOUT_MAX_HISTORY_MESSAGES="4")
    client = client_of(gateway.url)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"input": []}, "input"),
        ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": "x"}] * 5}, "input"),
        ({"input": "hi", "include": ["file_search_call.results"]}, "include"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "hi", "previous_response_id": "resp_s_x.g_y"}, ""),
    ]
    try:
        for extra, field in bad:
            error: openai.APIStatusError
            try:
                await client.responses.create(model="synthetic", **extra)
            except openai.APIStatusError as exc:
                error = exc
            else:
                raise AssertionError(f"{extra} was accepted")
            if field:
                assert error.status_code == 400, extra
                assert field in str(error.body), (extra, error.body)
            else:
                assert error.status_code == 404
    finally:
        await client.close()


async def test_text_format_json_schema_and_logprobs_are_passed_on(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=200)
    gateway = stack.gateway()
    client = client_of(gateway.url)
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(
                model="synthetic",
                input="hi",
                text={"format": {"type": "json_schema", "name": "x", "schema": {"type": 7}}},
            )
        assert "schema" in str(refused.value)
        schema = {"type": "object", "properties": {"answer": {"type": "boolean"}}}
        shaped = await client.responses.create(
            model="synthetic",
            input="is it?",
            max_output_tokens=40,
            text={"format": {"type": "json_schema", "name": "yes_no", "schema": schema}},
        )
        assert shaped.status == "completed"
        jsonschema.validate(json.loads(shaped.output_text), schema)
        assert shaped.text is not None and shaped.text.format is not None
        assert shaped.text.format.type == "json_schema"
        response = await client.responses.create(
            model="synthetic",
            input="hello",
            max_output_tokens=6,
            include=["message.output_text.logprobs"],
            top_logprobs=2,
        )
        part = response.output[0].content[0]  # type: ignore[union-attr]
        assert part.type == "output_text"
        assert [lp.logprob for lp in part.logprobs or []] == [
            token.logprob for token in synthetic_tokens("hello", 6)
        ]
        assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs or [])
    finally:
        await client.close()


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL: Any = {"type": "function", "name": "get_weather", "parameters": WEATHER}


async def test_a_named_function_call_streams_as_a_function_call_item_and_its_output_continues(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=200)
    first, second = stack.gateway(), stack.gateway()
    one, other = client_of(first.url), client_of(second.url)
    ask: Any = {
        "model": "synthetic",
        "input": "What is the weather in Paris?",
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 80,
    }
    try:
        whole = await one.responses.create(**ask)
        assert whole.status == "completed"
        [call] = whole.output
        assert call.type == "function_call" and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        assert call.call_id.startswith("call_")
        assert whole.tools[0].name == "get_weather"  # type: ignore[union-attr]

        stream = await one.responses.create(**ask, stream=True)
        events = dumped([event async for event in stream])
        kinds = [event["type"] for event in events]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert kinds[:3] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
        ]
        assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
        assert kinds[-3:] == [
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
        arguments = "".join(event["delta"] for event in events[3:-3])
        assert events[-3]["arguments"] == arguments and events[-3]["name"] == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER)
        rid = events[0]["response"]["id"]
        resumed = await other.responses.retrieve(rid, stream=True, starting_after=2)
        assert dumped([event async for event in resumed]) == events[3:]

        # The call's output, on the other replica, continues the stored conversation.
        call_id = events[-2]["item"]["call_id"]
        answer = await other.responses.create(
            model="synthetic",
            previous_response_id=rid,
            input=[{"type": "function_call_output", "call_id": call_id, "output": "sunny"}],
            max_output_tokens=5,
        )
        assert answer.status == "incomplete" and answer.output[0].type == "message"
        # The synthetic engine counts the words of the messages' contents: the question
        # (from the stored conversation) and the output (the call itself is no content).
        question = "What is the weather in Paris?"
        words = len(f"{question} sunny".split())
        assert answer.usage is not None and answer.usage.input_tokens == words
        listed = await other.responses.input_items.list(answer.id)
        assert [item.type for item in listed.data] == ["function_call_output"]
    finally:
        await one.close()
        await other.close()


def test_the_bench_responses_path_delivers_every_token(tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            *(sys.executable, "-m", "bench.e2e", "--out", str(tmp_path), "--no-plot"),
            *("--streams", "3", "--tokens", "6", "--rounds-single", "1"),
            *("--saturation", "2", "20", "--modes", "engine", "responses"),
        ],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    results = json.loads((tmp_path / "e2e.json").read_text())
    for point in [*results["points"], results["saturation"]]:
        path = point["modes"]["responses"]
        assert path["failures"] == [] and not path["timed_out"], path
        assert path["tokens"] == path["tokens_expected"] == point["max_tokens"] * point["streams"]
        assert point["added"]["responses"]["added_ttft_p50_ms"] is not None
    assert "OpenAI Responses" in (tmp_path / "e2e.md").read_text()


@pytest.mark.vllm
@pytest.mark.parametrize("engine", ["vllm"], indirect=True)
async def test_a_vllm_response_streams_and_resumes_exactly(engine: EngineUnderTest) -> None:
    client = client_of(engine.gateway.url)
    try:
        stream = await client.responses.create(
            model=engine.model,
            input="Say hello.",
            max_output_tokens=12,
            stream=True,
            temperature=0,
        )
        events = dumped([event async for event in stream])
        text = "".join(e.get("delta", "") for e in events)
        assert events[-1]["type"] in ("response.completed", "response.incomplete")
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == text
        resumed = await client.responses.retrieve(
            events[0]["response"]["id"], stream=True, starting_after=4
        )
        assert dumped([event async for event in resumed]) == events[5:]
    finally:
        await client.close()
