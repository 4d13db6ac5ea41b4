"""The worker's index of its engine's prefix cache, against the synthetic engine's own cache
(engine/backends/prefill.py): of the same size, it expects exactly what the engine then says;
larger or smaller, the engine's counts bring it to the engine's size; a name given to a
prefix is released when the prefix leaves it."""

from __future__ import annotations

import random

from engine.backends.synthetic import SyntheticBackend, scripted_reply
from engine.prefix_index import PrefixIndex
from wire import ChatMessage, GenerationRequest, SamplingParams

BLOCK = 16


class Sessions:
    """Conversations of one engine, each turn's prompt its history and a new message; the
    worker's index beside it, fed as a worker feeds it."""

    def __init__(self, engine_tokens: int, index_tokens: int, seed: int = 1) -> None:
        self.backend = SyntheticBackend(tokens_per_s=0, kv_cache_tokens=engine_tokens)
        self.index = PrefixIndex(BLOCK, index_tokens)
        self.histories: dict[int, list[ChatMessage]] = {}
        self.random = random.Random(seed)
        self.served = 0

    async def turn(self, session: int) -> tuple[int, int]:
        """One turn of ``session``: (tokens the index expected cached, the engine's count)."""
        history = self.histories.setdefault(session, [])
        words = " ".join(
            f"s{session}t{len(history)}w{i}" for i in range(self.random.randint(20, 60))
        )
        history.append(ChatMessage("user", words))
        self.served += 1
        request = GenerationRequest(
            f"g{self.served}", "s", SamplingParams(max_tokens=30), list(history)
        )
        prepared = await self.backend.prepare(request)
        expected = self.index.expects(prepared.prompt_token_ids)
        deltas = [delta async for delta in self.backend.generate(prepared)]
        engine = deltas[0].cached_tokens
        assert engine is not None
        check = self.index.began(prepared.prompt_token_ids, engine)
        assert check is not None and check.expected == expected
        reply = "".join(token.text for token in scripted_reply(words, 30))
        history.append(ChatMessage("assistant", reply))
        output = [token_id for delta in deltas for token_id in delta.token_ids]
        self.index.ended([*prepared.prompt_token_ids, *output])
        return expected, engine

    async def mixed(self, turns: int, sessions: int) -> list[tuple[int, int]]:
        """``turns`` turns of ``sessions`` conversations, in a random order."""
        return [await self.turn(self.random.randrange(sessions)) for _ in range(turns)]


async def test_an_index_of_the_engines_size_expects_exactly_what_the_engine_holds() -> None:
    sessions = Sessions(engine_tokens=2048, index_tokens=2048)
    seen = await sessions.mixed(turns=120, sessions=12)  # more history than the cache holds
    assert all(expected == engine for expected, engine in seen)
    hits = [engine for _, engine in seen if engine]
    assert 20 < len(hits) < len(seen), "the workload should both hit and miss the cache"
    assert sessions.index.checks == sessions.index.right == 120


async def test_an_index_larger_than_the_engine_learns_to_expect_what_the_engine_keeps() -> None:
    sessions = Sessions(engine_tokens=1024, index_tokens=16_384)
    seen = await sessions.mixed(turns=200, sessions=12)
    wrong = [expected != engine for expected, engine in seen]
    # The histories outgrow the engine's cache after a few dozen turns: the index, eight
    # times as large, expects hits the engine no longer has, until its counts shrink it.
    assert sum(wrong[20:80]) >= 20, wrong
    assert sum(wrong[-80:]) <= 4, wrong
    assert 1024 <= sessions.index.cache.capacity_tokens <= 1280


async def test_an_index_that_let_blocks_go_too_soon_holds_more_up_to_the_engine() -> None:
    index = PrefixIndex(BLOCK, capacity_tokens=1024)
    prompt = list(range(600))
    index.began(prompt, engine_cached=0)  # the engine holds nothing: neither should it
    assert index.expects(prompt) == 592
    check = index.began(prompt, engine_cached=0)
    assert check is not None and not check.right
    assert index.cache.capacity_tokens == 1024 - 592
    check = index.began(prompt, engine_cached=592)  # it did hold them all after all
    assert check is not None and (check.expected, check.engine) == (432, 592)
    assert index.cache.capacity_tokens == 592
    index.began(list(range(1000, 2000)), engine_cached=992)
    assert index.cache.capacity_tokens == 1024  # never past the engine's size
    assert (index.checks, index.right) == (4, 1)


def test_a_prefixs_name_is_released_when_its_block_leaves_the_index() -> None:
    index = PrefixIndex(BLOCK, capacity_tokens=64)  # four blocks
    index.ended(list(range(40)), {"system": 16, "turn-1": 40, "short": 10})
    assert index.released() == []
    index.ended(list(range(100, 148)))  # three blocks: the first turn's tail goes
    assert index.released() == ["turn-1"]
    index.ended(list(range(200, 232)))
    assert index.released() == ["system"]  # "short" ended before one block: never kept
    assert index.released() == []
