"""A deterministic engine for tests and benchmarks: scripted text at a fixed rate.

The reply to a message is ``You said: <message>.`` followed by a fixed filler text, one word
per token, until ``max_tokens`` or a stop string. It runs like a real engine: one loop steps
``tokens_per_s`` times a second and makes the next token of every running request in each
step, so a worker sees a step's deltas of all requests arrive together, as with vLLM. The same
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

Structured outputs: a ``json`` schema is answered with a small instance of it (every
property, the first of each ``enum``, ``anyOf`` and ``oneOf``), ``json_object`` with ``{}``
and ``choice`` with its first string, a few characters a token, ending ``stop``; ``regex``
and ``grammar`` cannot be scripted and end the request with an ``error``. Logprobs: each
token's own, and as top logprobs the token itself then other words, each less likely.

Prefill: the engine keeps a prefix cache (per worker, LRU by blocks of 16 tokens, 64 Ki
tokens unless told; a word is a token) and, with ``prefill_tokens_per_s``, spends that long
on each prompt's uncached tokens before its first token (engine/backends/prefill.py); each
request's first delta says how many of its prompt's tokens the cache held, as vLLM does.

A request that continues the conversation's last (assistant) message goes on with the
script where that message's words end, so a reply and its continuation read exactly as
one longer reply.

Faults for tests, written into the message: ``[[fail:N]]`` fails the request after N tokens,
``[[stall]]`` stops producing tokens (the request stays running until aborted),
``[[crash:N]]`` ends the whole worker process after N tokens, ``[[crash:prepare]]`` while it
prepares the request (before the worker claims it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import zlib
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.backends.base import Backend, BackendError, Delta, PrefillCounts, Prepared
from engine.backends.prefill import KV_CACHE_TOKENS, Prefill, Prefilling
from engine.backends.prefix_cache import BLOCK_SIZE
from wire import GenerationRequest, SamplingParams, StructuredOutput, TopLogprob

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
CRASH_PREPARING = "[[crash:prepare]]"


def _word_id(word: str) -> int:
    return zlib.crc32(word.encode()) % 50_000


def prompt_token_ids(texts: Iterable[str | None]) -> list[int]:
    """The prompt of a request whose messages (or prompt) are ``texts``: a word a token."""
    return [_word_id(word) for text in texts for word in (text or "").split()]


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


STRUCTURED_CHUNK = 4
"""Characters per token of a structured reply."""


def structured_reply(wanted: StructuredOutput) -> list[str]:
    """The tokens of the synthetic engine's answer to a structured-output request."""
    if wanted.choice is not None:
        text = wanted.choice[0]
    elif wanted.json is not None:
        text = json.dumps(schema_instance(json.loads(wanted.json)))
    elif wanted.kind == "json_object":
        text = "{}"
    else:
        raise BackendError(
            "unsupported_constraint",
            f"the synthetic engine cannot script a {wanted.kind} constraint",
        )
    return [text[at : at + STRUCTURED_CHUNK] for at in range(0, len(text), STRUCTURED_CHUNK)]


def schema_instance(schema: object) -> object:
    """A small value that validates against ``schema`` (the subset tests use)."""
    if not isinstance(schema, dict):
        return {}
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    for union in ("anyOf", "oneOf", "allOf"):
        if union in schema:
            return schema_instance(schema[union][0])
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = kind[0]
    if kind == "object":
        properties = schema.get("properties", {})
        return {name: schema_instance(sub) for name, sub in properties.items()}
    if kind == "array":
        return [schema_instance(schema.get("items", {})) for _ in range(schema.get("minItems", 1))]
    if kind == "string":
        return "x" * max(1, schema.get("minLength", 1))
    if kind in ("integer", "number"):
        return schema.get("minimum", 1)
    if kind == "boolean":
        return True
    return None


def top_logprobs(token: ScriptedToken, index: int, top: int) -> list[TopLogprob]:
    """The ``top`` most likely tokens at position ``index``: the sampled one first."""
    ranked = [TopLogprob(token.text, token.logprob, token.id)]
    for rank in range(1, top):
        word = " " + FILLER[(index + rank) % len(FILLER)]
        ranked.append(TopLogprob(word, token.logprob - rank, _word_id(word.strip())))
    return ranked


