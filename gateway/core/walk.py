"""A generation's events as an API sees them, and the one walk over them.

Every API that answers a stateless generation (OpenAI chat and completions, TGI, the Open
Inference Protocol over HTTP and over gRPC, and a whole answer's ``collect``) turns the
same events into its own format. What arrives together, when the answer ends (every
choice done, or the first one that ended otherwise) and which event is which are the
walk's, here once; how an event reads in one format is that API's ``Spelling``.

    async for write in walk(choices.batches(), TgiSpelling(request)):
        ...   # one write per delivery of the relay, the last one marked
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from typing import Protocol, TypeVar

import msgspec

from wire import Cancelled, Done, Error, Started, Token


class Heartbeat(msgspec.Struct, frozen=True):
    """Nothing happened for ``heartbeat_s``: write a keep-alive so proxies keep the stream."""


GenerationItem = Started | Token | Heartbeat | Done | Cancelled | Error
IndexedItem = tuple[int, GenerationItem]
"""An item and the choice (of a request's ``n``) it is of."""

Out = TypeVar("Out")
Write = TypeVar("Write", covariant=True)


class Spelling(Protocol[Out, Write]):
    """How one API spells a generation's events: each method appends what its event reads
    as (nothing, one piece or several) to ``out``, the pieces of one delivery, and
    ``write`` makes them one write. A heartbeat, a ``started`` event and a delivery's end
    spell nothing unless the API says otherwise."""

    def heartbeat(self, out: list[Out]) -> None:
        return None

    def started(self, choice: int, event: Started, out: list[Out]) -> None:
        return None

    def token(self, choice: int, event: Token, out: list[Out]) -> None: ...

    def done(self, choice: int, event: Done, out: list[Out]) -> None: ...

    def ended_early(self, choice: int, event: Cancelled | Error, out: list[Out]) -> None:
        """The choice was cancelled or failed: the answer ends with it."""

    def delivered(self, out: list[Out]) -> None:
        """The end of what arrived together (gRPC answers a delivery's tokens at once)."""
        return None

    def write(self, out: list[Out], last: bool) -> Write:
        """One write of ``out``; ``last``: nothing follows it."""


async def walk(
    batches: AsyncIterable[list[IndexedItem]], spelling: Spelling[Out, Write], choices: int = 1
) -> AsyncIterator[Write]:
    """``spelling``'s writes of ``batches``, one per delivery that spells anything. The last
    is marked when every choice has ended with ``done`` (the batches end there too), or is
    the one of the first choice that ended otherwise: then the walk stops at once, its
    batches closed (the others' generations are the caller's to close)."""
    done = 0
    out: list[Out] = []
    try:
        async for batch in batches:
            for choice, item in batch:
                if isinstance(item, Token):  # by far the most common: asked first
                    spelling.token(choice, item, out)
                elif isinstance(item, Heartbeat):
                    spelling.heartbeat(out)
                elif isinstance(item, Started):
                    spelling.started(choice, item, out)
                elif isinstance(item, Done):
                    spelling.done(choice, item, out)
                    done += 1
                else:
                    spelling.ended_early(choice, item, out)
                    yield spelling.write(out, True)
                    return
            spelling.delivered(out)
            if out:
                yield spelling.write(out, done == choices)
                out = []
    finally:
        if isinstance(batches, AsyncGenerator):
            await batches.aclose()
