"""The session API: create a session, post messages, read its event stream over SSE, cancel.

EventSource can only GET and cannot send headers, so the session token is also accepted as
``?token=`` and the resume point as ``?last_event_id=`` (besides the ``Last-Event-ID`` header).
A browser's owner cookie (gateway/apis/sessions/owner.py) authorises its own sessions as
their tokens do, and lists, renames, sets and deletes them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from litestar import Controller, Response, delete, get, patch, post
from litestar.connection import Request
from litestar.di import Provide
from litestar.params import HeaderParameter, QueryParameter
from litestar.response import Stream

from gateway.apis.sessions.owner import (
    ConversationChange,
    ConversationList,
    MaxTokens,
    Temperature,
    creation_settings,
    new_owner_cookie,
    owner_of,
)
from gateway.apis.sessions.sampling import SamplingIn
from gateway.core.ask import GenerationAsk
from gateway.core.auth import api_key_check
from gateway.core.conversations import (
    Conversation,
    ReplyRecord,
    RunningReply,
    Version,
    check_title,
)
from gateway.core.errors import EventsExpired, EventsLost, SessionLost
from gateway.core.service import GatewayService
from gateway.tenants.caller import Caller, caller_of
from gateway.transport import sse
from wire import ChatMessage, FinalEvent, entry_id_key, final_state

AnyRequest = Request[Any, Any, Any]


class MessageIn(SamplingIn, frozen=True, forbid_unknown_fields=True):
    content: str
    edit: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """The index (in ``GET``'s ``messages``) of the user message this one replaces: the
    history is cut back to before it, then this message and its reply follow."""


class TurnIn(SamplingIn, frozen=True, forbid_unknown_fields=True):
    """A regenerate or continue: no content, the sampling fields as for a message."""


class SessionIn(msgspec.Struct, forbid_unknown_fields=True):
    model: str | None = None
    """A model name or alias; left out: the default model. The session keeps it."""
    title: str | None = None
    system: str | None = None
    """The conversation's system prompt (the engine gets it first, every turn)."""
    temperature: Temperature | None = None
    """The conversation's temperature, for the turns that set none."""
    max_tokens: MaxTokens | None = None


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
    title: str = ""
    model: str | None = None
    system: str = ""
    temperature: float | None = None
    max_tokens: int | None = None
    updated: float = 0.0
    replies: list[ReplyRecord] = []
    """How each reply ended (its message's index ``at``): what a page shows under it."""
    versions: list[Version] = []
    """What regenerates and edits replaced, oldest first: earlier versions of the message
    at ``at`` and what followed it."""
    running: RunningReply | None = None
    """The reply running now (not in ``messages`` yet; a continue's is the last message,
    still short): read the event stream after ``running.after`` to see all of it."""
    last_event_id: str | None = None
    """The stream's last event when this was read: a reader after it misses nothing."""


class CancelResult(msgspec.Struct):
    generation_id: str
    state: str
    final: FinalEvent | None = None


TokenQuery = Annotated[str | None, QueryParameter(name="token", required=False)]
TokenHeader = Annotated[str | None, HeaderParameter(name="X-Session-Token", required=False)]
IdempotencyKey = Annotated[
    str | None, HeaderParameter(name="Idempotency-Key", required=False, max_length=128)
]


def session_token(request: AnyRequest, query: str | None, header: str | None) -> str | None:
    if header:
        return header
    authorization = request.headers.get("authorization", "")
    if authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return query


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a request about a session shows: its token, the owner cookie's secret, and
    its caller (where a turn's admission leaves the key's quota)."""

    token: str | None
    owner: str | None
    caller: Caller


async def credentials_of(
    request: AnyRequest, token: TokenQuery, x_session_token: TokenHeader
) -> Credentials:
    token_given = session_token(request, token, x_session_token)
    return Credentials(token_given, owner_of(request), caller_of(request.scope))


class SessionController(Controller):
    path = "/v1/sessions"
    tags = ["sessions"]
    dependencies = {"credentials": Provide(credentials_of)}

    @post("/", status_code=201, summary="Create a session", before_request=api_key_check)
    async def create(
        self,
        request: AnyRequest,
        service: GatewayService,
        data: SessionIn | None = None,
    ) -> Response[SessionCreated]:
        """With API keys configured, wants ``Authorization: Bearer <key>`` (else 401). The
        body (optional) names the model: 404 ``model_not_found`` for a name no worker
        serves, 503 ``model_unavailable`` when its workers all left; and the
        conversation's title and settings. A request without an owner cookie gets one."""
        given = data or SessionIn()
        owner, cookies = owner_of(request), []
        if owner is None:
            owner, cookie = new_owner_cookie(request)
            cookies.append(cookie)
        settings = service.settings
        created = await service.create_session(
            caller_of(request.scope),
            given.model,
            owner,
            creation_settings(given.system, given.temperature, given.max_tokens, settings),
            check_title(given.title) if given.title is not None else None,
        )
        body = SessionCreated(
            created.session_id,
            created.token,
            f"/v1/sessions/{created.session_id}/events",
            created.model,
        )
        return Response(body, status_code=201, cookies=cookies)

    @get("/", summary="The owner's conversations")
    async def list_owned(self, request: AnyRequest, service: GatewayService) -> ConversationList:
        """The sessions created with this request's owner cookie, the latest updated first
        (none without the cookie)."""
        owner = owner_of(request)
        if owner is None:
            return ConversationList([])
        return ConversationList(await service.conversations(owner))

    @patch("/{session_id:str}", summary="Rename a conversation or change its settings")
    async def change(
        self,
        service: GatewayService,
        session_id: str,
        data: ConversationChange,
        credentials: Credentials,
    ) -> Conversation:
        fields = data.fields(service.settings)
        return await service.change(session_id, credentials.token, credentials.owner, fields)

    @delete("/{session_id:str}", status_code=204, summary="Delete a conversation")
    async def remove(
        self,
        service: GatewayService,
        session_id: str,
        credentials: Credentials,
    ) -> None:
        """Its running reply is stopped; its messages and events are gone (404 after)."""
        await service.delete(session_id, credentials.token, credentials.owner)

    @get("/{session_id:str}", summary="The session's messages")
    async def read(
        self,
        service: GatewayService,
        session_id: str,
        credentials: Credentials,
    ) -> SessionView:
        await service.authorise(session_id, credentials.token, credentials.owner)
        about = await service.conversation(session_id)
        record = await service.conversation_record(session_id)
        return SessionView(
            session_id,
            record.messages,
            about.title,
            about.model,
            about.system,
            about.temperature,
            about.max_tokens,
            about.updated,
            record.replies,
            record.versions,
            record.running,
            record.last_event_id,
        )

    @post("/{session_id:str}/messages", status_code=202, summary="Send a message")
    async def send(
        self,
        service: GatewayService,
        session_id: str,
        data: MessageIn,
        credentials: Credentials,
        idempotency_key: IdempotencyKey,
    ) -> GenerationAccepted:
        turn = f"edit {data.edit}" if data.edit is not None else ""
        return await _submit(
            service, session_id, data, data.content, turn, idempotency_key, credentials
        )

    @post(
        ["/{session_id:str}/regenerate", "/{session_id:str}/continue"],
        status_code=202,
        summary="Regenerate or continue the last reply",
    )
    async def rework(
        self,
        request: AnyRequest,
        service: GatewayService,
        session_id: str,
        credentials: Credentials,
        idempotency_key: IdempotencyKey,
        data: TurnIn | None = None,
    ) -> GenerationAccepted:
        """``regenerate``: the reply to the last user message is cut from the history and
        made again (409 ``nothing_to_regenerate`` without a user message). ``continue``:
        the engine goes on with the last assistant message (one that hit its token limit,
        say); its tokens extend that message in the history (409 ``nothing_to_continue``
        when the history does not end with one)."""
        turn = request.url.path.rsplit("/", 1)[-1]  # one of the two paths above
        given = data or TurnIn()
        return await _submit(service, session_id, given, "", turn, idempotency_key, credentials)

    @get("/{session_id:str}/events", summary="The session's events (text/event-stream)")
    async def events(
        self,
        service: GatewayService,
        session_id: str,
        credentials: Credentials,
        last_event_id: Annotated[str | None, QueryParameter(name="last_event_id", required=False)],
        last_event_id_header: Annotated[
            str | None, HeaderParameter(name="Last-Event-ID", required=False)
        ],
        until: Annotated[str | None, QueryParameter(name="until", required=False)] = None,
    ) -> Stream:
        """Every event of the session after the resume point, for as long as the client
        reads; with ``until=<generation_id>`` the stream ends after that generation's final
        event (at once when the resume point is past it), so ``curl -N`` returns after one
        reply. 404 ``unknown_generation`` for a generation the session does not have."""
        await service.authorise(session_id, credentials.token, credentials.owner)
        after = last_event_id_header or last_event_id or None
        lost: EventsLost | None = None
        try:
            await service.check_resumable(session_id, after)
        except EventsLost as exc:
            lost, after = exc, None  # said in the stream, which starts over
        ended = until is not None and await _ended_before(service, session_id, until, after)
        return sse.response(_session_events(service, session_id, after, lost, until, ended))

    @post(
        "/{session_id:str}/generations/{generation_id:str}/cancel",
        status_code=200,
        summary="Stop a generation (idempotent)",
    )
    async def cancel(
        self,
        service: GatewayService,
        session_id: str,
        generation_id: str,
        credentials: Credentials,
    ) -> CancelResult:
        await service.authorise(session_id, credentials.token, credentials.owner)
        outcome = await service.cancel(session_id, generation_id)
        final = outcome.final
        if final is None:
            final = await service.wait_final(session_id, generation_id)
        if final is None:
            return CancelResult(generation_id, outcome.state)
        return CancelResult(generation_id, final_state(final), final)


async def _submit(
    service: GatewayService,
    session_id: str,
    data: SamplingIn,
    content: str,
    turn: str,
    idempotency_key: str | None,
    credentials: Credentials,
) -> GenerationAccepted:
    """A turn of the session (a message, an edit, a regenerate or a continue), queued."""
    sampling = service.sampling(**data.asked())
    ask = GenerationAsk.message_to_session(
        credentials.caller, content, sampling, data.n, turn=turn, given=data.given()
    )
    submitted = await service.send_message(
        session_id, credentials.token, ask, idempotency_key, owner=credentials.owner
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


async def _ended_before(
    service: GatewayService, session_id: str, generation_id: str, after: str | None
) -> bool:
    """Whether ``generation_id`` ended at or before the resume point ``after`` (404 for a
    generation the session does not have)."""
    _, final_id = await service.generation_end(session_id, generation_id)
    if final_id is None or after is None:
        return False
    return entry_id_key(final_id) <= entry_id_key(after)


async def _session_events(
    service: GatewayService,
    session_id: str,
    after: str | None,
    lost: EventsLost | None,
    until: str | None = None,
    ended: bool = False,
) -> AsyncIterator[bytes]:
    """The session's stream after ``after``, up to ``until``'s final event (``ended``: it
    is behind the resume point, the stream is over). A resume point ahead of the stream
    (``lost``, or found so after Redis came back without the last events) is never waited
    on: an ``events_lost`` event says so, and the stream starts over from its beginning."""
    yield sse.retry(service.settings.sse_retry_ms)
    while not ended:
        if lost is not None:
            yield sse.events_lost(lost.given, lost.message)
            after = None
        try:
            async for chunk in _followed(service, session_id, after, until):
                yield chunk
            return
        except EventsLost as exc:
            lost = exc
        except (SessionLost, EventsExpired) as exc:
            # Not a generation's error event: the stream itself ends, with no id.
            yield sse.frame(msgspec.json.encode(exc.body()), event="error")
            return


async def _followed(
    service: GatewayService, session_id: str, after: str | None, until: str | None = None
) -> AsyncIterator[bytes]:
    """Every event after ``after`` as SSE, heartbeats while there is none, up to the final
    event of ``until`` (None: no end); while the process drains, the stream ends after the
    last final event."""
    unfinished: set[str] = set()
    async with service.open_feed(session_id, after) as feed:
        async for batch in feed.events(service.settings.sse_heartbeat_s):
            if until is not None:
                ends = (
                    n for n, e in enumerate(batch, 1) if e.is_final and e.generation_id == until
                )
                if end := next(ends, 0):
                    yield sse.session_frames(batch[:end])
                    return
            if batch:
                yield sse.session_frames(batch)
            elif not service.draining:
                yield sse.HEARTBEAT
            for event in batch:
                if event.is_final:
                    unfinished.discard(event.generation_id)
                else:
                    unfinished.add(event.generation_id)
            if service.draining and not unfinished:
                return