def reply_words(request: GenerationRequest) -> list[str]:
    """The script of a request: the reply to its prompt, or to its last user message."""
    if request.prompt is not None:
        return script_of(request.prompt)
    users = [m.content for m in request.messages if m.role == "user"]
    return script_of(users[-1] if users else "")


class SyntheticBackend(Backend):
    name = "synthetic"
    ignored_params = frozenset(
        {"min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias"}
    )

    def __init__(
        self,
        tokens_per_s: float = 50.0,
        capacity: int = 256,
        prepare_delay_s: float = 0.0,
        model: str = "synthetic",
        prepare_cpu_s: float = 0.0,
        prefill_tokens_per_s: float = 0.0,
        kv_cache_tokens: int = KV_CACHE_TOKENS,
        kv_block_size: int = BLOCK_SIZE,
    ) -> None:
        self.model = model
        self.tokens_per_s = tokens_per_s
        self.capacity = capacity
        self.prepare_delay_s = prepare_delay_s
        """Time each request spends taken but not started (fault tests: a worker that dies
        holding requests it never started)."""
        self.prepare_cpu_s = prepare_cpu_s
        """CPU each prepare spends on the caller's event loop, as vLLM's chat template and
        tokenizer do: a burst of requests is admitted one after another, as with vLLM."""
        self.prefill = Prefill(prefill_tokens_per_s, kv_cache_tokens, kv_block_size)
        """Its prefix cache, and the time a prompt's uncached tokens take."""
        self.kv_block_size, self.kv_cache_tokens = kv_block_size, kv_cache_tokens
        self._runs: dict[str, _Run] = {}
        self._stepper: asyncio.Task[None] | None = None
        self._crashing = False
        """A step reached a ``[[crash:N]]``: ``_crash_if_asked`` ends the process."""

    def tokenizer(self) -> Any:
        # A script has no tokenizer; vLLM's text-format parsers (hermes) only need one given.
        return "synthetic"

    async def prepare(self, request: GenerationRequest) -> Prepared:
        texts = [m.content for m in request.messages] if request.messages else [request.prompt]
        prompt_ids = prompt_token_ids(texts)
        ignored = _set_fields(request.params, self.ignored_params)
        if ignored:
            log.info(
                "%s: the synthetic engine ignores %s (scripted text)",
                request.generation_id,
                ", ".join(ignored),
            )
        if request.params.structured is not None:
            structured_reply(request.params.structured)  # one it cannot script ends here
        if CRASH_PREPARING in reply_words(request):
            os._exit(17)
        if self.prepare_cpu_s:
            spend_cpu(self.prepare_cpu_s)
        if self.prepare_delay_s:
            await asyncio.sleep(self.prepare_delay_s)
        done = request.resume.completion_tokens if request.resume else 0
        params = msgspec.structs.replace(
            request.params, max_tokens=request.params.max_tokens - done
        )
        return Prepared(
            request.engine_request_id, prompt_ids, params, source=request, resumed_tokens=done
        )

    async def generate(self, prepared: Prepared) -> AsyncGenerator[Delta, None]:
        assert prepared.source is not None, "prepared by another backend"
        if prepared.params.max_tokens <= 0:  # a takeover of a reply already at its end
            yield Delta("", finish_reason="length")
            return
        loop = asyncio.get_running_loop()  # once: CPython 3.11 makes it a getpid() call
        admitted = self.prefill.admit(prepared.prompt_token_ids, loop.time())
        run = _Run(prepared, admitted, self.prefilled)
        self._runs[run.gid] = run
        if self._stepper is None:  # idle: the request's first step runs now
            produced, busy = self._step(loop.time())
            if busy:
                self._stepper = asyncio.create_task(
                    self._step_forever(produced), name="synthetic-steps"
                )
        try:
            while True:
                if not run.pending and run.error is None:
                    run.waiter = loop.create_future()
                    try:
                        await run.waiter
                    finally:
                        run.waiter = None
                deltas, run.pending = run.pending, []
                for delta in deltas:
                    yield delta
                    if delta.finish_reason is not None:
                        return
                if run.error is not None:
                    raise run.error
        finally:
            self._runs.pop(run.gid, None)
            self.prefill.ended([*prepared.prompt_token_ids, *run.output_ids])

    def _step(self, now: float) -> tuple[bool, bool]:
        """One engine step at ``now`` (the loop's clock): each running request's next token
        (none for a request still in its prefill). Returns whether it made any, and whether
        any request runs on after it."""
        produced = busy = False
        for run in list(self._runs.values()):
            produced = run.step(now) or produced
            if run.crash:
                self._crashing = True
            busy = busy or not (run.ended or run.error is not None)
        return produced, busy

    def _crash_if_asked(self) -> None:
        """``[[crash:N]]`` reached: the process ends, in the engine's loop (a first step
        made at once leaves it to the loop's next pass, so what the worker emitted before
        it, a claim above all, goes out first, as with an engine core that dies)."""
        if self._crashing:
            os._exit(17)

    async def _step_forever(self, produced: bool) -> None:
        """The engine's loop after a first step (``produced``: it made a token): one step
        every 1 / ``tokens_per_s`` s while any request runs, each running request's next
        token in it (as vLLM's engine core steps its batch). A request that arrives while
        it sleeps joins the next step; one that arrives when it is idle makes its first
        step at once, in ``generate`` (as an idle engine takes a request at once), and
        starts it. Unpaced, it steps again as soon as the consumers of the last step have
        run. It ends with the step that ends its last request (a request cancelled between
        steps leaves it to finish its sleep first)."""
        loop = asyncio.get_running_loop()
        period = 1.0 / self.tokens_per_s if self.tokens_per_s > 0 else 0.0
        next_at = loop.time()
        try:
            while True:
                if period:
                    next_at += period
                    now = loop.time()
                    if next_at < now:  # late (a busy loop): no burst of steps to catch up
                        next_at = now
                    await asyncio.sleep(next_at - now)
                else:
                    await asyncio.sleep(0 if produced else 0.01)
                self._crash_if_asked()
                produced, busy = self._step(loop.time())
                self._crash_if_asked()
                if not busy:
                    return
        finally:
            self._stepper = None

    async def stop(self) -> None:
        """The stepping loop ends with the engine: after an abort it may still be asleep
        until its next step, which would find nothing left to run."""
        stepper = self._stepper
        if stepper is not None:
            stepper.cancel()
            await asyncio.gather(stepper, return_exceptions=True)

    async def abort(self, generation_id: str) -> None:
        run = self._runs.get(generation_id)
        if run is not None:
            run.abort()

    def running(self) -> int:
        return sum(1 for run in self._runs.values() if not run.ended)


