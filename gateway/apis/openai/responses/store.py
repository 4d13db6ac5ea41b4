"""``/v1/responses`` responses, each one generation in a session of its own.

A response's id names its session and generation (``resp_<session id>.<generation id>``),
so any replica finds it in Redis with no lookup table. What the request was lives in the
session's meta hash (``ResponseRecord``); what the reply is lives in the session's event
stream, from which ``ResponseRenderer`` (gateway/apis/openai/responses/events.py) derives every
Responses event and its ``sequence_number``. The session's TTL (``TOKENSPOUT_RESPONSES_TTL_S``)
is the stored response's lifetime; a background one carries a ``keep`` key, so workers
never abandon it for want of a reader.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import anyio
import msgspec

from gateway.apis.openai.responses.events import Event, ResponseRecord, ResponseRenderer
from gateway.core.ask import GenerationAsk, KeptSession
from gateway.core.errors import NotFound
from gateway.core.service import GatewayService
from gateway.core.walk import Heartbeat
from wire import decode_event

RECORD_FIELD = "response"
_record_decoder = msgspec.json.Decoder(ResponseRecord)


def response_id(session_id: str, generation_id: str) -> str:
    return f"resp_{session_id}.{generation_id}"


def not_found(given: str, field: str = "response_id") -> NotFound:
    return NotFound(
        f"{field} {given!r} names no response: it never existed, it was deleted, or it "
        "outlived TOKENSPOUT_RESPONSES_TTL_S",
        code="response_not_found",
        field=field,
    )


def parse_id(given: str, field: str = "response_id") -> tuple[str, str]:
    """The session and generation a response id names; 404 for anything else."""
    session_id, dot, generation_id = given.removeprefix("resp_").partition(".")
    if not given.startswith("resp_") or not dot or not session_id or not generation_id:
        raise not_found(given, field)
    return session_id, generation_id


class StoredResponse:
    """One response found in Redis: its request, and its events from any position."""

    def __init__(self, service: GatewayService, rid: str, record: ResponseRecord) -> None:
        self.service = service
        self.id = rid
        self.session_id, self.generation_id = parse_id(rid)
        self.record = record

    @classmethod
    async def find(
        cls, service: GatewayService, rid: str, field: str = "response_id"
    ) -> StoredResponse:
        """``field``: where the client gave the id (a 404 names it)."""
        session_id, generation_id = parse_id(rid, field)
        raw = await service.meta_field(session_id, RECORD_FIELD)
        if raw is None or not await service.has_generation(session_id, generation_id):
            raise not_found(rid, field)
        return cls(service, rid, _record_decoder.decode(raw))

    @classmethod
    async def create(
        cls, service: GatewayService, record: ResponseRecord, ask: GenerationAsk
    ) -> StoredResponse:
        """Queue the response's generation in a new session that keeps ``record``."""
        kept = KeptSession(
            service.settings.responses_ttl_s,
            {RECORD_FIELD: msgspec.json.encode(record).decode()},
            background=record.background,
        )
        submitted = await service.generate_kept(ask, kept)
        rid = response_id(submitted.session_id, submitted.generation_id)
        return cls(service, rid, record)

    def renderer(self) -> ResponseRenderer:
        return ResponseRenderer(self.record, self.id, self.generation_id)

    async def snapshot(self) -> ResponseRenderer:
        """Every event stored so far, rendered: ``.response()`` is the object as it stands."""
        renderer = self.renderer()
        after: str | None = None
        while page := await self.service.read_after(self.session_id, after):
            for relayed in page:
                renderer.render(decode_event(relayed.data))
            after = page[-1].id
        return renderer

    async def events(
        self,
        heartbeat_s: float,
        starting_after: int = -1,
        renderer: ResponseRenderer | None = None,
    ) -> AsyncIterator[list[Event] | Heartbeat]:
        """The Responses events numbered after ``starting_after``, live until the last one
        (``response.completed``, ``.incomplete`` or ``.failed``); ``renderer``: one to
        render with (a fresh one), to read the response from when they have ended."""
        renderer = renderer or self.renderer()
        async with self.service.open_feed(self.session_id, None) as feed:
            while not renderer.ended:
                batch = await feed.next_batch(heartbeat_s)
                self.service.raise_if_cut()
                if not batch:
                    yield Heartbeat()
                    continue
                out = [
                    event
                    for relayed in batch
                    for event in renderer.render(decode_event(relayed.data))
                    if event["sequence_number"] > starting_after
                ]
                if out:
                    yield out

    async def cancel(self) -> None:
        """Stop the generation (idempotent); a background one stops being kept."""
        await self.service.cancel(self.session_id, self.generation_id)

    async def wait(self, heartbeat_s: float) -> ResponseRenderer:
        """The response once it has ended."""
        renderer = self.renderer()
        async for _ in self.events(heartbeat_s, renderer=renderer):
            pass
        return renderer

    async def delete(self) -> None:
        """Stop it if it runs, and forget it."""
        with contextlib.suppress(NotFound):  # an ended or vanished generation: nothing to stop
            await self.service.cancel(self.session_id, self.generation_id, reason="user")
        await self.service.forget(self.session_id, self.generation_id)

    async def abandon(self) -> None:
        """The client of a foreground response left before its end: cancel it."""
        with anyio.CancelScope(shield=True):
            try:
                await self.service.cancel(self.session_id, self.generation_id, "disconnected")
            except NotFound:
                return


def now() -> int:
    return int(time.time())
