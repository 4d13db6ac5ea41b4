"""The Lua scripts that keep a session's event stream consistent (and the one that holds the
reaper's lock), one typed wrapper each.

Each script's source is a file in wire/lua/ (its header comment says what it does and
returns); the wrapper below is the only place its KEYS and ARGV are listed, so a caller
names what it passes (``Emit(...)(session_id=..., event=..., writer=...)``) and a new
argument is one edit here and one in the .lua file.

A live message on ``Keys.live_channel`` is "<entry id> <type> <generation id> <json>", the
same event the stream holds, so a live reader needs no second round trip; an engine step's
events of one session go in one message, one a line (JSON holds no raw newline).

Called with ``pipe=`` a wrapper queues the script in that pipeline and returns nothing;
``reply`` turns the pipeline's result for it into what the call would have returned.

A script that answers one of several outcomes is decoded here, once, into the typed values
of wire/outcomes.py (``match`` on them); nothing else reads a script's reply list.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple, cast

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError

from wire.batched import Arg, BatchedCalls
from wire.keys import ANONYMOUS, CONSUMER_GROUP, SHARED_KEY_TTL_S, Keys
from wire.library import lost_scripts, lua_source
from wire.limits import RUNNING_HOLD_S, Counts, LimitName, Limits, usage_counts
from wire.messages import (
    Cancelled,
    CancelReason,
    ChatMessage,
    FinalEvent,
    GenerationState,
    Queued,
    SessionEvent,
    Usage,
    decode_final,
    encode,
    event_type,
    final_state,
)
from wire.outcomes import (
    Accepted,
    Admitted,
    AlreadyFinal,
    BadToken,
    BadTurn,
    Busy,
    CancelAsked,
    CancelledQueued,
    CancelReply,
    Duplicate,
    EndedBefore,
    Exhausted,
    HistoryFull,
    Limited,
    Moved,
    NotStarted,
    OverCapacity,
    ScriptReplyError,
    SessionMissing,
    SignalWorker,
    SubmitReply,
    TakenOver,
    TakeoverReply,
    UnknownGeneration,
)
from wire.prefixes import Prefix
from wire.replies import text
from wire.topology import Topology, topology_of

USAGE_CORE = lua_source("usage_core")
"""Lua functions ``add_usage`` (count a generation's usage to its tenant) and
``count_usage`` (the same, from its final event, where one Redis holds every key)."""
EMIT_CORE = USAGE_CORE + lua_source("emit_core")
"""Lua functions ``emit`` (append an event and publish it) and ``finish`` (end a generation,
counting its usage: ``count_usage``)."""
ADMIT_CORE = lua_source("admit_core")
"""Lua function ``admit_tenant``: a key's admission against its limits."""
FAIR_CORE = lua_source("fair_core")
"""Lua functions of a model's fair share (``fair_enqueue``, ``fair_charge``, ...)."""
HOLD_CORE = lua_source("hold_core")
"""Lua function ``hold_prefix``: a worker among a prefix's holders (cache affinity)."""
EMIT_EVENT = lua_source("emit_event")
"""Lua function ``emit_event``: one writer's event, checked (after ``EMIT_CORE``)."""


Bill = Literal["all", "completion", "none"]
"""What a generation's final event bills its tenant: prompt and completion tokens, the
completion only (another choice of a request: the prompt is billed with choice 0), or
nothing (tokenize, detokenize)."""


class Script:
    """A script of wire/lua/ as its topology calls it (``wire.topology``): a function of
    the library on one Redis, EVALSHA of its text behind its shared functions on a
    cluster."""

    name: ClassVar[str]
    """Its file in wire/lua/."""
    cores: ClassVar[tuple[str, ...]] = ()
    """The shared functions it calls, in the order its text is loaded behind."""
    source: ClassVar[str]
    """Its whole text as EVAL runs it (the cores, then its file)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.source = "".join(cls.cores) + lua_source(cls.name)

    def __init__(self, redis: aioredis.Redis, keys: Keys, topology: Topology | None = None) -> None:
        self.keys = keys
        self.topology = topology or topology_of(redis)
        self._redis = redis
        self._loaded = False
        self.command = self.topology.script_command(self)
        """What calls it, before its keys: ``FCALL <function>`` or ``EVALSHA <sha>``."""

    async def load(self) -> None:
        """Load it where the topology keeps scripts (every primary of a cluster). A call
        outside a pipeline loads it where it is missing by itself; a pipeline only reports
        the loss (``wire.library.lost_scripts``: a restarted Redis, a replica promoted in
        a failover): its caller loads and sends it again."""
        await self.topology.load_script(self)
        self._loaded = True

    async def load_once(self) -> None:
        """``load``, unless this process loaded it before."""
        if not self._loaded:
            await self.load()

    async def _run(
        self, keys: Sequence[str | bytes], args: Sequence[Arg], pipe: Pipeline | None
    ) -> object:
        if pipe is not None:
            await self.load_once()
            self.queue_call(pipe, keys, args)
            return None
        command = (*self.command, len(keys), *keys, *args)
        try:
            return await self._redis.execute_command(*command)  # type: ignore[no-untyped-call]
        except ResponseError as exc:
            if not lost_scripts(exc):
                raise
        await self.load()
        return await self._redis.execute_command(*command)  # type: ignore[no-untyped-call]

    def queue_call(self, pipe: Pipeline, keys: Sequence[str | bytes], args: Sequence[Arg]) -> None:
        """Its call in ``pipe``, the script loaded or not: on ``lost_scripts`` its caller
        calls ``load`` and sends the pipeline again. The command, not ``pipe.evalsha``:
        redis-py's cluster pipeline refuses that by name (it cannot load a script on its
        own) but routes the command by its keys' one slot."""
        pipe.execute_command(*self.command, len(keys), *keys, *args)

    @staticmethod
    def reply(reply: object) -> str | None:
        """An entry id reply (Emit, EndQueued): the id, or None for Lua's false."""
        return text(reply) if isinstance(reply, bytes | str) else None


