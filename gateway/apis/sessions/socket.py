"""``WS /v1/ws``: generations and cancels over one WebSocket, several at once.

Each ``generate`` queues a message in a session (a new one, or one named with its token)
and opens a relay feed on that session; the feed's events of that generation go to the
client as frames tagged with the client's ``id``. ``resume`` follows a generation again
from an event id (a client whose socket dropped, on any replica). ``cancel`` goes through the same
``GatewayService.cancel`` as the REST route, so it reaches whichever worker runs it.

With API keys configured, a ``generate`` that creates a session needs one: the connect
request's ``Authorization: Bearer <key>`` or the frame's ``api_key`` (all a browser can
send); else an ``invalid_api_key`` error frame. A named session needs its token only.

Sending never buffers without bound: a generation's frames are sent one at a time and the
next batch is taken from its feed only when the last send went through. While a client
does not read, its feeds stop draining; a feed that falls behind drops its buffer and later
re-reads the session stream from Redis, and the tokens it then finds are sent as one
coalesced ``token`` frame. Replies to the client's own frames (acks, pongs, errors) wait in
a small queue; a client that keeps sending while it reads none of them is disconnected.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Coroutine
from typing import Any

from litestar import WebSocket, websocket
from litestar.exceptions import WebSocketDisconnect
from redis.exceptions import RedisError

import wire
from gateway.apis.sessions.protocol import (
    Ack,
    CancelFrame,
    ClientFrame,
    ErrorFrame,
    EventsLostFrame,
    GenerateFrame,
    PingFrame,
    Pong,
    ResumeFrame,
    ServerFrame,
    client_id_of,
    decode_client_frame,
    encode_frame,
    event_frames,
)
from gateway.apis.sessions.routes import TokenQuery
from gateway.core.ask import GenerationAsk
from gateway.core.auth import ApiKeys, bearer
from gateway.core.errors import (
    AGAIN_AFTER_S,
    BadRequest,
    EventsLost,
    GatewayError,
    NotFound,
    Overloaded,
    ProtocolViolation,
)
from gateway.core.service import GatewayService
from gateway.tenants.caller import caller_of
from gateway.transport.websocket import received

log = logging.getLogger("tokenspout.ws")

MAX_BAD_FRAMES = 10
"""Malformed frames one socket may send; the next one closes it with 4400."""
MAX_GENERATIONS = 32
"""Generations one socket may have running at once."""
MAX_PENDING_REPLIES = 64
"""Acks, pongs and errors waiting for an unread socket; past it, the socket closes (4400)."""
REMEMBERED = 1024
"""Finished generations (and session tokens) a socket remembers for ``cancel`` by id."""
CLOSE_TIMEOUT_S = 5.0

AnyWebSocket = WebSocket[Any, Any, Any]


class Connection:
    """One client socket: reads frames, runs forwarders, writes frames one at a time."""

    def __init__(
        self,
        socket: AnyWebSocket,
        service: GatewayService,
        token: str | None,
        api_keys: ApiKeys,
    ) -> None:
        self.socket = socket
        self.service = service
        self.settings = service.settings
        self.token = token
        self.api_keys = api_keys
        # A socket shows a valid key once (connect header or a frame) for all its sessions,
        # which serve that key (a later frame's key serves from then on).
        self.caller = caller_of(socket.scope)
        """Whom its sessions serve, and where their turns' admissions leave the quota."""
        self._key_shown = api_keys.serve(self.caller, bearer(socket.headers.get("authorization")))
        self._send_lock = asyncio.Lock()
        self._replies: asyncio.Queue[ServerFrame] = asyncio.Queue(MAX_PENDING_REPLIES)
        self._running: dict[str, asyncio.Task[None]] = {}
        self._known: OrderedDict[str, tuple[str, list[str]]] = OrderedDict()
        self._tokens: OrderedDict[str, str] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._bad_frames = 0

    async def serve(self) -> None:
        await self.socket.accept()
        self._spawn(self._write_replies())
        try:
            async for data in received(self.socket):
                await self._handle(data)
        except WebSocketDisconnect:  # a send found it gone
            return
        except ProtocolViolation as exc:
            log.info("closing a WebSocket: %s", exc.message)
            await self._close(exc)
        except Exception:
            # A bug, not the client's fault: say so in the log, close with 4500.
            log.exception("WebSocket connection failed")
            await self._close(GatewayError("internal error"))
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- reading ---------------------------------------------------------------------------

    async def _handle(self, data: str | bytes) -> None:
        try:
            frame: ClientFrame = decode_client_frame(data, self.settings.max_body_bytes)
        except GatewayError as exc:
            self._bad_frames += 1
            client_id = client_id_of(data) if len(data) <= self.settings.max_body_bytes else None
            self._reply(ErrorFrame(exc.code, exc.message, id=client_id, field=exc.field))
            if self._bad_frames >= MAX_BAD_FRAMES:
                raise ProtocolViolation(
                    f"{self._bad_frames} malformed frames", code="too_many_bad_frames"
                ) from None
            return
        try:
            match frame:
                case PingFrame(id=ping_id):
                    self._reply(Pong(ping_id))
                case GenerateFrame():
                    await self._generate(frame)
                case CancelFrame():
                    await self._cancel(frame)
                case ResumeFrame():
                    await self._resume(frame)
        except GatewayError as exc:
            self._reply(
                ErrorFrame(
                    exc.code,
                    exc.message,
                    id=frame.id,
                    field=exc.field,
                    retry_after_s=exc.retry_after_s,
                )
            )
        except RedisError as exc:
            log.warning("redis error on a WebSocket frame: %s", exc)
            self._reply(
                ErrorFrame(
                    "unavailable",
                    "Redis is unavailable; try again",
                    id=frame.id,
                    retry_after_s=AGAIN_AFTER_S,
                )
            )

    def _check_room(self, client_id: str) -> None:
        """A new ``id`` to follow: refused while that ``id`` runs, or past the socket's limit."""
        if client_id in self._running:
            raise BadRequest(f"generation {client_id!r} is still running", code="duplicate_id")
        if len(self._running) >= MAX_GENERATIONS:
            raise Overloaded(
                f"at most {MAX_GENERATIONS} generations per socket at once",
                retry_after_s=AGAIN_AFTER_S,
            )

    async def _generate(self, frame: GenerateFrame) -> None:
        self._check_room(frame.id)
        sampling = self.service.sampling(**frame.asked())
        ask = GenerationAsk.message_to_session(
            self.caller, frame.content, sampling, frame.n, given=frame.given()
        )
        new_token: str | None = None
        token: str | None
        if frame.session_id is None:
            if not self._key_shown or frame.api_key is not None:
                self.api_keys.require(self.caller, frame.api_key)
                self._key_shown = True
            created = await self.service.create_session(self.caller, frame.model)
            session_id, token = created.session_id, created.token
            new_token = token
            _remember(self._tokens, session_id, created.token)
        else:
            session_id = frame.session_id
            token = frame.token or self._tokens.get(session_id) or self.token
        submitted = await self.service.send_message(session_id, token, ask, None)
        gid = submitted.generation_id
        gids = submitted.choices or [gid]
        _remember(self._known, frame.id, (session_id, gids))
        ack = Ack(
            frame.id, "generate", gid, session_id, "queued", new_token, submitted.choices or None
        )
        self._reply(ack)
        queued = submitted.queued_event_id  # None: SUBMIT sent again, its reply lost
        after = wire.just_before(queued) if queued is not None else None
        self._running[frame.id] = self._spawn(self._forward(frame.id, session_id, gids, after))

    async def _resume(self, frame: ResumeFrame) -> None:
        """Follow a generation again from ``last_event_id``; one ahead of the stream gets
        ``events_lost`` and its frames from the first, as the SSE stream starts over."""
        self._check_room(frame.id)
        session_id, gid = frame.session_id, frame.generation_id
        token = frame.token or self._tokens.get(session_id) or self.token
        await self.service.authorise(session_id, token)
        state, final_id = await self.service.generation_end(session_id, gid)
        after, lost = frame.last_event_id, None
        try:
            await self.service.check_resumable(session_id, after)
        except EventsLost as exc:
            after, lost = None, exc
        _remember(self._known, frame.id, (session_id, [gid]))
        self._reply(Ack(frame.id, "resume", gid, session_id, state))
        if after and final_id and wire.entry_id_key(after) >= wire.entry_id_key(final_id):
            return  # it has ended, and the client has its final frame
        self._running[frame.id] = self._spawn(
            self._forward(frame.id, session_id, [gid], after, lost)
        )

    async def _cancel(self, frame: CancelFrame) -> None:
        if frame.session_id is None and frame.generation_id is None:
            known = self._known.get(frame.id)
            if known is None:
                raise NotFound(f"this socket started no generation {frame.id!r}", field="id")
            session_id, gids = known
            outcomes = [await self.service.cancel(session_id, gid) for gid in gids]
            # The forwarder delivers the final events (``cancelled``, or how each ended).
            self._reply(Ack(frame.id, "cancel", gids[0], session_id, outcomes[0].state))
            return
        if frame.session_id is None or frame.generation_id is None:
            field = "session_id" if frame.session_id is None else "generation_id"
            raise BadRequest("give both session_id and generation_id, or neither", field=field)
        session_id, gid = frame.session_id, frame.generation_id
        token = frame.token or self._tokens.get(session_id) or self.token
        await self.service.authorise(session_id, token)
        outcome = await self.service.cancel(session_id, gid)
        if outcome.final is not None:
            self._reply(Ack(frame.id, "cancel", gid, session_id, outcome.state))
        elif len(self._tasks) > 2 * MAX_GENERATIONS:
            raise Overloaded("too many cancels waiting on this socket; wait for their acks")
        else:
            self._spawn(self._ack_when_final(frame.id, session_id, gid))

    async def _ack_when_final(self, client_id: str, session_id: str, gid: str) -> None:
        final = await self.service.wait_final(session_id, gid)
        state = "cancelling" if final is None else wire.final_state(final)
        await self._replies.put(Ack(client_id, "cancel", gid, session_id, state))

    # --- writing ---------------------------------------------------------------------------

    async def _forward(
        self,
        client_id: str,
        session_id: str,
        gids: list[str],
        after: str | None,
        lost: EventsLost | None = None,
    ) -> None:
        """Frames of a ``generate``'s generations (its ``n`` choices) until each has ended.
        A position ahead of the stream (``lost``, or found so after Redis came back without
        its last events) is said with ``events_lost``, then they start over."""
        try:
            while True:
                if lost is not None:
                    await self._send(EventsLostFrame(client_id, lost.given, lost.message))
                    after = None
                try:
                    await self._follow(client_id, session_id, gids, after)
                    return
                except EventsLost as exc:
                    lost = exc
        except GatewayError as exc:  # SessionLost: Redis lost the session's data
            await self._replies.put(ErrorFrame(exc.code, exc.message, client_id))
        except RedisError as exc:
            log.warning("relay failed for %s: %s", ", ".join(gids), exc)
            error = ErrorFrame("unavailable", "lost the event stream; resume over SSE", client_id)
            await self._replies.put(error)
        finally:
            self._running.pop(client_id, None)

    async def _follow(
        self, client_id: str, session_id: str, gids: list[str], after: str | None
    ) -> None:
        choice_of = {gid: choice for choice, gid in enumerate(gids)} if len(gids) > 1 else None
        running = set(gids)
        async with self.service.open_feed(session_id, after) as feed:
            while running:
                batch = await feed.next_batch(self.settings.sse_heartbeat_s)
                mine = [event for event in batch if event.generation_id in running]
                decoded = [(event.id, wire.decode_event(event.data)) for event in mine]
                for frame in event_frames(client_id, decoded, choice_of):
                    await self._send(frame)
                running -= {event.generation_id for event in mine if event.is_final}

    def _reply(self, frame: ServerFrame) -> None:
        """Queue a reply from the reading loop (tasks ``await self._replies.put``)."""
        try:
            self._replies.put_nowait(frame)
        except asyncio.QueueFull:
            raise ProtocolViolation(
                f"{MAX_PENDING_REPLIES} replies are waiting unread", code="replies_not_read"
            ) from None

    async def _write_replies(self) -> None:
        while True:
            await self._send(await self._replies.get())

    async def _send(self, frame: ServerFrame) -> None:
        async with self._send_lock:
            await self.socket.send_data(encode_frame(frame))

    async def _close(self, error: GatewayError) -> None:
        """Send what replies wait (the error that explains the close), then the close."""
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                while not self._replies.empty():
                    await self._send(self._replies.get_nowait())
                await self.socket.close(error.ws_close_code, error.code)
        except TimeoutError:
            log.info("a WebSocket that reads nothing was dropped without a close frame")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            error = task.exception()
            if not isinstance(error, WebSocketDisconnect | OSError):
                log.error("WebSocket task failed", exc_info=error)


def _remember(store: OrderedDict[str, Any], key: str, value: Any) -> None:
    store[key] = value
    store.move_to_end(key)
    while len(store) > REMEMBERED:
        store.popitem(last=False)


@websocket("/v1/ws", name="ws")
async def ws_endpoint(
    socket: AnyWebSocket, service: GatewayService, token: TokenQuery, api_keys: ApiKeys
) -> None:
    """Typed JSON frames both ways; see docs/api.md, "WebSocket"."""
    await Connection(socket, service, token, api_keys).serve()
