"""End to end with the real engine: vLLM on the CPU serving the bundled SmolLM2."""

from __future__ import annotations

import httpx
import pytest

from tests.support.http import create_session, read_events, send
from tests.support.stack import VllmStack

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


async def test_vllm_streams_a_coherent_answer_and_the_second_turn_sees_the_first(
    vllm_stack: VllmStack,
) -> None:
    base = vllm_stack.gateway.url
    async with httpx.AsyncClient(timeout=120) as client:
        ready = await client.get(f"{base}/ready")
        assert ready.status_code == 200
        assert ready.json()["workers"][0]["model"] == "SmolLM2-135M-Instruct"

        session = await create_session(client, base)
        first = await send(
            client, session, "What is the capital of France?", max_tokens=24, temperature=0
        )
        reading = await read_events(client, session, until_final_of=first, timeout_s=300)
        tokens = [e for e in reading.of(first) if e.event == "token"]
        answer = reading.text(first)
        assert len(tokens) >= 3, answer
        assert "Paris" in answer
        assert all(t.json()["token_ids"] for t in tokens)
        done = reading.final(first).json()
        assert done["type"] == "done"
        assert done["usage"]["completion_tokens"] == tokens[-1].json()["count"]
        first_prompt = next(e.json() for e in reading.of(first) if e.event == "started")

        second = await send(
            client, session, "And of Italy? Answer with one word.", max_tokens=12, temperature=0
        )
        more = await read_events(
            client,
            session,
            until_final_of=second,
            last_event_id=reading.events[-1].id,
            timeout_s=300,
        )
        started = next(e.json() for e in more.of(second) if e.event == "started")
        # The second prompt holds the first question and its answer.
        grown = started["prompt_tokens"] - first_prompt["prompt_tokens"]
        assert grown > done["usage"]["completion_tokens"]
        assert more.final(second).event == "done"
        assert more.text(second).strip()

        history = (
            await client.get(f"{base}/v1/sessions/{session.session_id}", headers=session.headers)
        ).json()["messages"]
        assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
        assert history[1]["content"] == answer


async def test_vllm_continues_a_reply_cut_at_its_limit_into_one_message(
    vllm_stack: VllmStack,
) -> None:
    """Continue (POST .../continue): vLLM extends the last assistant message (its chat
    template ends inside it) and the history keeps one longer message, greedy: the reply
    cut at 10 tokens then continued for 10 reads as the reply made at once with 20."""
    base = vllm_stack.gateway.url
    question = "Name the planets of the solar system, in order."
    async with httpx.AsyncClient(timeout=120) as client:
        whole_session = await create_session(client, base)
        whole = await send(client, whole_session, question, max_tokens=20, temperature=0)
        whole_text = (
            await read_events(client, whole_session, until_final_of=whole, timeout_s=300)
        ).text(whole)

        session = await create_session(client, base)
        cut = await send(client, session, question, max_tokens=10, temperature=0)
        reading = await read_events(client, session, until_final_of=cut, timeout_s=300)
        assert reading.final(cut).json()["finish_reason"] == "length"
        url = f"{base}/v1/sessions/{session.session_id}"
        response = await client.post(
            f"{url}/continue", json={"max_tokens": 10, "temperature": 0}, headers=session.headers
        )
        assert response.status_code == 202, response.text
        more = response.json()["generation_id"]
        continued = await read_events(
            client, session, until_final_of=more, last_event_id=reading.events[-1].id
        )
        started = next(e.json() for e in continued.of(more) if e.event == "started")
        first_started = next(e.json() for e in reading.of(cut) if e.event == "started")
        # The prompt holds the cut reply (and no new turn's markers after it).
        assert started["prompt_tokens"] > first_started["prompt_tokens"] + 5
        history = (await client.get(url, headers=session.headers)).json()["messages"]
        assert [m["role"] for m in history] == ["user", "assistant"]
        assert history[1]["content"] == reading.text(cut) + continued.text(more)
        assert history[1]["content"] == whole_text