def _texts(reply: object) -> list[str]:
    return [text(item) for item in reply] if isinstance(reply, list) else []


_message_decoder = msgspec.json.Decoder(ChatMessage)


def takeover_reply(reply: object) -> TakeoverReply:
    match _texts(reply):
        case ["takeover", takeovers, from_worker]:
            return TakenOver(int(takeovers), from_worker)
        case ["queued", takeovers, from_worker]:
            return NotStarted(int(takeovers), from_worker)
        case ["cancel", reason]:
            return CancelAsked(msgspec.convert(reason, CancelReason))
        case ["exhausted"]:
            return Exhausted()
        case ["final"]:
            return AlreadyFinal()
        case ["moved"]:
            return Moved()
    raise ScriptReplyError(f"TAKEOVER answered {reply!r}")


def counts_of(items: list[str]) -> Counts:
    """A key's counts as admit_tenant answers them (wire/lua/admit_core.lua)."""
    if len(items) != 9:
        raise ScriptReplyError(f"a key's admission answered {items!r}")
    refused: LimitName | None = None
    if items[0] != "ok":
        refused = msgspec.convert(items[0], LimitName)
    return Counts(refused, *(int(value) for value in items[1:]))


def limits_args(limits: Limits | None, count_request: bool) -> list[Arg]:
    """A key's limits as admit_tenant takes them (none: no arguments, no admission)."""
    if limits is None:
        return []
    return [
        "1" if count_request else "0",
        limits.concurrent,
        limits.requests_per_minute,
        limits.tokens_per_minute,
        limits.tokens_per_day,
        RUNNING_HOLD_S * 1000,
    ]


def submit_reply(reply: object) -> SubmitReply:
    match _texts(reply):
        case ["admitted", queued_id, *counts]:
            return Admitted(queued_id, counts_of(counts))
        case ["limited", *counts]:
            return Limited(counts_of(counts))
        case ["ok", queued_id, *history]:
            return Accepted(queued_id, [_message_decoder.decode(item) for item in history])
        case ["missing"]:
            return SessionMissing()
        case ["forbidden"]:
            return BadToken()
        case ["duplicate", generation_id]:
            return Duplicate(generation_id)
        case ["busy", generation_id]:
            return Busy(generation_id)
        case ["history_full"]:
            return HistoryFull()
        case ["overloaded", scope, count]:
            return OverCapacity(scope, int(count))
        case ["bad_turn", kind]:
            return BadTurn(kind)
    raise ScriptReplyError(f"SUBMIT answered {reply!r}")


