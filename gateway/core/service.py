"""The one way in: every API asks the gateway for generations, sessions and models here.

``GatewayService`` holds what a request needs, the sessions store (Redis), the relay hub
(the events) and the settings, so a handler takes this one dependency and asks it; no API
reaches into the store's queue or model directory. What a client asks of a generation is
one value, ``GenerationAsk`` (gateway/core/ask.py), whatever API it came through:

    ask = GenerationAsk(sampling=service.sampling(max_tokens=16), prompt="Hi", n=2)
    choices = await service.generate(ask)        # admitted, then ``n`` generations queued
    async for write in walk(choices.batches(), spelling, ask.n):   # gateway/core/walk.py
        ...

Every ask is judged first, in one place (gateway/core/store/admission.py): its ``n``, whether the
key it serves (``ask.caller``) may use the model, the key's limits and the capacity. With
tracing on, what the store does for it (the key's limits, the fair queue, the SUBMIT script)
is the ``tokenspout.admission`` span of the API call's trace (gateway/core/tracing.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping

import redis.asyncio as aioredis

from gateway.core import tracing
from gateway.core.ask import GenerationAsk, KeptSession
from gateway.core.auth import tenant_directory
from gateway.core.choices import Choices
from gateway.core.conversations import Conversation, ConversationRecord, ConversationSettings
from gateway.core.readiness import Readiness, check_readiness
from gateway.core.relay.feed import Feed, RelayEvent
from gateway.core.relay.hub import RelayHub
from gateway.core.settings import Settings
from gateway.core.store.admission import Admission
from gateway.core.store.models import ModelDirectory
from gateway.core.store.queue import GenerationQueue, QueueCounts
from gateway.core.store.sessions import CreatedSession, Sessions
from gateway.core.store.submitter import CancelOutcome, SubmitObserver, Submitted, Submitter
from gateway.core.store.watches import WatchMarks
from gateway.tenants.caller import Caller
from gateway.tenants.directory import TenantDirectory
from wire import CancelReason, FinalEvent, Keys, SamplingParams, WorkerInfo
from wire.generations import Generations


class GatewayService:
    def __init__(
        self,
        redis: aioredis.Redis,
        hub: RelayHub,
        settings: Settings,
        observer: SubmitObserver | None = None,
    ) -> None:
        """The core's parts, made once per process; ``tenant_directory`` reads the static
        keys here (``ConfigError`` for a key file it cannot read)."""
        self.redis = redis
        self.hub = hub
        self.settings = settings
        keys = Keys(settings.key_prefix)
        self.models = ModelDirectory(redis, keys, settings)
        """Which models and workers are live (gateway/core/store/models.py)."""
        self.directory: TenantDirectory = tenant_directory(redis, settings)
        """The keys in force, and the keys store the admin API changes (gateway/tenants/)."""
        self.generations = Generations(
            redis, keys, events_maxlen=settings.events_maxlen, ttl_s=settings.session_ttl_s
        )
        """Every transition of a generation the gateway makes (wire/generations.py)."""
        self.queue = GenerationQueue(redis, keys, settings, self.models, self.directory.weight_of)
        one_node = self.generations.topology.one_node
        self.admission = Admission(
            redis, keys, settings, self.directory, self.queue, one_node=one_node, observer=observer
        )
        self.sessions = Sessions(redis, keys, settings, self.models, self.admission)
        self.watch_marks = WatchMarks(
            self.sessions, hub.watched_sessions, settings.abandon_grace_s / 3
        )
        """Which sessions this process reads, for the workers (gateway/core/store/watches.py)."""
        self.submitter = Submitter(
            self.sessions,
            self.admission,
            self.generations,
            self.queue,
            self.models,
            settings,
            observer,
        )

    # --- what a generation may ask -------------------------------------------------------

    def sampling(
        self,
        *,
        named: Mapping[str, str] | None = None,
        neutral: Mapping[str, object] | None = None,
        **given: object,
    ) -> SamplingParams:
        """Sampling parameters with the gateway's defaults and limits (422 past one);
        ``given``: the fields the request sets, None for the default (the model's
        recommended value where it has one, else ``neutral``'s or the gateway's);
        ``named``: the client's own names of those its API spells otherwise, for errors to
        name them."""
        return self.queue.sampling(named=named, neutral=neutral, **given)

    # --- stateless generations (the OpenAI, TGI and OIP APIs) -----------------------------

    async def generate(self, ask: GenerationAsk) -> Choices:
        """Queue the ask's ``n`` generations, each in a throwaway session whose feed opens
        before it is queued; the caller walks them, then closes them (``Choices.close``)."""
        self.admission.check(ask)
        with _admission(ask):
            model = await self.models.resolve(ask.model)
            heartbeat_s = self.settings.sse_heartbeat_s
            return await Choices.open(self.submitter, self.hub, ask, model, heartbeat_s)

    async def generate_kept(self, ask: GenerationAsk, kept: KeptSession) -> Submitted:
        """Queue one generation in a session that outlives its request (a stored
        ``/v1/responses`` response), read later by its id: no feed is opened for it."""
        self.admission.check(ask)
        with _admission(ask):
            model = await self.models.resolve(ask.model)
            return await self.submitter.submit_stateless(ask, model, kept=kept)

    # --- sessions --------------------------------------------------------------------------

    async def create_session(
        self,
        caller: Caller,
        model: str | None,
        owner: str | None = None,
        settings: ConversationSettings | None = None,
        title: str | None = None,
    ) -> CreatedSession:
        """A session for ``model`` (None: the default) serving ``caller``'s key; ``owner``:
        the owner cookie's secret, whose conversations it joins, with its ``settings`` and
        ``title``."""
        return await self.sessions.create_session(caller, model, owner, settings, title)

    async def authorise(self, session_id: str, token: str | None, owner: str | None = None) -> None:
        """404 for an unknown session, 403 unless the session's token or, with no token
        given, its owner's cookie secret (``owner``) is given."""
        await self.sessions.authorise(session_id, token, owner)

    async def send_message(
        self,
        session_id: str,
        token: str | None,
        ask: GenerationAsk,
        idempotency_key: str | None,
        *,
        owner: str | None = None,
    ) -> Submitted:
        """The ask's turn of the session (its one message, an edit, a regenerate or a
        continue: ``ask.turn``), its reply (``n`` replies) queued, the conversation's
        settings filling the sampling fields the request left (``ask.given``); authorised
        by ``token`` or the ``owner``'s cookie (404, then 403)."""
        self.admission.check(ask)
        with _admission(ask, session_id):
            return await self.submitter.submit_message(
                session_id, token, ask, idempotency_key, owner=owner
            )

    # --- conversations (the owner cookie's sessions: gateway/core/conversations.py) --------

    async def conversations(self, owner: str) -> list[Conversation]:
        """The owner's conversations (``owner``: its cookie's secret), latest updated first."""
        return await self.sessions.conversations.of_owner(self.sessions.owner_digest(owner))

    async def conversation(self, session_id: str) -> Conversation:
        """A session's title and settings, as a list shows them (authorise first)."""
        return await self.sessions.conversations.read(session_id)

    async def conversation_record(self, session_id: str) -> ConversationRecord:
        """A session's messages, how each reply ended, earlier versions and the reply
        running with where its events begin (authorise first)."""
        return await self.sessions.conversations.record_of(session_id)

    async def change(
        self, session_id: str, token: str | None, owner: str | None, fields: dict[str, str | None]
    ) -> Conversation:
        """Rename a conversation or change its settings (``fields``: meta field -> value,
        None to clear it); authorised by its token or its owner's cookie."""
        return await self.sessions.change(session_id, token, owner, fields)

    async def delete(self, session_id: str, token: str | None, owner: str | None) -> None:
        """Delete a session, its running reply stopped first (its worker's events are
        refused from then on: its generation's hash goes too)."""
        owner_digest = await self.sessions.authorise(session_id, token, owner)
        running = await self.sessions.running(session_id)
        for generation_id in running:
            await self.submitter.cancel(session_id, generation_id)
        await self.sessions.conversations.forget(session_id, owner_digest, running)

    async def cancel(
        self, session_id: str, generation_id: str, reason: CancelReason = "user"
    ) -> CancelOutcome:
        """Stop a generation wherever it runs; idempotent (a final one reports its end)."""
        return await self.submitter.cancel(session_id, generation_id, reason)

    async def generation_end(self, session_id: str, generation_id: str) -> tuple[str, str | None]:
        """The generation's state, and the id of its final event (None while it runs)."""
        return await self.sessions.generation_end(session_id, generation_id)

    async def wait_final(self, session_id: str, generation_id: str) -> FinalEvent | None:
        """The generation's final event, waiting up to ``TOKENSPOUT_CANCEL_WAIT_S``."""
        wait_s = self.settings.cancel_wait_s
        return await self.hub.wait_final(session_id, generation_id, wait_s)

    # --- a session's events ----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def open_feed(self, session_id: str, after_id: str | None = None) -> AsyncIterator[Feed]:
        """The session's events after ``after_id`` (gateway/core/relay/hub.py ``RelayHub.open``).
        A reader that resumes (``after_id``) in a process not reading the session marks it
        watched at once: one that came back through another gateway counts from now, not
        from this process's next refresh (up to a third of the abandon grace later), so its
        generation is not abandoned under it. A new reader needs no mark of its own yet:
        its generation's submit marked the session."""
        if after_id is not None and not self.hub.watches(session_id):
            await self.watch_marks.reader_came(session_id)
        async with self.hub.open(session_id, after_id) as feed:
            yield feed

    async def check_resumable(self, session_id: str, after_id: str | None) -> None:
        """``EventsExpired`` when the events after ``after_id`` are no longer kept."""
        await self.hub.check_resumable(session_id, after_id)

    async def read_after(self, session_id: str, after_id: str | None) -> list[RelayEvent]:
        """The next page of the session's stored events after ``after_id``."""
        return await self.hub.read_after(session_id, after_id)

    @property
    def draining(self) -> bool:
        """The process is shutting down: streams end as their generations do."""
        return self.hub.draining

    def raise_if_cut(self) -> None:
        """``ShuttingDown`` for a request still waiting past the drain's cut."""
        self.hub.raise_if_cut()

    # --- one-generation sessions kept past their request (stored responses) ------------------

    async def meta_field(self, session_id: str, field: str) -> str | None:
        return await self.sessions.meta_field(session_id, field)

    async def has_generation(self, session_id: str, generation_id: str) -> bool:
        return await self.sessions.has_generation(session_id, generation_id)

    async def forget(self, session_id: str, generation_id: str) -> None:
        """Delete a one-generation session's keys."""
        await self.sessions.forget(session_id, generation_id)

    # --- models and readiness --------------------------------------------------------------

    async def resolve_model(self, name: str | None) -> str:
        """The model that serves ``name`` (None: the default); 404 or 503 as
        gateway/core/store/models.py says."""
        return await self.models.resolve(name)

    async def live_workers(self) -> list[WorkerInfo]:
        """Every live worker, read now."""
        return await self.models.live_workers()

    async def workers_of(self, model: str) -> list[WorkerInfo]:
        """The live workers of ``model`` (none when its last one left)."""
        return (await self.models.snapshot()).live.get(model, [])

    async def max_model_len(self, model: str) -> int | None:
        return await self.models.max_model_len(model)

    async def readiness(self) -> Readiness:
        """Redis answers and an engine worker is alive (``/ready``, gRPC ``ServerReady``)."""
        return await check_readiness(self.redis, self.models)

    @property
    def tenant_directory(self) -> TenantDirectory:
        """The keys in force, and the keys store the admin API changes (gateway/tenants/)."""
        return self.directory

    async def queue_counts(self) -> QueueCounts:
        """Model -> (queued, running), in one round trip (``/metrics``)."""
        return await self.queue.counts()

    async def workers_by_model(self) -> dict[str, int]:
        """Every model a worker ever registered -> its live workers now (``/metrics``)."""
        snapshot = await self.models.snapshot()
        live = snapshot.live
        return {model: len(live.get(model, [])) for model in snapshot.models}


def _admission(
    ask: GenerationAsk, session_id: str = ""
) -> contextlib.AbstractContextManager[object]:
    """The span of the ask's admission, when the API call's trace is recorded."""
    if not tracing.recording():
        return tracing.NO_SPAN
    asked: dict[str, str | int] = {"gen_ai.request.model": ask.model or "", "tokenspout.n": ask.n}
    if session_id:
        asked["tokenspout.session_id"] = session_id
    return tracing.span("tokenspout.admission", asked)
