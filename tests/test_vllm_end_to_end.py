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