def cancel_reply(reply: object) -> CancelReply:
    match _texts(reply):
        case ["unknown"]:
            return UnknownGeneration()
        case ["final", _state, final]:
            return EndedBefore(decode_final(final))
        case ["cancelled", event_id, final]:
            return CancelledQueued(event_id, decode_final(final))
        case ["signal", worker]:
            return SignalWorker(worker)
    raise ScriptReplyError(f"CANCEL answered {reply!r}")


class Emit(Script):
    """Append one event of a generation to its session (wire/lua/emit.lua)."""

    name = "emit"
    cores = (EMIT_CORE, EMIT_EVENT)

    async def __call__(
        self,
        *,
        session_id: str,
        event: SessionEvent,
        maxlen: int,
        ttl_s: int,
        final: bool = False,
        writer: str = "",
        assistant: ChatMessage | None = None,
        seq: int = 0,
        epoch: int = 0,
        pipe: Pipeline | None = None,
    ) -> str | None:
        """The event's entry id, or None when refused (the generation ended or expired, or
        ``writer``, at ``epoch``, does not own it). ``writer`` "": a gateway (no ownership
        check). ``final``: the event ends the generation (``assistant`` joins the history).
        ``seq``: the writer's 1, 2, 3... for this generation (0: none); a write at or below
        the last one is a retry, answered with the latest id and not written again; one
        past the next (Redis lost the events between, a failover) ends the generation with
        ``error`` ``events_lost`` and is refused."""
        keys, gid = self.keys, event.generation_id
        reply = await self._run(
            [
                keys.events(session_id),
                keys.generation(session_id, gid),
                keys.active(session_id),
                keys.history(session_id),
            ],
            [
                keys.live_channel(session_id),
                maxlen,
                ttl_s,
                event_type(event),
                gid,
                encode(event),
                final_state(event) if final else "",  # type: ignore[arg-type]
                writer,
                encode(assistant) if assistant is not None else "",
                seq or "",
                epoch,
            ],
            pipe,
        )
        return self.reply(reply)


class Takeover(Script):
    """Take a running generation from its worker, atomically (wire/lua/takeover.lua)."""

    name = "takeover"

    async def __call__(
        self,
        *,
        session_id: str,
        generation_id: str,
        worker: str,
        max_takeovers: int,
        usage: Usage | None = None,
        preempted: bool = False,
        lost: bool = False,
    ) -> TakeoverReply:
        """``worker``: the one lost or stopping; ``usage``: what it streamed so far, when
        known; ``preempted``: its worker stops it for another tenant's request (never
        counted against ``max_takeovers``); ``lost``: the worker is thought lost, and the
        caller ends the generation if a cancel was asked (``CancelAsked``): it is taken
        from the worker first, so nothing the worker writes after goes unbilled."""
        used = encode(usage) if usage is not None else ""
        reply = await self._run(
            [self.keys.generation(session_id, generation_id)],
            [worker, max_takeovers, used, "1" if preempted else "", "1" if lost else ""],
            None,
        )
        return takeover_reply(reply)


@dataclass(frozen=True, slots=True)
class AdmitInSubmit:
    """What SUBMIT needs to admit a stateless session's request and queue it, in the same
    call (one Redis: every key on one node): the queues counted, the limits, the request."""

    queues: list[str]
    """Every model's request queue (``Keys.requests``), counted against ``limit``."""
    target: int
    """The place in ``queues`` of the queue the request goes to."""
    limit: int
    """Generations in flight, of all models, that refuse one more."""
    model_limit: int
    """Generations in flight of the request's model that refuse one more (0: none)."""
    request: bytes
    """The encoded ``GenerationRequest`` as its tenant's list holds it
    (``WaitingRequest.element``: its prompt's estimate first)."""
    tenant: str
    """Its place in the queue's fair share (``wire.keys.tenant_slot``)."""
    weight: float
    """The tenant's weight: its share of the engine against the others'."""
    stream_cap: int
    """The requests stream's cap (approximate), should the request go straight into it
    (nothing waiting for a worker: wire/lua/fair_core.lua ``fair_straight``)."""
    limits: Limits | None = None
    """The limits of the key the request serves, admitted in the same call (one Redis holds
    the key's keys too); None: none, or admitted before."""
    count_request: bool = True
    """False for another choice of a request counted already (``Admit``)."""


