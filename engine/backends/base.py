"""What the worker needs from an inference engine, and nothing more.

Modelled on vLLM's ``EngineClient``: ``generate`` streams deltas for one request and
``abort`` stops it. Every backend passes the same test suite (tests/test_backend_replies.py,
tests/test_backend_cancels.py).
"""

from __future__ import annotations

import abc
import functools
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.backends.prefix_cache import BLOCK_SIZE
from engine.backends.tool_parsers import VllmToolParser
from wire import GenerationRequest, SamplingParams, ToolCall, Tools, TopLogprob


class AutoParser(Protocol):
    """Finds the calls in a model's whole output (``auto``)."""

    start_marker: str | None
    """What begins a call in this model's format; None: unknown (content is held back
    until the reply ends)."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and the calls in ``text`` (calls' ids are set by the writer)."""
        ...


class BackendError(Exception):
    """A request the backend cannot run; ``code`` goes into the ``error`` event."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Prepared:
    """A request turned into engine input: the prompt's tokens are known before it runs."""

    generation_id: str
    """The engine's request id (``GenerationRequest.engine_request_id``)."""
    prompt_token_ids: list[int]
    params: SamplingParams
    source: GenerationRequest | None = None
    """The request it was made from, for a backend that needs more than the tokens (the
    synthetic engine scripts its reply from the messages)."""
    resumed_tokens: int = 0
    """Completion tokens streamed before a takeover (``GenerationRequest.resume``): the
    engine continues after them, and ``params.max_tokens`` counts what is left."""
    trace_headers: dict[str, str] | None = None
    """The trace the engine's own spans join (vLLM's ``trace_headers``; engine/tracing.py)."""


@dataclass
class Delta:
    """New output of one engine step for one request."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    tokens: list[str] | None = None
    """Each token's own text (set with logprobs: they are reported per token)."""
    top_logprobs: list[list[TopLogprob]] | None = None
    """Per token, the most likely tokens (``SamplingParams.top_logprobs`` of them)."""
    finish_reason: str | None = None
    """Set on the last delta: ``stop``, ``length`` or ``abort``."""
    cached_tokens: int | None = None
    """Set on a request's first delta after its prefill: of its prompt's tokens, those the
    engine's prefix cache held (vLLM's ``RequestOutput.num_cached_tokens``)."""


@dataclass
class PrefillCounts:
    """Prompt tokens of the requests an engine prefilled, and of them those its prefix cache
    held, in the engine's own count (the worker's ``/metrics`` reads them)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0

    def count(self, prompt_tokens: int, cached_tokens: int) -> int:
        """A request's prefill is done: ``cached_tokens`` of its ``prompt_tokens`` came from
        the cache. Returns ``cached_tokens``."""
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        return cached_tokens


class Backend(abc.ABC):
    name: str
    model: str
    capacity: int
    """How many requests it runs at once; the worker takes no more than this."""
    max_model_len: int | None = None
    """Longest prompt plus reply, in tokens; None: no fixed context."""
    traced: bool = False
    """Its engine exports spans of its own (vLLM started with an OTLP endpoint)."""
    tool_call_parser: str | None = None
    """vLLM's tool parser for ``tool_choice: auto`` (``--tool-call-parser``); None: none."""
    ignored_params: frozenset[str] = frozenset()
    """Sampling fields this backend accepts but cannot apply (logged when a request sets
    one; docs/api.md lists them)."""
    kv_block_size: int = BLOCK_SIZE
    """Tokens per block of the engine's KV cache: its prefix cache holds whole blocks."""
    kv_cache_tokens: int | None = None
    """Tokens the engine's KV cache holds (None: not known before ``start``)."""

    @functools.cached_property
    def prefilled(self) -> PrefillCounts:
        """What this engine prefilled, and found in its prefix cache."""
        return PrefillCounts()

    def tokenizer(self) -> Any:
        """What a tool parser is built with (vLLM's parsers take the model's tokenizer)."""
        return None

    def auto_parser(self, tools: Tools) -> AutoParser:
        """The parser that finds the calls in a reply to ``tool_choice: auto``."""
        if self.tool_call_parser is None:
            raise BackendError(
                "auto_tool_choice_unsupported",
                "tool_choice auto needs a worker started with --tool-call-parser (as vLLM "
                "needs --enable-auto-tool-choice); name a function or use required",
            )
        return VllmToolParser(self.tool_call_parser, self.tokenizer(), tools)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, as the model's tokenizer decodes them."""
        raise BackendError("unsupported_task", f"the {self.name} engine cannot detokenize")

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Load the model; called once before the first request."""

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Release the model; called once at shutdown."""

    @property
    def failed(self) -> bool:
        """The engine itself is gone (its process died): nothing runs here any more."""
        return False

    @abc.abstractmethod
    async def prepare(self, request: GenerationRequest) -> Prepared:
        """Tokenize (chat template applied); raises ``BackendError`` for an unusable prompt.

        A request with ``resume`` continues a reply: the engine's input is the prompt plus
        the tokens already streamed, and it yields exactly the deltas the uninterrupted
        run would have yielded next (a deterministic engine, or greedy sampling)."""

    @abc.abstractmethod
    def generate(self, prepared: Prepared) -> AsyncGenerator[Delta, None]:
        """Deltas until one carries a ``finish_reason``. Closing it (``aclose``) stops the
        request in the engine, whenever the engine took it."""

    @abc.abstractmethod
    async def abort(self, generation_id: str) -> None:
        """Stop a running request: its stream ends soon with ``finish_reason="abort"``."""

    @abc.abstractmethod
    def running(self) -> int:
        """Requests the engine itself holds unfinished (not the worker's bookkeeping)."""
