"""What a worker knows of its engine's prefix cache: which prompts would find their beginning
there, before the engine is asked.

vLLM says after the fact how many of a request's prompt tokens its prefix cache held
(``RequestOutput.num_cached_tokens``, every vLLM this worker runs on: docs/affinity.md); the
synthetic engine says the same. Beforehand nobody says, so the worker keeps an index made as
the engine's cache is (engine/backends/prefix_cache.py: blocks of the engine's size, named by
their prefix, least recently used going first): every prompt it runs and every reply go in,
bounded like the engine's KV cache.

Each request's count from the engine checks the index (``began``): where the engine held less
than the index expected, it let blocks go sooner than the index thought (vLLM never evicts a
running request's blocks, so the room left for others is smaller than the whole cache), and
the index holds less from then on, by the blocks it was wrong about; where the engine held
more, the index let them go too soon and holds more, up to the engine's capacity. A wrong
index costs a prefill somewhere, never a reply.

Marks: names the worker gives to prefixes of what it ran (the gateway's names of a message
prefix), each kept on the block where its prefix ends; when that block leaves the index, the
name is released (``released``), so the worker stops telling others that it holds it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.backends.prefix_cache import BlockCache


@dataclass(frozen=True, slots=True)
class Check:
    """A request's prompt tokens in the engine's prefix cache: as the index expected, and as
    the engine said."""

    expected: int
    engine: int

    @property
    def right(self) -> bool:
        return self.expected == self.engine


class PrefixIndex:
    def __init__(self, block_size: int, capacity_tokens: int) -> None:
        self.cache = BlockCache(block_size, capacity_tokens)
        self.ceiling = capacity_tokens
        """The engine's KV cache: the index never holds more."""
        self.checks = 0
        self.right = 0
        """Requests whose cached tokens the engine told, and of them those the index expected
        exactly."""
        self._marks: dict[int, set[str]] = {}
        """Block name -> the marks that end on it."""
        self._released: list[str] = []

    def expects(self, prompt_ids: Sequence[int]) -> int:
        """Tokens of this prompt the engine's prefix cache should hold now."""
        return self.cache.cached_tokens(len(prompt_ids), self.cache.names(prompt_ids))

    def began(self, prompt_ids: Sequence[int], engine_cached: int | None) -> Check | None:
        """The engine prefilled ``prompt_ids`` and found ``engine_cached`` of them in its
        cache (None: it did not say). Its blocks are held from now on."""
        names = self.cache.names(prompt_ids)
        expected = self.cache.cached_tokens(len(prompt_ids), names)
        check = None
        if engine_cached is not None:
            check = Check(expected, engine_cached)
            self.checks += 1
            self.right += check.right
            if not check.right:  # off by this many tokens of room: it holds as many more
                room = self.cache.capacity_tokens + engine_cached - expected
                self._let_go(self.cache.resize(min(self.ceiling, room)))
        self._let_go(self.cache.store(names))
        return check

    def ended(self, token_ids: Sequence[int], marks: Mapping[str, int] | None = None) -> None:
        """A request ended: its prompt and reply (``token_ids``) are held; ``marks``: names
        of its prefixes, each with its length in tokens (a mark shorter than one block is
        not kept)."""
        names = self.cache.names(token_ids)
        self._let_go(self.cache.store(names))
        size = self.cache.block_size
        for mark, length in (marks or {}).items():
            blocks = min(length // size, len(names))
            if blocks and self.cache.held(names[:blocks]) == blocks:
                self._marks.setdefault(names[blocks - 1], set()).add(mark)

    def released(self) -> list[str]:
        """The marks whose prefix left the index since the last call."""
        released, self._released = self._released, []
        return released

    def _let_go(self, gone: list[int]) -> None:
        """``gone`` left the cache: their marks are released."""
        for name in gone:
            self._released += self._marks.pop(name, ())