@dataclass(frozen=True, slots=True)
class NewSession:
    """A stateless session that SUBMIT makes with its one generation (a one-shot request)."""

    session_id: str
    generation_id: str
    maxlen: int
    """Its events stream's cap."""
    ttl_s: int
    watch_ttl_s: int
    tenant: str = ""
    """Who it serves and is billed to (``GenerationRequest.tenant``)."""
    bill: Bill = "all"
    limits: Limits | None = None
    """Its key's limits (what its end keeps for them: ``usage_counts``); None: not known."""
    queue: str = ""
    """The model's queue it goes to, kept with the generation: a reader's gateway that
    finds that queue empty while the generation waits knows Redis lost its request."""


def _admitting(admission: AdmitInSubmit) -> tuple[list[str], list[Arg]]:
    """SUBMIT's KEYS and ARGV after its own, to admit a request and queue it (``AdmitInSubmit``)."""
    return admission.queues, [
        admission.limit,
        admission.model_limit,
        admission.target + 1,
        admission.request,
        SHARED_KEY_TTL_S,
        CONSUMER_GROUP,
        admission.tenant,
        admission.weight,
        admission.stream_cap,
        *limits_args(admission.limits, admission.count_request),
    ]


class Submit(Script):
    """Queue a generation in a session: message, limits, queued event (wire/lua/submit.lua)."""

    name = "submit"
    cores = (EMIT_CORE, FAIR_CORE, ADMIT_CORE)
    _admitted: BatchedCalls | None = None
    """``create_admitted``'s calls (one Redis only: admitting in the script needs it)."""

    async def __call__(
        self,
        *,
        session_id: str,
        generation_id: str,
        user_message: ChatMessage | None,
        token_digest: str,
        idempotency_key: str | None,
        maxlen: int,
        ttl_s: int,
        max_history: int,
        watch_ttl_s: int,
        choice: int = 0,
        note: bytes = b"",
        queue: str = "",
        tenant: str = "",
        bill: Bill = "all",
        turn: str = "",
        limits: Limits | None = None,
    ) -> SubmitReply:
        """``token_digest`` "": no token check. ``choice`` > 0: another choice of the turn
        just submitted (no ``user_message``): queued beside it, not the session's active
        generation. ``note``: its request without its conversation, kept with the
        generation (to queue it again, should Redis lose it); ``queue``: the one it goes to.
        ``tenant``: who it serves, billed ``bill`` when its final event is written;
        ``limits``: its key's (what that event keeps for them; None: not known).
        ``turn``: how it changes the history first (wire/lua/submit.lua: "" a new message,
        ``edit <i>``, ``regenerate``, ``continue``)."""
        keys, args = self._keys_args(
            session_id,
            generation_id,
            maxlen=maxlen,
            ttl_s=ttl_s,
            watch_ttl_s=watch_ttl_s,
            user_message=user_message,
            token_digest=token_digest,
            idempotency_key=idempotency_key,
            max_history=max_history,
            choice=choice,
            note=note,
            queue=queue,
            tenant=tenant,
            bill=bill,
            turn=turn,
            limits=limits,
        )
        return submit_reply(await self._run(keys, args, None))

    def submit_in(self, pipe: Pipeline, **submit: Any) -> None:
        """``__call__`` queued in ``pipe`` (its bare call: on ``lost_scripts``, ``load`` and
        send it again); ``replied`` reads its reply."""
        self.queue_call(pipe, *self._keys_args(**submit))

    def create_in(self, pipe: Pipeline, new: NewSession) -> None:
        """Queue in ``pipe`` the making of ``new`` (its bare call: on ``lost_scripts``,
        ``load`` and send it again); ``replied`` reads its reply."""
        self.queue_call(pipe, *self._new_session(new, None))

    async def create_admitted(self, new: NewSession, admission: AdmitInSubmit) -> SubmitReply:
        """Admit a request (or answer ``OverCapacity``), make ``new`` and queue the request
        after its generation, in one call on one Redis. A lone call is the whole round trip
        (no pipeline: redis-py's costs about 20 us of CPU a call); the calls made while one
        is under way (a burst) go together in one pipeline when it is back
        (wire/batched.py)."""
        if self._admitted is None:
            self._admitted = BatchedCalls(self._redis, self.command, self.load)
        return submit_reply(await self._admitted(*self._new_session(new, admission)))

    def _new_session(
        self, new: NewSession, admission: AdmitInSubmit | None
    ) -> tuple[list[str], list[Arg]]:
        return self._keys_args(
            new.session_id,
            new.generation_id,
            maxlen=new.maxlen,
            ttl_s=new.ttl_s,
            watch_ttl_s=new.watch_ttl_s,
            create=True,
            admission=admission,
            tenant=new.tenant,
            bill=new.bill,
            limits=new.limits,
            queue=new.queue,
        )

    @staticmethod
    def replied(reply: object) -> SubmitReply:
        return submit_reply(reply)

    def _keys_args(
        self,
        session_id: str,
        generation_id: str,
        *,
        maxlen: int,
        ttl_s: int,
        watch_ttl_s: int,
        user_message: ChatMessage | None = None,
        token_digest: str = "",
        idempotency_key: str | None = None,
        max_history: int = 0,
        create: bool = False,
        choice: int = 0,
        note: bytes = b"",
        queue: str = "",
        turn: str = "",
        admission: AdmitInSubmit | None = None,
        tenant: str = "",
        bill: Bill = "all",
        limits: Limits | None = None,
    ) -> tuple[list[str], list[Arg]]:
        """Submit's KEYS and ARGV, the one place they are listed (the defaults: what a
        stateless session made by ``create_in`` has: no message, token, key or history)."""
        keys = self.keys
        admitting = _admitting(admission) if admission is not None else ([], [])
        return [
            keys.meta(session_id),
            keys.history(session_id),
            keys.active(session_id),
            keys.generation(session_id, generation_id),
            keys.events(session_id),
            keys.watch(session_id),
            keys.idempotency(session_id, idempotency_key or ""),
            *admitting[0],
        ], [
            keys.live_channel(session_id),
            maxlen,
            ttl_s,
            generation_id,
            encode(user_message).decode() if user_message is not None else "",
            time.time(),
            max_history,
            watch_ttl_s,
            encode(Queued(generation_id, choice)),
            token_digest,
            "1" if idempotency_key else "",
            "1" if create else "",
            "1" if choice else "",
            note,
            queue,
            tenant,
            bill,
            turn,
            usage_counts(limits),
            *admitting[1],
        ]


