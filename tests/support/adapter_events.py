"""Contract events and the bytes an adapter writes for them, for the in-process adapter
tests (tests/inprocess/test_*_chunks.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from gateway.core.generation_stream import Collected, TokenPiece
from gateway.core.walk import GenerationItem
from wire import Done, Started, Token, Usage

CREATED = 1_700_000_000
DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"


def compact(body: object) -> bytes:
    """JSON as msgspec writes it: no spaces, UTF-8, keys in the order given."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def data(body: object) -> bytes:
    """One SSE ``data:`` frame."""
    return b"data: " + compact(body) + b"\n\n"


class Indexed(AsyncIterator[list[tuple[int, GenerationItem]]]):
    """What ``Choices.batches`` yields: ``(choice, event)`` pairs, one per batch; an event
    given alone belongs to choice 0. No async generator, so nothing is left to finalise
    when a writer stops early."""

    def __init__(self, *events: GenerationItem | tuple[int, GenerationItem]) -> None:
        self.events = iter(events)

    async def __anext__(self) -> list[tuple[int, GenerationItem]]:
        try:
            event = next(self.events)
        except StopIteration:
            raise StopAsyncIteration from None
        return [event if isinstance(event, tuple) else (0, event)]


async def written(chunks: AsyncIterator[bytes]) -> list[bytes]:
    """The frames written, one per entry, however they were grouped into writes."""
    frames: list[bytes] = []
    async for chunk in chunks:
        frames += [frame + b"\n\n" for frame in chunk.split(b"\n\n")[:-1]] or [chunk]
    return frames


def tok(text: str, count: int, ids: list[int], logprobs: list[float] | None = None) -> Token:
    return Token("g", text, count, ids, logprobs)


STARTED = Started("g", "smol", 3)
HELLO = [tok("Hel", 1, [10], [-0.5]), tok("lo", 2, [11], [-0.25])]
DONE_STOP = Done("g", "stop", Usage(3, 2))


def collected(model: str = "smol", logprobs: list[float | None] | None = None) -> Collected:
    lps = logprobs or [None, None]
    pieces = [TokenPiece(10, "Hel", lps[0], "Hel"), TokenPiece(11, "lo", lps[1], "lo")]
    return Collected(model, 3, "Hello", pieces, DONE_STOP)
