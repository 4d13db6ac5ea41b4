"""One stateless generation as a stream of typed events: what every API adapter builds on.

The OpenAI, TGI and Open Inference Protocol adapters differ only in how they spell a token,
an ending and an error (gateway/core/walk.py). Submitting the generation, following its
session's feed, keeping the connection alive while it waits, and aborting it when the client
goes away happen here once, for all of them.

    generation = await GenerationStream.submit(submitter, hub, ask, heartbeat_s)
    async for batch in generation.batches():     # [(choice, Started | Token | ...), ...]
        ...
    # generation.close() (a background task of the response) cancels it if it did not end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

import anyio
import msgspec
from redis.exceptions import RedisError

from gateway.core.ask import GenerationAsk
from gateway.core.errors import AGAIN_AFTER_S, BadRequest, GatewayError, NotFound, Unavailable
from gateway.core.relay.feed import Feed
from gateway.core.relay.hub import RelayHub
from gateway.core.store.submitter import CancelOutcome, Submitted, Submitter
from gateway.core.tools import add_to_call
from gateway.core.walk import Heartbeat, IndexedItem, Spelling, walk
from wire import (
    Cancelled,
    Done,
    Error,
    FinalEvent,
    Started,
    Token,
    ToolCall,
    TopLogprob,
    decode_event,
)
from wire.connect import RETRY_MAX_S

log = logging.getLogger("tokenspout.generations")

ABORT_RETRY_FOR_S = 10.0
"""How long the abort of a generation whose client went away is tried again while Redis
refuses it (a failover under way): past it, the readers' abandon grace ends the reply
(``TOKENSPOUT_ABANDON_GRACE_S``)."""


class TokenPiece(NamedTuple):
    id: int
    text: str
    """Its share of the delta's text: the pieces' texts add up to exactly the reply."""
    logprob: float | None
    token: str
    """The token's own text (``Token.tokens``; the piece's text when the engine sent none)."""
    top: list[TopLogprob] | None = None


def per_token(token: Token) -> list[TokenPiece]:
    """A token event as one piece per token id. An engine step can hold several tokens in
    one text delta; its whole text goes with the first of them, so the texts still add up
    to exactly what the engine produced. Each token's own text, for the logprob formats,
    comes from ``Token.tokens`` when the request asked for logprobs."""
    ids = token.token_ids
    logprobs: list[float | None] = list(token.logprobs or [])
    logprobs += [None] * (len(ids) - len(logprobs))
    own = token.tokens if token.tokens is not None and len(token.tokens) == len(ids) else None
    tops = token.top_logprobs if token.top_logprobs is not None else None
    pieces = []
    for index, token_id in enumerate(ids):
        text = token.text if index == 0 else ""
        pieces.append(
            TokenPiece(
                token_id,
                text,
                logprobs[index],
                own[index] if own is not None else text,
                tops[index] if tops is not None and index < len(tops) else None,
            )
        )
    return pieces


class Collected(msgspec.Struct):
    """A whole generation, for the non-streaming answers."""

    model: str
    prompt_tokens: int
    text: str
    pieces: list[TokenPiece]
    """The tokens, with their text as the engine's steps delivered it (see ``per_token``)."""
    final: Done
    tool_calls: list[ToolCall] = []
    """The calls the reply made (``text`` is then its content only)."""
    prompt_token_ids: list[int] | None = None
    """The prompt's tokens, when the request only tokenized (``Started.prompt_token_ids``)."""


ENGINE_ERROR_STATUS = {
    "prompt_too_long": 422,
    "auto_tool_choice_unsupported": 422,
    "unsupported_constraint": 422,
    "invalid_constraint": 422,
    "unsupported_task": 422,
    "invalid_tokens": 422,
}
"""Engine error codes that are the client's fault; every other one is a 503."""


def final_error(final: Error | Cancelled) -> GatewayError:
    """A generation that did not finish, as the error a non-streaming answer raises: a 503
    says when to send it again (a worker or Redis lost it, the gateway shut down), unless
    the request itself is at fault (422)."""
    if isinstance(final, Cancelled):
        return Unavailable(
            f"the generation was cancelled ({final.reason})",
            code="cancelled",
            retry_after_s=AGAIN_AFTER_S,
        )
    if ENGINE_ERROR_STATUS.get(final.code) == 422:
        return BadRequest(final.message, code=final.code)
    return Unavailable(final.message, code=final.code, retry_after_s=AGAIN_AFTER_S)