class Cancel(Script):
    """Cancel a generation: end a queued one here, flag a running one (wire/lua/cancel.lua)."""

    name = "cancel"
    cores = (EMIT_CORE,)

    async def __call__(
        self,
        *,
        session_id: str,
        generation_id: str,
        reason: CancelReason,
        maxlen: int,
        ttl_s: int,
    ) -> CancelReply:
        keys = self.keys
        cancelled = Cancelled(generation_id, reason, Usage(0, 0))
        reply = await self._run(
            [
                keys.generation(session_id, generation_id),
                keys.events(session_id),
                keys.active(session_id),
            ],
            [
                keys.live_channel(session_id),
                maxlen,
                ttl_s,
                generation_id,
                reason,
                encode(cancelled),
            ],
            None,
        )
        return cancel_reply(reply)


class EndQueued(Script):
    """End a generation no worker has started (wire/lua/end_queued.lua)."""

    name = "end_queued"
    cores = (EMIT_CORE,)

    async def __call__(
        self,
        *,
        session_id: str,
        event: FinalEvent,
        maxlen: int,
        ttl_s: int,
        pipe: Pipeline | None = None,
    ) -> str | None:
        """The final event's entry id, or None when it started or ended meanwhile."""
        keys, gid = self.keys, event.generation_id
        state: GenerationState = final_state(event)
        reply = await self._run(
            [keys.generation(session_id, gid), keys.events(session_id), keys.active(session_id)],
            [keys.live_channel(session_id), maxlen, ttl_s, gid, state, encode(event)],
            pipe,
        )
        return self.reply(reply)


class HoldReaperLock(Script):
    """Take the reaper's lock, or keep it while this owner holds it
    (wire/lua/hold_lock.lua)."""

    name = "hold_lock"

    async def __call__(self, *, owner: str, ttl_ms: int) -> bool:
        """Whether ``owner`` holds the lock now (for ``ttl_ms`` more)."""
        return await self._run([self.keys.reaper_lock], [owner, ttl_ms], None) == 1


