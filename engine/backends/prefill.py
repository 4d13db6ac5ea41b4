"""The synthetic engine's prefill: a prefix cache of its own and the time a prompt's uncached
tokens take, as a GPU spends it.

A request's prompt is looked up in the cache when the engine takes it (``admit``): the
blocks it holds are not computed again. What is left is prefilled in one lane, one request
after another in the order taken, at ``tokens_per_s`` (a GPU's prefill of an 8B model runs at
thousands to tens of thousands of tokens a second; 0: at once). The request's first token
comes with the engine's first step after its prefill. Its prompt's blocks are cached from
then on (the requests taken after it are prefilled after it), and its reply's blocks when it
ends, so the next turn of a conversation, whose prompt is this one's and its reply, finds
them (as vLLM keeps the blocks a reply filled).

What the model leaves out: vLLM fits prefills into its decode steps (chunked prefill), so a
busy prefill slows the other requests' tokens a little, and a running request's blocks
cannot be evicted; here decoding never waits for a prefill, and a cache smaller than what
runs at once may drop a running request's blocks (the next turn pays for them again).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.backends.prefix_cache import BLOCK_SIZE, BlockCache

KV_CACHE_TOKENS = 65_536
"""The synthetic engine's KV cache by default: about what a 24 GB card holds beside an 8B
model in 16-bit weights (6 GB at 128 KiB a token)."""


@dataclass(frozen=True, slots=True)
class Prefilling:
    """A request the engine took: its prompt's tokens, those the cache held, and when its
    prefill is done (the event loop's clock)."""

    prompt_tokens: int
    cached_tokens: int
    ready_at: float


class Prefill:
    def __init__(
        self,
        tokens_per_s: float = 0.0,
        kv_cache_tokens: int = KV_CACHE_TOKENS,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        if tokens_per_s < 0:
            raise ValueError(f"prefill tokens_per_s must be 0 or more (got {tokens_per_s})")
        self.tokens_per_s = tokens_per_s
        self.cache = BlockCache(block_size, kv_cache_tokens)
        self._lane_free_at = 0.0
        """When the prefills taken so far are done."""

    def admit(self, prompt_ids: list[int], now: float) -> Prefilling:
        """Take a prompt at ``now``: its prefill queues in the lane, its blocks are cached."""
        names = self.cache.names(prompt_ids)
        admitted = self.look(len(prompt_ids), names, now)
        if self.tokens_per_s:
            self._lane_free_at = admitted.ready_at
        self.cache.store(names)
        return admitted

    def look(self, prompt_tokens: int, names: list[int], now: float) -> Prefilling:
        """What taking a prompt of ``prompt_tokens`` whose blocks are ``names`` at ``now``
        would give, changing nothing."""
        cached = self.cache.cached_tokens(prompt_tokens, names)
        ready_at = now
        if self.tokens_per_s:
            ready_at = max(now, self._lane_free_at) + (prompt_tokens - cached) / self.tokens_per_s
        return Prefilling(prompt_tokens, cached, ready_at)

    def ended(self, token_ids: list[int]) -> None:
        """A request ended: the blocks of its prompt and its reply (``token_ids``) stay."""
        self.cache.store(self.cache.names(token_ids))
