"""The synthetic engine's prefix cache, counted as vLLM counts it: whole blocks from the
prompt's start, never its last token, the least recently used going first; a conversation's
next turn finds its history, a cold prompt waits for its prefill."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.backends.base import Delta
from engine.backends.prefill import Prefill
from engine.backends.prefix_cache import BlockCache
from engine.backends.synthetic import SyntheticBackend, scripted_reply
from wire import ChatMessage, GenerationRequest, SamplingParams


def words(prefix: str, count: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(count))


def test_a_block_is_named_by_everything_before_it() -> None:
    cache = BlockCache(block_size=4, capacity_tokens=64)
    a = cache.names([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = cache.names([1, 2, 3, 4, 5, 6, 7])
    c = cache.names([0, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and len(b) == 1  # full blocks only
    assert a[0] == b[0] and a[0] != c[0]
    assert a[1] != c[1]  # the same four tokens after a different beginning


def test_cached_tokens_are_whole_blocks_and_never_the_prompts_last_token() -> None:
    cache = BlockCache(block_size=4, capacity_tokens=64)
    prompt = list(range(12))
    assert cache.cached_tokens(12, cache.names(prompt)) == 0
    cache.store(cache.names(prompt))
    # The same prompt again: its last token is computed, so its last block is not counted.
    assert cache.cached_tokens(12, cache.names(prompt)) == 8
    longer = [*prompt, 100, 101, 102]
    assert cache.cached_tokens(len(longer), cache.names(longer)) == 12
    changed = [0, 1, 2, 3, 4, 99, 6, 7, 8, 9, 10, 11, 12]
    assert cache.cached_tokens(len(changed), cache.names(changed)) == 4


def test_the_least_recently_used_blocks_go_first_and_a_prefix_loses_its_tail_first() -> None:
    cache = BlockCache(block_size=2, capacity_tokens=8)  # four blocks
    old, new = cache.names([1, 2, 3, 4, 5, 6]), cache.names([7, 8, 9, 10])
    assert cache.store(old) == []
    gone = cache.store(new)
    assert gone == [old[2]]  # the old prefix's tail, not its beginning
    assert cache.held(old) == 2 and cache.held(new) == 2
    assert cache.held_tokens == 8
    cache.store(old[:1])  # used again: now the newest
    gone = cache.store(cache.names([11, 12, 13, 14]))
    assert set(gone) == {new[1], old[1]} and cache.held(old) == 1


def test_a_cache_of_no_tokens_holds_nothing() -> None:
    cache = BlockCache(block_size=4, capacity_tokens=0)
    names = cache.names(list(range(16)))
    assert cache.store(names) == [] and cache.held(names) == 0


@pytest.mark.parametrize(
    ("block_size", "capacity"), [(0, 16), (16, -1)], ids=["block_size", "capacity_tokens"]
)
def test_a_cache_of_an_impossible_shape_is_refused_naming_what_is_wrong(
    block_size: int, capacity: int
) -> None:
    with pytest.raises(ValueError, match="block_size" if block_size < 1 else "capacity_tokens"):
        BlockCache(block_size, capacity)


def test_the_prefill_lane_serves_prompts_one_after_another_at_its_rate() -> None:
    prefill = Prefill(tokens_per_s=1000, kv_cache_tokens=4096, block_size=16)
    first = prefill.admit(list(range(500)), now=10.0)
    assert first.cached_tokens == 0 and first.ready_at == pytest.approx(10.5)
    # Taken while the first prefills: it waits for the lane, then computes its own part.
    second = prefill.admit([*range(480), *range(1000, 1100)], now=10.1)
    assert second.cached_tokens == 480
    assert second.ready_at == pytest.approx(10.5 + 100 / 1000)
    idle = prefill.admit(list(range(2000, 2032)), now=20.0)
    assert idle.ready_at == pytest.approx(20.032)


def chat(gid: str, *messages: ChatMessage, max_tokens: int = 8) -> GenerationRequest:
    return GenerationRequest(gid, "s", SamplingParams(max_tokens=max_tokens), list(messages))


async def run_to_end(backend: SyntheticBackend, request: GenerationRequest) -> list[Delta]:
    return [delta async for delta in backend.generate(await backend.prepare(request))]


async def test_the_second_turn_finds_the_first_turns_prompt_and_reply_in_the_cache() -> None:
    backend = SyntheticBackend(tokens_per_s=0, kv_cache_tokens=4096)
    question = ChatMessage("user", words("q", 100))
    first = await run_to_end(backend, chat("g1", question, max_tokens=40))
    assert first[0].cached_tokens == 0
    assert all(delta.cached_tokens is None for delta in first[1:])
    reply = "".join(token.text for token in scripted_reply(question.content, 40))
    turn = [question, ChatMessage("assistant", reply), ChatMessage("user", "and then")]
    second = await run_to_end(backend, chat("g2", *turn))
    # 100 words of the question and 40 of the reply, in blocks of 16: 128 of 140.
    assert second[0].cached_tokens == 128
    assert (backend.prefilled.prompt_tokens, backend.prefilled.cached_tokens) == (242, 128)


async def test_a_cold_prompt_waits_for_its_prefill_and_a_warm_one_does_not() -> None:
    backend = SyntheticBackend(tokens_per_s=0, prefill_tokens_per_s=500, kv_cache_tokens=4096)
    prompt = ChatMessage("user", words("p", 400))
    began = time.monotonic()
    cold = await run_to_end(backend, chat("g1", prompt, max_tokens=1))
    assert time.monotonic() - began >= 400 / 500
    assert cold[0].cached_tokens == 0
    warm = await run_to_end(backend, chat("g2", prompt, ChatMessage("user", "again")))
    assert warm[0].cached_tokens == 400  # one token left to prefill


async def test_a_request_aborted_in_its_prefill_reports_no_prefill() -> None:
    backend = SyntheticBackend(tokens_per_s=0, prefill_tokens_per_s=10, kv_cache_tokens=4096)
    deltas = backend.generate(await backend.prepare(chat("g1", ChatMessage("user", "x " * 50))))
    taking = asyncio.ensure_future(anext(deltas))
    await asyncio.sleep(0.05)
    await backend.abort("g1")
    ended = await taking
    await deltas.aclose()
    await backend.stop()  # its stepping loop sleeps until the aborted prefill would have ended
    assert ended.finish_reason == "abort" and ended.cached_tokens is None
    assert backend.prefilled.prompt_tokens == 0