class Collector(Spelling[Collected, list[Collected]]):
    """A whole generation, gathered from its events: ``Collected`` at its ``done``; a
    generation that did not finish raises the error a non-streaming answer gives."""

    def __init__(self) -> None:
        self.model, self.prompt_tokens = "", 0
        self.prompt_token_ids: list[int] | None = None
        self.text: list[str] = []
        self.pieces: list[TokenPiece] = []
        self.calls: dict[int, ToolCall] = {}

    def started(self, choice: int, event: Started, out: list[Collected]) -> None:
        self.model, self.prompt_tokens = event.model, event.prompt_tokens
        self.prompt_token_ids = event.prompt_token_ids

    def token(self, choice: int, event: Token, out: list[Collected]) -> None:
        self.text.append(event.visible)
        self.pieces.extend(per_token(event))
        for delta in event.tool_calls or ():
            self.calls[delta.index] = add_to_call(self.calls.get(delta.index), delta)

    def done(self, choice: int, event: Done, out: list[Collected]) -> None:
        calls = [self.calls[index] for index in sorted(self.calls)]
        whole = "".join(self.text)
        out.append(
            Collected(
                self.model,
                self.prompt_tokens,
                whole,
                self.pieces,
                event,
                calls,
                self.prompt_token_ids,
            )
        )

    def ended_early(self, choice: int, event: Cancelled | Error, out: list[Collected]) -> None:
        raise final_error(event)

    def write(self, out: list[Collected], last: bool) -> list[Collected]:
        return out


class GenerationStream:
    """The events of one submitted generation, in order, ending with its final event."""

    def __init__(
        self,
        submitter: Submitter,
        hub: RelayHub,
        submitted: Submitted,
        heartbeat_s: float,
        feed: Feed,
        feed_open: contextlib.AsyncExitStack,
        choice: int = 0,
    ) -> None:
        self.submitter = submitter
        self.hub = hub
        self.submitted = submitted
        self.heartbeat_s = heartbeat_s
        self.choice = choice
        """Which of its request's ``n`` choices it is: its items carry it."""
        self.final: FinalEvent | None = None
        self._feed = feed
        self._feed_open = feed_open
        """Holds the feed open from before the submit until ``close``."""

    @classmethod
    async def submit(
        cls,
        submitter: Submitter,
        hub: RelayHub,
        ask: GenerationAsk,
        model: str,
        heartbeat_s: float,
        choice: int = 0,
    ) -> GenerationStream:
        """Queue it for ``model`` (``ask.model`` resolved); ``choice``: which of a
        request's choices it is (``Submitter.submit_stateless``).

        The new session's feed opens first, so its events come live from the first one,
        with no read of the session's stream (``RelayHub.open_new_session``)."""
        feed_open = contextlib.AsyncExitStack()
        try:
            feed = await feed_open.enter_async_context(hub.open_new_session())
            submitted = await submitter.submit_stateless(
                ask, model, session_id=feed.session_id, choice=choice
            )
        except BaseException:
            await feed_open.aclose()
            raise
        return cls(submitter, hub, submitted, heartbeat_s, feed, feed_open, choice)

    @property
    def generation_id(self) -> str:
        return self.submitted.generation_id

    async def batches(self) -> AsyncIterator[list[IndexedItem]]:
        """Started, tokens and heartbeats, then exactly one final event (and nothing after),
        each with this generation's choice, as the feed delivers them: what arrived
        together comes in one list (several tokens when the reader fell behind), so a
        transport writes it at once."""
        choice = self.choice
        async with self._feed_open:
            feed = self._feed
            while self.final is None:
                batch = await feed.next_batch(self.heartbeat_s)
                self.hub.raise_if_cut()
                if not batch:
                    yield [(choice, Heartbeat())]
                    continue
                items: list[IndexedItem] = []
                for relayed in batch:
                    if relayed.generation_id != self.generation_id:
                        continue
                    event = decode_event(relayed.data)
                    if isinstance(event, Done | Cancelled | Error):
                        self.final = event
                        items.append((choice, event))
                        break
                    if isinstance(event, Started | Token):
                        items.append((choice, event))
                    # ``queued`` and ``resumed`` (a takeover: the tokens simply go on) have
                    # no place in the API formats: skipped.
                if items:
                    yield items

    async def collect(self) -> Collected:
        """Wait for the whole generation; raise the adapter's error if it did not finish."""
        wholes: list[Collected] = []
        try:
            async for written in walk(self.batches(), Collector()):
                wholes += written  # once: at its ``done``
        finally:
            await self.close()
        return wholes[0]

    async def close(self) -> None:
        """Abort the generation in the engine unless it already ended (client gone)."""
        await self._feed_open.aclose()
        if self.final is not None:
            return
        with anyio.CancelScope(shield=True):
            outcome = await self._abort()
        if outcome is not None and outcome.final is not None:
            self.final = outcome.final

    async def _abort(self) -> CancelOutcome | None:
        """The disconnect's cancel, tried again while Redis refuses it; None: not taken."""
        give_up_at = time.monotonic() + ABORT_RETRY_FOR_S
        backoff = 0.05
        while True:
            try:
                return await self.submitter.cancel(
                    self.submitted.session_id, self.generation_id, reason="disconnected"
                )
            except NotFound:
                # Its keys are gone (Redis lost them): a worker that still runs it is
                # stopped by Redis refusing its next event (engine/worker.py _on_rejected).
                log.info("no generation %s left to abort", self.generation_id)
                return None
            except (RedisError, OSError) as exc:
                if time.monotonic() + backoff > give_up_at:
                    log.warning(
                        "generation %s: its client is gone but Redis refused its abort for "
                        "%.0f s (%r); the readers' abandon grace will end it",
                        self.generation_id,
                        ABORT_RETRY_FOR_S,
                        exc,
                    )
                    return None
                log.info("generation %s: abort refused (%r), trying again", self.generation_id, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)
