"""One suite, both backends (engine/backends/base.py): a reply and its second turn, and a
reply nobody reads, over real gateway processes and real Redis, with the synthetic engine
and with vLLM on the CPU (the engine under test: tests/support/engines.py; the vLLM worker
is the session's shared ``vllm_stack``, each test waits for it to be idle first).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import httpx
import pytest

from tests.support.engines import LONG, PROMPT, EngineUnderTest, nothing_after_the_final
from tests.support.http import create_session, read_events, send
from tests.support.sse import Event, parse

pytestmark = pytest.mark.timeout(900)


async def test_a_reply_streams_in_token_events_and_the_second_turn_sees_the_first(
    engine: EngineUnderTest,
) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, engine.url)
        n = engine.short_max_tokens
        first = await send(client, session, "Name three colours.", max_tokens=n, **engine.sampling)
        reading = await read_events(client, session, until_final_of=first, timeout_s=300)
        kinds = [e.event for e in reading.of(first)]
        assert kinds[:2] == ["queued", "started"] and kinds[-1] == "done", kinds
        tokens = [e.json() for e in reading.of(first) if e.event == "token"]
        assert len(tokens) >= 3 and set(kinds[2:-1]) == {"token"}, kinds
        counts = [t["count"] for t in tokens]
        assert counts == sorted(set(counts))
        assert counts[-1] == sum(len(t["token_ids"]) for t in tokens)
        done = reading.final(first).json()
        started = reading.of(first)[1].json()
        assert done["usage"] == {
            "prompt_tokens": started["prompt_tokens"],
            "completion_tokens": counts[-1],
        }
        assert done["finish_reason"] in ("stop", "length")
        assert (done["finish_reason"] == "length") == (counts[-1] == n)
        answer = reading.text(first)
        assert answer.strip()

        second = await send(client, session, "And two more?", max_tokens=n, **engine.sampling)
        more = await read_events(
            client,
            session,
            until_final_of=second,
            last_event_id=reading.events[-1].id,
            timeout_s=300,
        )
        assert more.final(second).event == "done"
        started_again = next(e.json() for e in more.of(second) if e.event == "started")
        # The second prompt holds the first question and its answer.
        grown = started_again["prompt_tokens"] - started["prompt_tokens"]
        assert grown >= done["usage"]["completion_tokens"]

        view = await client.get(
            f"{engine.url}/v1/sessions/{session.session_id}", headers=session.headers
        )
        messages = view.json()["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
        assert messages[1]["content"] == answer


async def test_a_generation_nobody_reads_is_abandoned_after_a_short_grace(
    engine: EngineUnderTest,
) -> None:
    gateway = engine.extra_gateway("grace", TOKENSPOUT_ABANDON_GRACE_S="2")
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, gateway.url)
        gid = await send(client, session, PROMPT, max_tokens=LONG, **engine.sampling)
        async with client.stream("GET", session.events_url, headers=session.headers) as response:
            assert response.status_code == 200
            # Held, not left to the loop: an SSE iterator dropped by a `break` is finalized
            # at once, and with it the response, so the reader would leave there and the
            # engine could be done with it before `wait_running` looked (CI saw it).
            async with aclosing(parse(response.aiter_lines())) as events:
                async with asyncio.timeout(300):
                    seen = await token_count_after(events, 3)
                    await engine.wait_running(1)
                    seen = await token_count_after(events, seen + 1)  # still connected
        left = time.monotonic()  # the client is gone; nobody else reads the session

        # Grace (2 s) plus the watch's expiry and the worker's 1 s check, with slack.
        await engine.stops(left, "abandoned after disconnect (grace 2 s)", within_s=30)
        reading = await read_events(client, session, until_final_of=gid)
        final = reading.final(gid)
        assert final.event == "cancelled" and final.json()["reason"] == "abandoned"
        # The disconnect itself did not end it: it ran on until the grace was over.
        assert seen < final.json()["usage"]["completion_tokens"] < LONG
        await nothing_after_the_final(engine, session.session_id, gid)


PROMPT_TOKENS = "tokenspout_engine_prompt_tokens_total"
CACHED_TOKENS = "tokenspout_engine_prompt_cached_tokens_total"
LARGEST_BLOCK = 128
"""vLLM's KV cache block on a CPU (16 on a GPU, and in the synthetic engine): its prefix
cache holds whole blocks, so up to one block of a repeated beginning is computed again."""


async def test_the_workers_metrics_count_the_prompt_tokens_the_engine_found_in_its_cache(
    engine: EngineUnderTest,
) -> None:
    def counted() -> tuple[float, float]:
        labels = {"model": engine.model}
        return engine.metric(PROMPT_TOKENS, **labels), engine.metric(CACHED_TOKENS, **labels)

    async def turn(message: str) -> tuple[int, float, float]:
        """A turn to its end: its prompt's tokens, and the growth of both counters."""
        before = counted()
        gid = await send(client, session, message, max_tokens=8, **engine.sampling)
        reading = await read_events(client, session, until_final_of=gid, timeout_s=300)
        assert reading.final(gid).event == "done"
        prompt = next(e.json() for e in reading.of(gid) if e.event == "started")["prompt_tokens"]
        after = counted()
        return prompt, after[0] - before[0], after[1] - before[1]

    history = " ".join(
        f"Line {n} of the log says the pump ran at {n * 7} litres." for n in range(30)
    )
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, engine.url)
        first, prompted, _ = await turn(history)
        assert first > 2 * LARGEST_BLOCK and prompted == first
        second, prompted, cached = await turn("And the last line?")
    assert prompted == second
    # The second prompt begins with the first one and its reply: the engine computed again
    # at most their last partial block, and at least the new question's tokens.
    assert first - LARGEST_BLOCK <= cached <= second - 1, (first, second, cached)


async def token_count_after(events: AsyncIterator[Event], count: int) -> int:
    """Read up to the first token event whose count reaches ``count``; its count."""
    async for event in events:
        if event.event == "token" and (seen := int(event.json()["count"])) >= count:
            return seen
    raise AssertionError(f"the stream ended before {count} tokens")