class _Run:
    """One request inside the engine: where its script is, and the deltas its consumer has
    not taken yet (several when it fell behind the steps; none is ever dropped)."""

    __slots__ = (
        "counts",
        "crash",
        "ended",
        "error",
        "fault",
        "fault_at",
        "gid",
        "index",
        "last",
        "offset",
        "output_ids",
        "params",
        "pending",
        "ready_at",
        "script",
        "structured",
        "text",
        "unreported",
        "waiter",
    )

    def __init__(self, prepared: Prepared, admitted: Prefilling, counts: PrefillCounts) -> None:
        source = prepared.source
        assert source is not None
        self.gid = prepared.generation_id
        self.script = reply_words(source)
        structured = prepared.params.structured
        self.structured = structured_reply(structured) if structured is not None else None
        """The tokens of a structured reply, which ends after them (``stop``)."""
        fault = _FAULT.search(" ".join(self.script))
        self.fault = fault.group(1) if fault is not None else None
        self.fault_at = int(fault.group(2) or 0) if fault is not None else 0
        self.params = prepared.params
        self.index = prepared.resumed_tokens
        self.offset = len(source.continued.split())
        """Words of the message it continues: its script goes on after them."""
        self.last = self.index + prepared.params.max_tokens - 1
        self.text = source.resume.text if source.resume is not None else ""
        self.pending: list[Delta] = []
        self.waiter: asyncio.Future[None] | None = None
        self.error: BackendError | None = None
        self.ended = False
        self.crash = False
        self.ready_at = admitted.ready_at
        """When its prefill is done: no token before."""
        self.unreported: Prefilling | None = admitted
        """Its prefill, until its first delta reports it (then None)."""
        self.counts = counts
        self.output_ids: list[int] = []

    def abort(self) -> None:
        if not self.ended:
            self._put(Delta("", finish_reason="abort"))

    def step(self, now: float) -> bool:
        """Make this request's next token (one engine step at ``now``); False when it made
        none."""
        if self.ended or self.error is not None or now < self.ready_at:
            return False
        index = self.index
        if self.fault is not None and index >= self.fault_at:
            if self.fault == "fail":
                self.error = BackendError(
                    "engine_error", "synthetic failure requested by the prompt"
                )
                self._wake()
            elif self.fault == "crash":
                self.crash = True
            return False  # stall: nothing until aborted
        self.index += 1
        params = self.params
        if self.structured is not None:
            self._put(self._structured_delta(index))
            return True
        token = scripted_token(self.script, index + self.offset)
        piece, ids, logprobs = token.text, [token.id], [token.logprob]
        self.text += piece
        text = self.text
        may_stop = index + 1 > params.min_tokens
        stop, at = _stop_in(text, len(piece), params.stop) if may_stop else (None, -1)
        if stop is not None:
            end = at + (len(stop) if params.include_stop_str_in_output else 0)
            keep = piece[: max(0, len(piece) - (len(text) - end))]
            self._put(Delta(keep, ids, logprobs, finish_reason="stop"))
        elif may_stop and token.id in params.stop_token_ids:
            keep = piece if params.include_stop_str_in_output else ""
            self._put(Delta(keep, ids, logprobs, finish_reason="stop"))
        else:
            finish = "length" if index == self.last else None
            self._put(Delta(piece, ids, logprobs, finish_reason=finish))
        return True

    def _structured_delta(self, index: int) -> Delta:
        chunks = self.structured
        assert chunks is not None
        text = chunks[index] if index < len(chunks) else ""
        token = ScriptedToken(text, _word_id(text), -0.05 * (index % 7))
        finish = "stop" if index >= len(chunks) - 1 else None
        if finish is None and index == self.last:
            finish = "length"
        self.text += text
        return Delta(text, [token.id], [token.logprob], finish_reason=finish)

    def _put(self, delta: Delta) -> None:
        if self.unreported is not None and delta.finish_reason != "abort":
            admitted, self.unreported = self.unreported, None
            delta.cached_tokens = self.counts.count(admitted.prompt_tokens, admitted.cached_tokens)
        self.output_ids += delta.token_ids
        if delta.token_ids and self.params.logprobs:
            # One token a step: its text is the delta's (a stop string may have cut it).
            index = self.index - 1 + self.offset
            delta.tokens = [delta.text]
            top = self.params.top_logprobs
            if top:
                logprob = delta.logprobs[0] if delta.logprobs else 0.0
                token = ScriptedToken(delta.text, delta.token_ids[0], logprob)
                delta.top_logprobs = [top_logprobs(token, index, top)]
        elif not self.params.logprobs:
            delta.logprobs = None
        self.pending.append(delta)
        if delta.finish_reason is not None:
            self.ended = True
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def spend_cpu(seconds: float) -> None:
    """Keep this thread busy for ``seconds`` of its own CPU time (time taken from it by
    other processes does not count, as it would not for real work)."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


_DEFAULT_PARAMS = SamplingParams()


def _set_fields(params: SamplingParams, names: frozenset[str]) -> list[str]:
    """Which of ``names`` the request sets away from their defaults."""
    default = _DEFAULT_PARAMS
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
