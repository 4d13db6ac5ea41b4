"""The session API: create a session, post messages, read its event stream over SSE, cancel.

EventSource can only GET and cannot send headers, so the session token is also accepted as
``?token=`` and the resume point as ``?last_event_id=`` (besides the ``Last-Event-ID`` header).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from litestar import Controller, get, post
from litestar.connection import Request
from litestar.params import HeaderParameter, QueryParameter
from litestar.response import Stream

from gateway.apis.sessions.sampling import SamplingIn
from gateway.core.auth import api_key_check
from gateway.core.errors import EventsExpired, EventsLost, SessionLost
from gateway.core.relay import RelayHub
from gateway.core.sessions import SessionStore
from gateway.core.settings import Settings
from gateway.server import sse
from wire import ChatMessage, FinalEvent, final_state

AnyRequest = Request[Any, Any, Any]


class MessageIn(SamplingIn, frozen=True, forbid_unknown_fields=True):
    content: str


class SessionIn(msgspec.Struct, forbid_unknown_fields=True):
    model: str | None = None
    """A model name or alias; left out: the default model. The session keeps it."""


class SessionCreated(msgspec.Struct):
    session_id: str
    token: str
    events_url: str
    model: str | None = None
    """None when no worker was alive to pick the default: the first message picks it."""


class GenerationAccepted(msgspec.Struct):
    generation_id: str
    session_id: str
    events_url: str
    cancel_url: str
    duplicate: bool = False
    generation_ids: list[str] | None = None
    """With ``n`` > 1: every choice's generation, in choice order."""


class SessionView(msgspec.Struct):
    session_id: str
    messages: list[ChatMessage]


class CancelResult(msgspec.Struct):
    generation_id: str
    state: str
    final: FinalEvent | None = None


TokenQuery = Annotated[str | None, QueryParameter(name="token", required=False)]
TokenHeader = Annotated[str | None, HeaderParameter(name="X-Session-Token", required=False)]


def session_token(request: AnyRequest, query: str | None, header: str | None) -> str | None:
    if header:
        return header
    authorization = request.headers.get("authorization", "")
    if authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return query


class SessionController(Controller):
    path = "/v1/sessions"
    tags = ["sessions"]

    @post("/", status_code=201, summary="Create a session", before_request=api_key_check)
    async def create(self, store: SessionStore, data: SessionIn | None = None) -> SessionCreated:
        """With API keys configured, wants ``Authorization: Bearer <key>`` (else 401). The
        body (optional) names the model: 404 ``model_not_found`` for a name no worker
        serves, 503 ``model_unavailable`` when its workers all left."""
        created = await store.create_session(data.model if data is not None else None)
        return SessionCreated(
            created.session_id,
            created.token,
            f"/v1/sessions/{created.session_id}/events",
            created.model,
        )

    @get("/{session_id:str}", summary="The session's messages")
    async def read(
        self,
        request: AnyRequest,
        store: SessionStore,
        session_id: str,
        token: TokenQuery,
        x_session_token: TokenHeader,
    ) -> SessionView:
        await store.authorise(session_id, session_token(request, token, x_session_token))
        return SessionView(session_id, await store.history(session_id))

    @post("/{session_id:str}/messages", status_code=202, summary="Send a message")
    async def send(
        self,
        request: AnyRequest,
        store: SessionStore,
        session_id: str,
        data: MessageIn,
        token: TokenQuery,
        x_session_token: TokenHeader,
        idempotency_key: Annotated[
            str | None, HeaderParameter(name="Idempotency-Key", required=False, max_length=128)
        ],
    ) -> GenerationAccepted:
        params = store.queue.sampling(**data.asked())
        submitted = await store.submit_message(
            session_id,
            session_token(request, token, x_session_token),
            data.content,
            params,
            idempotency_key,
            data.n,
        )
        gid = submitted.generation_id
        return GenerationAccepted(
            generation_id=gid,
            session_id=session_id,
            events_url=f"/v1/sessions/{session_id}/events",
            cancel_url=f"/v1/sessions/{session_id}/generations/{gid}/cancel",
            duplicate=submitted.queued_event_id is None,
            generation_ids=submitted.choices or None,
        )

    @get("/{session_id:str}/events", summary="The session's events (text/event-stream)")
    async def events(
        self,
        request: AnyRequest,
        store: SessionStore,
        hub: RelayHub,
        settings: Settings,
        session_id: str,
        token: TokenQuery,
        x_session_token: TokenHeader,
        last_event_id: Annotated[str | None, QueryParameter(name="last_event_id", required=False)],
        last_event_id_header: Annotated[
            str | None, HeaderParameter(name="Last-Event-ID", required=False)
        ],
    ) -> Stream:
        await store.authorise(session_id, session_token(request, token, x_session_token))
        after = last_event_id_header or last_event_id or None
        lost: EventsLost | None = None
        try:
            await hub.check_resumable(session_id, after)
        except EventsLost as exc:
            lost, after = exc, None  # said in the stream, which starts over
        return sse.response(_session_events(hub, settings, session_id, after, lost))

    @post(
        "/{session_id:str}/generations/{generation_id:str}/cancel",
        status_code=200,
        summary="Stop a generation (idempotent)",
    )
    async def cancel(
        self,
        request: AnyRequest,
        store: SessionStore,
        hub: RelayHub,
        settings: Settings,
        session_id: str,
        generation_id: str,
        token: TokenQuery,
        x_session_token: TokenHeader,
    ) -> CancelResult:
        await store.authorise(session_id, session_token(request, token, x_session_token))
        outcome = await store.cancel(session_id, generation_id)
        final = outcome.final
        if final is None:
            final = await hub.wait_final(session_id, generation_id, settings.cancel_wait_s)
        if final is None:
            return CancelResult(generation_id, outcome.state)
        return CancelResult(generation_id, final_state(final), final)


async def _session_events(
    hub: RelayHub, settings: Settings, session_id: str, after: str | None, lost: EventsLost | None
) -> AsyncIterator[bytes]:
    """The session's stream after ``after``. A resume point ahead of the stream (``lost``,
    or found so after Redis came back without the last events) is never waited on: an
    ``events_lost`` event says so, and the stream starts over from its beginning."""
    yield sse.retry(settings.sse_retry_ms)
    while True:
        if lost is not None:
            yield sse.events_lost(lost.given, lost.message)
            after = None
        try:
            async for chunk in _followed(hub, settings, session_id, after):
                yield chunk
            return
        except EventsLost as exc:
            lost = exc
        except (SessionLost, EventsExpired) as exc:
            # Not a generation's error event: the stream itself ends, with no id.
            yield sse.frame(msgspec.json.encode(exc.body()), event="error")
            return


async def _followed(
    hub: RelayHub, settings: Settings, session_id: str, after: str | None
) -> AsyncIterator[bytes]:
    """Every event after ``after`` as SSE, heartbeats while there is none; while the
    process drains, the stream ends after the last final event."""
    unfinished: set[str] = set()
    async with hub.open(session_id, after) as feed:
        async for batch in feed.events(settings.sse_heartbeat_s):
            if batch:
                yield sse.session_frames(batch)
            elif not hub.draining:
                yield sse.HEARTBEAT
            for event in batch:
                if event.is_final:
                    unfinished.discard(event.generation_id)
                else:
                    unfinished.add(event.generation_id)
            if hub.draining and not unfinished:
                return