class Touch(Script):
    """A queued turn noted on its session's meta, if Redis still holds it
    (wire/lua/touch.lua)."""

    name = "touch"

    async def __call__(
        self, *, session_id: str, now: float, title: str, follows: bool, pipe: Pipeline
    ) -> None:
        """Queue it in ``pipe``, its bare call (on ``lost_scripts``, ``load`` and send
        again). ``title``: what the conversation is named if it has no title ("":
        nothing); ``follows``: it is named so even if it has one, unless a person named
        it."""
        await self.load_once()
        args: list[Arg] = [now, title, "1" if follows else ""]
        self.queue_call(pipe, [self.keys.meta(session_id)], args)


# --- a model's queue shared between tenants (wire/queue.py) ---------------------------------


@dataclass(frozen=True, slots=True)
class WaitingRequest:
    """A request for its tenant's list of a model's queue (``FairEnqueue``)."""

    base: str
    """The model's fair base (``Keys.fair``)."""
    submitting: str
    """The model's notes of submits (``Keys.submitting``)."""
    tenant: str
    """Its slot (``wire.keys.tenant_slot``)."""
    weight: float
    request: bytes
    estimate: int
    """The tokens its prompt is guessed at (``wire.queue.estimated_tokens``): charged to its
    tenant when it leaves the list; the worker charges the difference once it knows."""
    note: bytes = b""
    """The note of its submit to cross off with it (b"": none)."""
    prefixes: Sequence[Prefix] = ()
    """Its prompt's prefixes, longest first (``wire.prefixes.asked``): a worker that holds
    one takes it first (docs/affinity.md)."""

    @property
    def element(self) -> bytes:
        """The request as its tenant's list holds it: its estimate (and its prefixes, each
        ``name:tokens``), ``|``, the request (fair_take.lua moves the estimate into the
        stream entry's ``e`` field; fair_core.lua's fair_holders reads the prefixes)."""
        if self.prefixes:
            named = ",".join(f"{prefix.name}:{prefix.tokens}" for prefix in self.prefixes)
            return b"%d %s|%s" % (self.estimate, named.encode(), self.request)
        return b"%d|%s" % (self.estimate, self.request)

    def keys_args(self) -> tuple[list[str], list[Arg]]:
        return [self.base, self.submitting], [
            self.tenant,
            self.weight,
            self.element,
            SHARED_KEY_TTL_S,
            self.note,
        ]


class FairEnqueue(Script):
    """A request into its tenant's list of a model's queue (wire/lua/fair_enqueue.lua)."""

    name = "fair_enqueue"
    cores = (FAIR_CORE,)

    async def __call__(self, waiting: WaitingRequest) -> None:
        await self._run(*waiting.keys_args(), None)

    def enqueue_in(self, pipe: Pipeline, waiting: WaitingRequest) -> None:
        """``__call__`` queued in ``pipe`` (its bare call: on ``lost_scripts``, ``load`` and
        send it again)."""
        self.queue_call(pipe, *waiting.keys_args())


@dataclass(frozen=True, slots=True)
class AffinityWait:
    """How long a request whose prefix another worker holds waits for that worker before a
    worker taking with this wait may run it (docs/affinity.md)."""

    most_ms: int
    """The bound (``TOKENSPOUT_AFFINITY_WAIT_MS``); 0: no affinity, the queue's order."""
    prefill_tokens_per_s: float = 0.0
    """The taker's prefill rate as measured (0: not yet): a request waits no longer than
    prefilling its held prefix here would take, since that is all the wait can save."""


NO_AFFINITY = AffinityWait(0)
"""A take in the queue's order alone."""


class Taken(NamedTuple):
    """What a worker's take (``FairTake``) got, and what it left."""

    entries: list[tuple[bytes, dict[bytes, bytes]]]
    """The requests taken, as the requests stream holds them."""
    tenants_waiting: int
    """How many tenants still have requests waiting in their lists."""
    soonest_ms: int
    """The ms until a request passed over for another worker that holds its prefix may go
    anywhere (0: none was; docs/affinity.md)."""


