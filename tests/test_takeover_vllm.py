"""Takeover with the real engine: vLLM on the CPU, SIGKILLed mid-reply, greedy sampling.

Two vLLM engines never run at once on this machine (tests/conftest.py's lock), so the
replacement worker starts after the kill: the taken-over reply waits in the queue while it
loads, then goes on from the prompt plus the token ids already streamed. With greedy
sampling the continued reply is the uninterrupted one. The replacement becomes the
session's shared engine for the tests that follow. The last test checks the backend's
continuation input (and its context guard) with the real tokenizer only.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from stack import processes
from tests.support.http import Reading, create_session, follow, read_events, send
from tests.support.stack import VllmStack

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

QUESTION = "Write a poem of eight lines about a lighthouse keeper and the sea."
MAX_TOKENS = 48


async def test_a_vllm_worker_killed_mid_reply_is_continued_with_the_same_greedy_text(
    vllm_stack: VllmStack,
) -> None:
    base = vllm_stack.gateway.url
    engine_args = [str(arg) for arg in vllm_stack.engine.args][3:]  # type: ignore[union-attr]
    engine_args = engine_args[: engine_args.index("--worker-id")]
    params = {"max_tokens": MAX_TOKENS, "temperature": 0}
    async with httpx.AsyncClient(timeout=120) as client:
        session = await create_session(client, base)
        first = await send(client, session, QUESTION, **params)
        whole = await read_events(client, session, until_final_of=first, timeout_s=300)
        assert whole.final(first).json()["usage"]["completion_tokens"] == MAX_TOKENS

        session = await create_session(client, base)
        gid = await send(client, session, QUESTION, **params)
        follower = follow(client, session, gid)
        await follower.until_tokens(10, timeout_s=300)
        processes.kill(vllm_stack.engine)
        killed_at = time.monotonic()
        vllm_stack.engine = await asyncio.to_thread(vllm_stack.stack.engine, *engine_args)
        print(f"\nreplacement vLLM worker ready {time.monotonic() - killed_at:.1f} s after")
        await follower.until_end(300)
    print(f"kill -> next token {follower.first_token_after(killed_at):.1f} s (with its start)")
    events = follower.reading.events
    resumed_at = next(
        at for at, e in zip(follower.arrived, events, strict=True) if e.event == "resumed"
    )
    print(f"resumed -> next token {follower.first_token_after(resumed_at) * 1000:.0f} ms (prefill)")
    continued: Reading = follower.reading
    kinds = [e.event for e in continued.of(gid)]
    assert kinds.count("resumed") == 1 and kinds[-1] == "done", kinds
    counts = [e.json()["count"] for e in continued.of(gid) if e.event == "token"]
    assert counts == sorted(set(counts)), "a token repeated"
    assert continued.text(gid) == whole.text(first)
    assert continued.final(gid).json()["usage"] == whole.final(first).json()["usage"]


async def test_a_continuation_longer_than_the_context_ends_with_a_clear_error() -> None:
    """The vLLM backend's prepare (with the real tokenizer; no engine needed): a prompt
    plus streamed tokens past this worker's context is `context_exceeded`; one that fits
    asks the engine for the tokens left, and for the min_tokens left."""
    from transformers import AutoTokenizer

    from engine.backends.base import BackendError
    from engine.backends.vllm_backend import VllmBackend
    from engine.model import default_model_dir
    from wire import GenerationRequest, Resume, SamplingParams

    folder = default_model_dir()
    backend = VllmBackend(str(folder), max_model_len=64)
    backend._tokenizer = AutoTokenizer.from_pretrained(folder)

    def resumed(streamed: int, min_tokens: int = 0) -> GenerationRequest:
        resume = Resume(1, "w", 3, streamed, "x" * streamed, [42] * streamed)
        params = SamplingParams(max_tokens=100, min_tokens=min_tokens)
        return GenerationRequest("g_1", "s_1", params, prompt="one two three", resume=resume)

    prepared = await backend.prepare(resumed(20))
    assert prepared.prompt_token_ids[-20:] == [42] * 20
    assert prepared.params.max_tokens == 80 and prepared.resumed_tokens == 20
    assert prepared.generation_id == "g_1@1"
    # min_tokens counts from the reply's start: the continuation owes only what is left.
    assert (await backend.prepare(resumed(20, min_tokens=30))).params.min_tokens == 10
    assert (await backend.prepare(resumed(20, min_tokens=15))).params.min_tokens == 0
    with pytest.raises(BackendError) as caught:
        await backend.prepare(resumed(70))
    assert caught.value.code == "context_exceeded"
    assert "exceed this worker's context of 64" in caught.value.message


async def test_a_structured_reply_taken_over_mid_reply_ends_with_a_clear_error() -> None:
    """vLLM's grammar starts at the reply's first token and cannot be advanced over tokens
    already streamed: a structured reply's continuation ends `structured_output_lost`
    rather than risk output that does not validate; one taken over before its first token
    runs as usual (the real tokenizer; no engine needed)."""
    from transformers import AutoTokenizer

    from engine.backends.base import BackendError
    from engine.backends.vllm_backend import VllmBackend
    from engine.model import default_model_dir
    from wire import GenerationRequest, Resume, SamplingParams, StructuredOutput

    folder = default_model_dir()
    backend = VllmBackend(str(folder), max_model_len=256)
    backend._tokenizer = AutoTokenizer.from_pretrained(folder)
    params = SamplingParams(max_tokens=50, structured=StructuredOutput(json_object=True))

    def resumed(streamed: int) -> GenerationRequest:
        resume = Resume(1, "w", 3, streamed, '{"a"'[:streamed], [90] * streamed)
        return GenerationRequest("g_1", "s_1", params, prompt="JSON please", resume=resume)

    with pytest.raises(BackendError) as caught:
        await backend.prepare(resumed(3))
    assert caught.value.code == "structured_output_lost"
    assert (await backend.prepare(resumed(0))).params.structured == params.structured
