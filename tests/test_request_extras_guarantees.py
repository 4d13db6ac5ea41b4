"""The request surface through every guarantee: logprobs on the session API
re-sent exactly by a resume on another replica, carried by WebSocket frames, a structured
reply over the session API, and the ``n`` choices of an OpenAI stream each continued
byte for byte when their worker is SIGKILLed mid-reply. Real gateway processes, real Redis,
the synthetic engine (whose script is the oracle)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from stack import processes
from tests.support.http import create_session, read_events, send
from tests.support.oracle import synthetic_text, synthetic_tokens
from tests.support.redis_probes import lease_trusted
from tests.support.stack import Stack
from tests.support.ws import open_ws

pytestmark = pytest.mark.timeout(180)


async def test_session_logprobs_are_resent_exactly_by_a_resume_on_another_replica(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=100)
    first, second = stack.gateway(), stack.gateway()
    content, n = "tell me more", 12
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, first.url)
        gid = await send(client, session, content, max_tokens=n, logprobs=True, top_logprobs=3)
        whole = await read_events(client, session, until_final_of=gid)
        tokens = [e.json() for e in whole.of(gid) if e.event == "token"]
        oracle = synthetic_tokens(content, n)
        assert [t["tokens"] for t in tokens] == [[token.text] for token in oracle]
        assert [t["logprobs"] for t in tokens] == [[token.logprob] for token in oracle]
        assert all(len(t["top_logprobs"][0]) == 3 for t in tokens)
        assert [t["top_logprobs"][0][0][0] for t in tokens] == [token.text for token in oracle]

        # Resume after the fifth token, on the other replica: exactly the events after it.
        fifth = next(e for e in whole.events if e.event == "token" and e.json()["count"] == 5)
        elsewhere = dataclasses.replace(session, base=second.url)
        resumed = await read_events(client, elsewhere, until_final_of=gid, last_event_id=fifth.id)
        after = whole.events[whole.events.index(fifth) + 1 :]
        assert [(e.id, e.data) for e in resumed.events] == [(e.id, e.data) for e in after]

        # A reply that did not ask carries none of it.
        plain = await send(client, session, content, max_tokens=3)
        reading = await read_events(client, session, until_final_of=plain)
        plain_tokens = [e.json() for e in reading.of(plain) if e.event == "token"]
        assert plain_tokens and all(
            "logprobs" not in t and "tokens" not in t and "top_logprobs" not in t
            for t in plain_tokens
        )


async def test_websocket_frames_carry_logprobs_and_a_structured_reply_validates(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=100)
    gateway = stack.gateway()
    schema = {"type": "object", "properties": {"answer": {"type": "boolean"}}}
    ws = await open_ws(gateway.url)
    try:
        ack = await ws.generate("a", "hello", max_tokens=6, logprobs=True, top_logprobs=2)
        assert ack["type"] == "ack"
        assert (await ws.final_of("a"))["type"] == "done"
        frames = ws.tokens("a")
        logprobs = [lp for f in frames for lp in f["logprobs"]]
        assert logprobs == [token.logprob for token in synthetic_tokens("hello", 6)]
        assert sum(len(f["top_logprobs"]) for f in frames) == 6
        assert ws.text("a") == synthetic_text("hello", 6)

        constrained: dict[str, Any] = {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "yes_no", "schema": schema},
            }
        }
        await ws.generate("b", "is it?", max_tokens=40, **constrained)
        assert (await ws.final_of("b"))["type"] == "done"
        jsonschema.validate(json.loads(ws.text("b")), schema)
        assert all("logprobs" not in f for f in ws.tokens("b"))

        bad = await ws.generate("c", "x", structured_outputs={"regex": "("})
        assert bad["type"] == "error" and bad["code"] == "invalid_structured_output"
    finally:
        await ws.conn.close()


async def test_session_api_refuses_a_bad_schema_before_queueing(stack: Stack) -> None:
    stack.synthetic(tokens_per_s=100)
    gateway = stack.gateway()
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        response = await client.post(
            f"{gateway.url}/v1/sessions/{session.session_id}/messages",
            json={
                "content": "hi",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "required": 3}},
                },
            },
            headers=session.headers,
        )
        assert response.status_code in (400, 422), response.text
        assert "required" in response.text
        # Nothing was queued: the session takes its next message at once.
        gid = await send(client, session, "still here", max_tokens=2)
        reading = await read_events(client, session, until_final_of=gid)
        assert reading.final(gid).event == "done"


async def test_every_choice_of_an_n_stream_survives_its_worker_killed_mid_reply(
    stack: Stack,
) -> None:
    doomed = stack.synthetic(20)
    gateway = stack.gateway()
    content, max_tokens = "two ways to say it", 40
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    texts = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    try:
        stream = await client.chat.completions.create(
            model="synthetic",
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            n=2,
            stream=True,
        )
        killed = False
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
            if not killed and min(len(t) for t in texts.values()) > 20:
                stack.synthetic(20)
                await lease_trusted(stack.redis_url)
                processes.kill(doomed)
                killed = True
        assert killed
    finally:
        await client.close()
    expected = synthetic_text(content, max_tokens)
    assert texts == {0: expected, 1: expected}
    assert finishes == {0: "length", 1: "length"}


async def test_a_session_message_with_n_gives_each_choice_its_events_and_one_history_entry(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=100)
    first, second = stack.gateway(), stack.gateway()
    content, n = "three of them", 6
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, first.url)
        response = await client.post(
            f"{first.url}/v1/sessions/{session.session_id}/messages",
            json={"content": content, "max_tokens": n, "n": 3, "seed": 7},
            headers=session.headers,
        )
        assert response.status_code == 202, response.text
        gids = response.json()["generation_ids"]
        assert len(set(gids)) == 3 and gids[0] == response.json()["generation_id"]
        reading = await read_events(client, session, until_final_of=gids[-1])
        for gid in gids[:-1]:
            if not reading.of(gid) or reading.of(gid)[-1].event != "done":
                last = reading.events[-1].id  # a read from the start would repeat them
                await read_events(
                    client, session, until_final_of=gid, reading=reading, last_event_id=last
                )
        for choice, gid in enumerate(gids):
            events = reading.of(gid)
            assert [
                e.json().get("choice", 0) for e in events if e.event in ("queued", "started")
            ] == [
                choice,
                choice,
            ]
            assert reading.final(gid).event == "done"
            assert reading.text(gid) == synthetic_text(content, n)
        # A resume on the other replica sees every choice's events again, exactly.
        elsewhere = dataclasses.replace(session, base=second.url)
        again = await read_events(client, elsewhere, limit=len(reading.events), last_event_id="0")
        assert [(e.id, e.data) for e in again.events] == [(e.id, e.data) for e in reading.events]
        # Only the first choice joined the history; the session takes its next message.
        history = (
            await client.get(
                f"{first.url}/v1/sessions/{session.session_id}", headers=session.headers
            )
        ).json()["messages"]
        assert [m["role"] for m in history] == ["user", "assistant"]
        assert history[1]["content"] == synthetic_text(content, n)
        refused = await client.post(
            f"{first.url}/v1/sessions/{session.session_id}/messages",
            json={"content": "x", "n": 17},
            headers=session.headers,
        )
        assert refused.status_code in (400, 422) and "n must be" in refused.text


async def test_a_websocket_generate_with_n_says_each_frames_choice_and_cancels_them_all(
    stack: Stack,
) -> None:
    stack.synthetic(tokens_per_s=50)
    gateway = stack.gateway()
    ws = await open_ws(gateway.url)
    try:
        ack = await ws.generate("a", "hello", max_tokens=4, n=2)
        assert ack["type"] == "ack" and len(ack["generation_ids"]) == 2
        done = []
        while len(done) < 2:
            frame = await ws.until(lambda f: f.get("id") == "a" and f["type"] == "done")
            done.append(frame.get("choice", 0))
        assert sorted(done) == [0, 1]
        for choice in (0, 1):
            text = "".join(f["text"] for f in ws.tokens("a") if f.get("choice", 0) == choice)
            assert text == synthetic_text("hello", 4)

        await ws.generate("b", "a long one", max_tokens=2000, n=2)
        await ws.until(lambda f: f.get("id") == "b" and f["type"] == "token")
        await ws.send(type="cancel", id="b")
        ended = []
        while len(ended) < 2:
            frame = await ws.until(lambda f: f.get("id") == "b" and f["type"] == "cancelled")
            ended.append(frame.get("choice", 0))
        assert sorted(ended) == [0, 1]
    finally:
        await ws.conn.close()
