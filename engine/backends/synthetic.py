"""A deterministic engine for tests and benchmarks: scripted text at a fixed rate.

The reply to a message is ``You said: <message>.`` followed by a fixed filler text, one word
per token, at ``tokens_per_s`` per request, until ``max_tokens`` or a stop string. The same
request always yields the same tokens, so a test can check every byte a client receives;
word N depends only on the request and N, so a reply taken over after N tokens goes on
byte for byte as the uninterrupted one.

Sampling: the text is scripted, so temperature, top_p, top_k and seed change nothing. Of
the fields that end or shape a reply it honours ``max_tokens``, ``stop``, ``stop_token_ids``
(a word's id is ``crc32(word) % 50000``), ``min_tokens`` (no stop before it),
``include_stop_str_in_output`` and ``ignore_eos`` (it never ends on an EOS anyway); it has no
special tokens, so ``skip_special_tokens`` and ``spaces_between_special_tokens`` hold
trivially. ``min_p``, ``repetition_penalty``, ``frequency_penalty`` and ``presence_penalty``
cannot apply to a script: a request that sets one gets a log line saying so.

Faults for tests, written into the message: ``[[fail:N]]`` fails the request after N tokens,
``[[stall]]`` stops producing tokens (the request stays running until aborted),
``[[crash:N]]`` ends the whole worker process after N tokens.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from engine.backends.base import Backend, BackendError, Delta, Prepared
from wire import GenerationRequest, SamplingParams

log = logging.getLogger("tokenspout.synthetic")

FILLER = [
    "The",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "streams",
    "of",
    "tokens",
    "flow",
    "through",
    "Redis",
    "to",
    "every",
    "reader",
    "in",
    "order,",
    "and",
    "nothing",
    "is",
    "lost",
    "when",
    "a",
    "network",
    "drops.",
]
_FAULT = re.compile(r"\[\[(fail|stall|crash)(?::(\d+))?\]\]")


def _word_id(word: str) -> int:
    return zlib.crc32(word.encode()) % 50_000


@dataclass(frozen=True)
class ScriptedToken:
    """One token of the script: its text (with the space before it), id and logprob."""

    text: str
    id: int
    logprob: float


def script_of(message: str) -> list[str]:
    """The first words of the reply to ``message`` (the filler that follows repeats forever)."""
    return ["You", "said:", *message.split(), "|"]


def scripted_token(script: list[str], index: int) -> ScriptedToken:
    """Token ``index`` of the reply that begins with ``script``: it depends on nothing else."""
    word = script[index] if index < len(script) else FILLER[index % len(FILLER)]
    return ScriptedToken(word if index == 0 else " " + word, _word_id(word), -0.05 * (index % 7))


def scripted_reply(message: str, max_tokens: int) -> list[ScriptedToken]:
    """The reply to ``message`` the backend streams, unless a stop string or fault ends it
    first: ``max_tokens`` tokens (the oracle of every test that checks a synthetic reply)."""
    script = script_of(message)
    return [scripted_token(script, index) for index in range(max_tokens)]


def reply_words(request: GenerationRequest) -> list[str]:
    """The script of a request: the reply to its prompt, or to its last user message."""
    if request.prompt is not None:
        return script_of(request.prompt)
    users = [m.content for m in request.messages if m.role == "user"]
    return script_of(users[-1] if users else "")


class SyntheticBackend(Backend):
    name = "synthetic"
    ignored_params = frozenset(
        {"min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"}
    )

    def __init__(
        self,
        tokens_per_s: float = 50.0,
        capacity: int = 256,
        prepare_delay_s: float = 0.0,
        model: str = "synthetic",
    ) -> None:
        self.model = model
        self.tokens_per_s = tokens_per_s
        self.capacity = capacity
        self.prepare_delay_s = prepare_delay_s
        """Time each request spends taken but not started (fault tests: a worker that dies
        holding requests it never started)."""
        self._aborted: set[str] = set()
        self._running: set[str] = set()

    async def prepare(self, request: GenerationRequest) -> Prepared:
        words = [m.content for m in request.messages] if request.messages else [request.prompt]
        prompt_ids = [_word_id(word) for text in words for word in (text or "").split()]
        ignored = _set_fields(request.params, self.ignored_params)
        if ignored:
            log.info(
                "%s: the synthetic engine ignores %s (scripted text)",
                request.generation_id,
                ", ".join(ignored),
            )
        if self.prepare_delay_s:
            await asyncio.sleep(self.prepare_delay_s)
        done = request.resume.completion_tokens if request.resume else 0
        params = msgspec.structs.replace(
            request.params, max_tokens=request.params.max_tokens - done
        )
        return Prepared(
            request.engine_request_id, prompt_ids, params, source=request, resumed_tokens=done
        )

    async def generate(self, prepared: Prepared) -> AsyncIterator[Delta]:
        gid = prepared.generation_id
        assert prepared.source is not None, "prepared by another backend"
        script = reply_words(prepared.source)
        fault = _FAULT.search(" ".join(script))
        params = prepared.params
        loop = asyncio.get_running_loop()
        first = prepared.resumed_tokens
        resume = prepared.source.resume
        start, text = loop.time(), resume.text if resume is not None else ""
        if params.max_tokens <= 0:  # a takeover of a reply already at its end
            yield Delta("", finish_reason="length")
            return
        self._running.add(gid)
        try:
            for index in range(first, first + params.max_tokens):
                if self.tokens_per_s > 0:
                    due = start + (index - first) / self.tokens_per_s
                    await asyncio.sleep(max(0.0, due - loop.time()))
                if gid in self._aborted:
                    yield Delta("", finish_reason="abort")
                    return
                if fault is not None and index >= int(fault.group(2) or 0):
                    await self._fault(fault.group(1), gid)
                    continue
                token = scripted_token(script, index)
                piece, ids, logprobs = token.text, [token.id], [token.logprob]
                text += piece
                may_stop = index + 1 > params.min_tokens
                stop, at = _stop_in(text, len(piece), params.stop) if may_stop else (None, -1)
                if stop is not None:
                    end = at + (len(stop) if params.include_stop_str_in_output else 0)
                    keep = piece[: max(0, len(piece) - (len(text) - end))]
                    yield Delta(keep, ids, logprobs, finish_reason="stop")
                    return
                if may_stop and token.id in params.stop_token_ids:
                    keep = piece if params.include_stop_str_in_output else ""
                    yield Delta(keep, ids, logprobs, finish_reason="stop")
                    return
                last = index + 1 == first + params.max_tokens
                finish = "length" if last else None
                yield Delta(piece, ids, logprobs, finish_reason=finish)
        finally:
            self._running.discard(gid)
            self._aborted.discard(gid)

    async def _fault(self, kind: str, gid: str) -> None:
        if kind == "fail":
            raise BackendError("engine_error", "synthetic failure requested by the prompt")
        if kind == "crash":
            os._exit(17)
        while gid not in self._aborted:  # stall until aborted
            await asyncio.sleep(0.01)

    async def abort(self, generation_id: str) -> None:
        if generation_id in self._running:
            self._aborted.add(generation_id)

    def running(self) -> int:
        return len(self._running)


def _set_fields(params: SamplingParams, names: frozenset[str]) -> list[str]:
    """Which of ``names`` the request sets away from their defaults."""
    default = SamplingParams()
    return sorted(name for name in names if getattr(params, name) != getattr(default, name))


def _stop_in(text: str, new: int, stops: list[str]) -> tuple[str | None, int]:
    """The first stop string that ends in the last ``new`` characters, and where it begins
    (as vLLM checks: text before ``min_tokens`` was never checked and stays)."""
    for stop in stops:
        if stop:
            at = text.find(stop, max(0, len(text) - new - len(stop) + 1))
            if at >= 0:
                return stop, at
    return None, -1