class FairTake(Script):
    """A worker's take: what it served charged, then up to ``count`` requests, the stream's
    first, then the tenants' by their counters, those whose prefix it holds first when
    ``affinity`` has a wait (wire/lua/fair_take.lua)."""

    name = "fair_take"
    cores = (FAIR_CORE,)

    async def __call__(
        self,
        *,
        stream: str,
        base: str,
        consumer: str,
        count: int,
        maxlen: int,
        affinity: AffinityWait,
        served: Sequence[tuple[str, int]] = (),
        offers_free: bool = True,
        pipe: Pipeline | None = None,
    ) -> Taken:
        """``offers_free``: its free slots are offered to new requests (a preempting
        worker offers none). With ``pipe``, queued there as its bare call (``taken``
        reads its reply; on ``lost_scripts`` its caller calls ``load``), and nothing yet."""
        charges = [item for pair in served for item in pair]
        offers = "1" if offers_free else "0"
        args: list[Arg] = [CONSUMER_GROUP, consumer, count, maxlen, SHARED_KEY_TTL_S, offers]
        args += [affinity.most_ms, round(affinity.prefill_tokens_per_s), *charges]
        if pipe is not None:
            self.queue_call(pipe, [stream, base], args)
            return Taken([], 0, 0)
        return self.taken(await self._run([stream, base], args, None))

    @staticmethod
    def taken(reply: object) -> Taken:
        entries, waiting, soonest = cast(tuple[list[tuple[bytes, list[bytes]]], int, int], reply)
        return Taken(
            [
                (entry_id, dict(zip(fields[::2], fields[1::2], strict=True)))
                for entry_id, fields in entries
            ],
            int(waiting),
            int(soonest),
        )


class FairHold(Script):
    """A worker among the holders of the prefixes a request it ran left in its engine's
    cache (wire/lua/fair_hold.lua)."""

    name = "fair_hold"
    cores = (HOLD_CORE,)

    async def __call__(self, *, base: str, worker: str, names: Sequence[str], ttl_s: int) -> None:
        await self._run([base], [ttl_s, worker, *names], None)


class FairPreempt(Script):
    """Whether a reply here gives way to a waiting tenant served far less lately: that
    tenant's request, taken, and the tenant that gives way (wire/lua/fair_preempt.lua)."""

    name = "fair_preempt"
    cores = (FAIR_CORE,)

    async def __call__(
        self,
        *,
        stream: str,
        base: str,
        consumer: str,
        maxlen: int,
        yielding: Sequence[str],
        others: Sequence[str],
    ) -> tuple[str, tuple[bytes, dict[bytes, bytes]]] | bool:
        """The tenant that gives way and the request taken for the one owed; else whether
        any tenant waits in a list (False: none, so none can be owed until one comes)."""
        args: list[Arg] = [CONSUMER_GROUP, consumer, maxlen, SHARED_KEY_TTL_S, ANONYMOUS]
        args += [len(yielding), *yielding, *others]
        reply = cast(list[Any], await self._run([stream, base], args, None))
        if len(reply) == 1:
            return bool(reply[0])
        victim, entries = cast(tuple[bytes, list[tuple[bytes, list[bytes]]]], reply)
        entry_id, fields = entries[0]
        return text(victim), (entry_id, dict(zip(fields[::2], fields[1::2], strict=True)))


class FairCharge(Script):
    """Tokens served to tenants, charged to their counters (wire/lua/fair_charge.lua)."""

    name = "fair_charge"
    cores = (FAIR_CORE,)

    async def __call__(self, *, base: str, served: Sequence[tuple[str, int]]) -> None:
        charges = [item for pair in served for item in pair]
        await self._run([base], [SHARED_KEY_TTL_S, *charges], None)


class Locate(Script):
    """Where a request of a generation may be in its queue, read at one moment: noted on
    its way, waiting (some request waits: it may be one), taken, or nowhere
    (wire/lua/locate.lua)."""

    name = "locate"

    async def __call__(
        self, *, stream: str, base: str, submitting: str, generation_id: str, most_pending: int
    ) -> Literal["noted", "waiting", "taken"] | None:
        args: list[Arg] = [CONSUMER_GROUP, generation_id, most_pending]
        reply = await self._run([stream, base, submitting], args, None)
        return cast(Literal["noted", "waiting", "taken"], text(reply)) if reply else None


class FairExpire(Script):
    """The requests of the tenants' lists queued before a deadline, taken out for the
    reaper to end (wire/lua/fair_expire.lua)."""

    name = "fair_expire"
    cores = (FAIR_CORE,)

    async def __call__(self, *, base: str, deadline_s: float, most: int) -> list[bytes]:
        reply = await self._run([base], [deadline_s, most], None)
        return cast(list[bytes], reply or [])
