"""A prefix cache's bookkeeping, made as vLLM's automatic prefix caching makes it.

A prompt is cut into blocks of ``block_size`` tokens; a full block is named by a hash of its
tokens and of the name of the block before it, so a name stands for the whole prefix up to
the end of its block, and two prompts share a block's name exactly while they share every
token up to there. The cache holds up to ``capacity_tokens`` worth of blocks and lets the least
recently used go first. A sequence's blocks are used last to first (as vLLM frees a finished
request's blocks in reverse order), so of a prefix that falls out of use its tail goes
before its beginning, and what is left is still a prefix.

``cached_tokens`` counts as vLLM's ``RequestOutput.num_cached_tokens`` does: whole blocks from
the prompt's start, never its last token (the engine computes that one to get the next
token's logits).

The synthetic engine keeps its prefix cache in one (engine/backends/synthetic.py); the
worker's index of what its engine holds is one too (engine/prefix_index.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BLOCK_SIZE = 16
"""vLLM's block size on a GPU (its CPU build uses 128)."""


class BlockCache:
    def __init__(self, block_size: int = BLOCK_SIZE, capacity_tokens: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1 (got {block_size})")
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be 0 or more (got {capacity_tokens})")
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()
        """Names of the blocks held, least recently used first."""

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_size

    @property
    def held_tokens(self) -> int:
        return len(self._blocks) * self.block_size

    def names(self, token_ids: Sequence[int]) -> list[int]:
        """The names of ``token_ids``' full blocks, first to last."""
        size, parent, names = self.block_size, 0, []
        for start in range(0, len(token_ids) - size + 1, size):
            parent = hash((parent, *token_ids[start : start + size]))
            names.append(parent)
        return names

    def held(self, names: Sequence[int]) -> int:
        """How many of ``names``, from the first, the cache holds (it uses none of them)."""
        count = 0
        for name in names:
            if name not in self._blocks:
                break
            count += 1
        return count

    def cached_tokens(self, prompt_tokens: int, names: Sequence[int]) -> int:
        """The prompt's tokens the cache gives (``names``: the prompt's), as vLLM counts them."""
        most = (prompt_tokens - 1) // self.block_size if prompt_tokens else 0
        return min(self.held(names), most) * self.block_size

    def store(self, names: Sequence[int]) -> list[int]:
        """``names`` computed or used now: held, most recently used, the first one last of
        all; the least recently used blocks go to make room. Returns the names that went."""
        blocks = self._blocks
        for name in reversed(names[: self.capacity_blocks]):
            blocks[name] = None
            blocks.move_to_end(name)
        return self._evict()

    def resize(self, capacity_tokens: int) -> list[int]:
        """Hold up to ``capacity_tokens`` from now on; returns the names that went."""
        self.capacity_blocks = max(0, capacity_tokens) // self.block_size
        return self._evict()

    def _evict(self) -> list[int]:
        blocks, gone = self._blocks, []
        while len(blocks) > self.capacity_blocks:
            gone.append(blocks.popitem(last=False)[0])
        return gone
