"""The wire contract between gateway and engine: the one engine module the gateway imports.

Everything that crosses Redis is defined here: the messages (msgspec Structs, JSON on the
wire), the key layout, and the Lua scripts that keep a session's event stream consistent.

Schema evolution: new fields go at the end with defaults; a change that old readers cannot
ignore bumps ``WIRE_VERSION`` and the key prefix, so two versions never share keys.
Version 2: the ``resumed`` event and ``GenerationRequest.resume`` (takeover), which a
version-1 gateway could not decode and a version-1 worker would run from the start.

Redis layout (every key from ``Keys``, every one with a TTL, every stream capped):

    {prefix}:requests:{model}         stream, consumer group "engines": generation requests
                                      for one model (its served name; the workers of that
                                      model read it), TTL SHARED_KEY_TTL_S, refreshed by
                                      submits and workers
    {prefix}:models                   hash served name (or alias) -> model (its queue's name),
                                      written by every worker heartbeat (same TTL): the names
                                      a gateway knows, live or not
    {prefix}:cancels                  stream read by every worker: cancel signals (same TTL)
    {prefix}:workers                  sorted set worker id -> last heartbeat (unix seconds)
                                      (same TTL, refreshed by every heartbeat)
    {prefix}:reaper-lock              string, PX: the gateway whose reaper runs now
    {prefix}:worker:{id}              hash, EX: a live worker's description (with the
                                      Redis client id of its lease connection)
    {prefix}:{<sid>}:meta             hash: token digest, created, kind (chat | stateless)
    {prefix}:{<sid>}:history          list of ChatMessage JSON
    {prefix}:{<sid>}:events           stream of session events (the SSE ``id:`` is its entry id)
    {prefix}:{<sid>}:gen:{gid}        hash: generation state, worker (its owner), final
                                      event, seq of the owner's last event (EMIT is
                                      idempotent per seq), takeovers (its epoch), usage
    {prefix}:{<sid>}:active           string: the generation that is running now
    {prefix}:{<sid>}:idem:{key}       string: Idempotency-Key -> generation id
    {prefix}:{<sid>}:watch            string, EX grace: someone is reading the session

The ``{<sid>}`` hash tag keeps a session's keys in one Redis Cluster slot, so every script
below touches one slot only.
"""

from __future__ import annotations

import re
from typing import Literal, cast

import msgspec

WIRE_VERSION = 2
DEFAULT_PREFIX = f"ts{WIRE_VERSION}"
CONSUMER_GROUP = "engines"
SHARED_KEY_TTL_S = 7 * 86_400
"""Lifetime of the shared keys (``requests``, ``cancels``, ``workers``), refreshed on every
write: submits, cancels, worker heartbeats. They only expire once nothing has used them for
that long; a worker recreates a lost consumer group by itself."""

Role = Literal["system", "user", "assistant"]
GenerationState = Literal["queued", "running", "done", "cancelled", "error"]
CancelReason = Literal["user", "abandoned", "disconnected", "shutdown"]
TERMINAL_EVENTS = frozenset({"done", "cancelled", "error"})


# --- messages -------------------------------------------------------------------------


class ChatMessage(msgspec.Struct, frozen=True):
    role: Role
    content: str


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int | None = None
    stop: list[str] = []
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    """Ask the engine for the logprob of each sampled token (TGI and OpenAI adapters)."""
    # vLLM's extra sampling fields (its OpenAI server takes them; clients send them through
    # the SDK's ``extra_body``). Neutral defaults: an old writer's request means what it did.
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


class GenerationRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the gateway queues for an engine worker (``requests`` stream, field ``r``)."""

    generation_id: str
    session_id: str
    params: SamplingParams
    messages: list[ChatMessage] = []
    """Chat input; the engine applies the model's chat template."""
    prompt: str | None = None
    """Raw text input (completions, TGI, OIP): used as-is, no chat template."""
    enqueued_at: float = 0.0
    session_ttl_s: int = 86_400
    """Lifetime the session's keys get when the generation ends (set by the gateway)."""
    events_maxlen: int = 20_000
    """Cap of the session's event stream (the gateway's TOKENSPOUT_EVENTS_MAXLEN)."""
    v: int = WIRE_VERSION
    resume: Resume | None = None
    """Set when the generation was taken over: continue it after what was streamed."""

    @property
    def engine_request_id(self) -> str:
        """One per epoch: a continuation never clashes with an earlier run still aborting."""
        return f"{self.generation_id}@{self.resume.takeover}" if self.resume else self.generation_id


class Resume(msgspec.Struct, frozen=True):
    """What a generation had streamed when its worker was lost or stopped: the next worker
    runs the prompt plus ``token_ids`` for ``max_tokens - completion_tokens`` more."""

    takeover: int
    """The epoch (1 for the first takeover): only its request may claim the generation."""
    from_worker: str
    prompt_tokens: int
    completion_tokens: int
    text: str
    token_ids: list[int]


class CancelSignal(msgspec.Struct, frozen=True):
    """Broadcast to every worker (``cancels`` stream, field ``c``); the owner aborts."""

    generation_id: str
    session_id: str
    reason: CancelReason = "user"


class WorkerInfo(msgspec.Struct, frozen=True):
    worker_id: str
    backend: str
    model: str
    capacity: int
    running: int
    started_at: float
    aliases: list[str] = []
    """More names the model answers to (``--served-model-name a,b``: ``b``)."""
    max_model_len: int | None = None
    """Longest prompt plus reply in tokens; None: no fixed context (synthetic)."""
    lease_id: int = 0
    """Client id of its lease connection (``lease_name``; engine/lease.py); 0: none."""
    draining: bool = False

    @property
    def names(self) -> list[str]:
        return [self.model, *self.aliases]


# --- session events (the stream entry ``d`` field, and the SSE ``data:``) ---------------


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Queued(msgspec.Struct, frozen=True, tag="queued"):
    generation_id: str


class Started(msgspec.Struct, frozen=True, tag="started"):
    generation_id: str
    model: str
    prompt_tokens: int


class Token(msgspec.Struct, frozen=True, tag="token"):
    generation_id: str
    text: str
    """The text delta (may hold more than one token when the engine batched a step)."""
    count: int
    """Completion tokens generated so far, this delta included."""
    token_ids: list[int] = []
    logprobs: list[float] | None = None


class Done(msgspec.Struct, frozen=True, tag="done"):
    generation_id: str
    finish_reason: str
    usage: Usage


class Cancelled(msgspec.Struct, frozen=True, tag="cancelled"):
    generation_id: str
    reason: CancelReason
    usage: Usage


class Error(msgspec.Struct, frozen=True, tag="error"):
    generation_id: str
    code: str
    message: str


class Resumed(msgspec.Struct, frozen=True, tag="resumed"):
    """The generation goes on in another worker: its next token follows the last one."""

    generation_id: str
    from_worker: str
    to_worker: str
    completion_tokens: int
    """Tokens streamed before the takeover."""
    takeover: int


SessionEvent = Queued | Started | Token | Done | Cancelled | Error | Resumed
FinalEvent = Done | Cancelled | Error

_event_decoder = msgspec.json.Decoder(SessionEvent)
_encoder = msgspec.json.Encoder()


def event_type(event: SessionEvent) -> str:
    return type(event).__struct_config__.tag  # type: ignore[return-value]


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)


def decode_event(data: bytes | str) -> SessionEvent:
    event: SessionEvent = _event_decoder.decode(data)
    return event


# --- Redis replies (redis-py types them loosely; both sides read them through these) ---

StreamEntry = tuple[bytes, dict[bytes, bytes]]


def text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def entry_id_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``<ms>-<seq>``) as a sortable pair; ValueError if it is none."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def entries_of(reply: object) -> list[StreamEntry]:
    """Entries of an XRANGE/XREVRANGE/XCLAIM reply."""
    return cast(list[StreamEntry], reply or [])


def read_entries(reply: object) -> list[StreamEntry]:
    """Entries of an XREAD/XREADGROUP reply, all streams together."""
    streams = cast(list[tuple[bytes, list[StreamEntry]]], reply or [])
    return [entry for _stream, entries in streams for entry in entries]


def lease_name(worker_id: str) -> str:
    """The client name of a worker's lease connection (CLIENT SETNAME)."""
    return f"tokenspout-lease:{worker_id}"


def final_state(event: FinalEvent) -> GenerationState:
    return "done" if isinstance(event, Done) else event_type(event)  # type: ignore[return-value]


MODEL_NAME = re.compile(r"[^\s{}]{1,128}")
"""A served model name: it becomes part of a key, so no hash-tag braces and no spaces."""


def check_model_name(name: str) -> str:
    if not MODEL_NAME.fullmatch(name):
        raise ValueError(f"model name {name!r}: 1 to 128 characters, no spaces or braces")
    return name


# --- keys ------------------------------------------------------------------------------


class Keys:
    """Builds every Redis key from one prefix (tests use a fresh prefix per run)."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = prefix
        self.models = f"{prefix}:models"
        self.cancels = f"{prefix}:cancels"
        self.workers = f"{prefix}:workers"
        self.reaper_lock = f"{prefix}:reaper-lock"

    def requests(self, model: str) -> str:
        """The queue of one model (a model's workers read only their own)."""
        return f"{self.prefix}:requests:{model}"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def _session(self, session_id: str) -> str:
        return f"{self.prefix}:{{{session_id}}}"

    def meta(self, session_id: str) -> str:
        return f"{self._session(session_id)}:meta"

    def history(self, session_id: str) -> str:
        return f"{self._session(session_id)}:history"

    def events(self, session_id: str) -> str:
        return f"{self._session(session_id)}:events"

    def live_channel(self, session_id: str) -> str:
        """Pub/sub channel that mirrors ``events`` for live readers."""
        return f"{self._session(session_id)}:live"

    def generation(self, session_id: str, generation_id: str) -> str:
        return f"{self._session(session_id)}:gen:{generation_id}"

    def active(self, session_id: str) -> str:
        return f"{self._session(session_id)}:active"

    def idempotency(self, session_id: str, key: str) -> str:
        return f"{self._session(session_id)}:idem:{key}"

    def watch(self, session_id: str) -> str:
        return f"{self._session(session_id)}:watch"

    def session_id_of_channel(self, channel: str) -> str:
        start = channel.index("{") + 1
        return channel[start : channel.index("}", start)]


# --- scripts ---------------------------------------------------------------------------
#
# A live message on ``live_channel`` is "<entry id> <type> <generation id> <json>", the same
# event the stream holds, so a live reader needs no second round trip.

_EMIT_CORE = """
local function emit(events, gen, channel, maxlen, ttl, etype, gid, data)
  local id = redis.call('XADD', events, 'MAXLEN', '~', maxlen, '*', 't', etype, 'g', gid, 'd', data)
  redis.call('PUBLISH', channel, id .. ' ' .. etype .. ' ' .. gid .. ' ' .. data)
  return id
end
local function finish(gen, active, gid, state, id, data, ttl)
  redis.call('HSET', gen, 'state', state, 'final_id', id, 'final', data)
  redis.call('EXPIRE', gen, ttl)
  if redis.call('GET', active) == gid then redis.call('DEL', active) end
end
"""

EMIT_SCRIPT = (
    _EMIT_CORE
    + """
-- KEYS: events, gen, active, history
-- ARGV: channel, maxlen, ttl, type, gid, data, final_state ('' if not final),
--       writer (the worker's id; '' for a gateway: no ownership check),
--       assistant message JSON ('' for none),
--       seq (the writer's 1, 2, 3... for this generation; '' or absent: no check),
--       epoch (the takeover its request carries; '' or absent: 0)
-- Returns the entry id, or false when the generation already ended (or expired), or the
-- writer (worker and epoch) does not own it: so "no event after the final one" and "one
-- worker per reply" hold whatever a writer does. 'started'/'resumed' claim a queued
-- generation; before the claim, the current epoch's writer may only end it (a prefill
-- error).
-- A seq at or below the generation's last written one is a retried write (a pipeline sent
-- again after a lost connection): nothing is written, and the reply is the id of the
-- latest event written, so a retry never shows a client an event twice.
local seq = tonumber(ARGV[10] or '')
local writer, epoch = ARGV[8], tonumber(ARGV[11] or '') or 0
-- One read for the retry, state and owner checks: this runs for every token.
local seen = redis.call('HMGET', KEYS[2], 'seq', 'seq_id', 'state', 'final_id', 'worker',
                        'takeovers')
if seq and seq <= tonumber(seen[1] or '0') then return seen[2] end
if (not seen[3]) or seen[4] then return false end
local claim = ARGV[4] == 'started' or ARGV[4] == 'resumed'
if claim and seen[3] ~= 'queued' then return false end
if writer ~= '' then
  if epoch ~= tonumber(seen[6] or '0') then return false end
  if seen[3] == 'queued' then
    if not claim and ARGV[7] == '' then return false end
  elseif seen[5] ~= writer then return false end
end
local id = emit(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
if seq then redis.call('HSET', KEYS[2], 'seq', seq, 'seq_id', id) end
if claim then redis.call('HSET', KEYS[2], 'state', 'running', 'worker', writer) end
if ARGV[7] ~= '' then
  finish(KEYS[2], KEYS[3], ARGV[5], ARGV[7], id, ARGV[6], ARGV[3])
  if ARGV[9] ~= '' then
    redis.call('RPUSH', KEYS[4], ARGV[9])
    redis.call('EXPIRE', KEYS[4], ARGV[3])
  end
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
return id
"""
)

TAKEOVER_SCRIPT = """
-- KEYS: gen
-- ARGV: worker (the one lost or stopping), max takeovers, usage JSON so far ('' unknown)
-- Takes a running generation from its worker atomically (two reapers, or a reaper and the
-- stopping worker, never both hand it on). Returns {'takeover', takeovers, from}: queued
-- at the next epoch, queue its continuation | {'queued', takeovers, from}: not running,
-- queue it at that epoch | {'cancel', reason}: end it cancelled | {'exhausted'}: taken
-- over max times, end it | {'final'} | {'moved'} (another worker owns it): nothing to do
local g = redis.call('HMGET', KEYS[1], 'state', 'final_id', 'worker', 'cancel', 'takeovers',
                     'from')
if (not g[1]) or g[2] then return {'final'} end
local takeovers = tonumber(g[5] or '0')
if g[4] then return {'cancel', g[4]} end
if g[1] == 'queued' then return {'queued', takeovers, g[6] or ''} end
if g[3] ~= ARGV[1] then return {'moved'} end
if takeovers >= tonumber(ARGV[2]) then return {'exhausted'} end
takeovers = takeovers + 1
redis.call('HSET', KEYS[1], 'state', 'queued', 'worker', '', 'takeovers', takeovers,
           'from', ARGV[1])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'usage', ARGV[3]) end
redis.call('HDEL', KEYS[1], 'seq', 'seq_id')
return {'takeover', takeovers, ARGV[1]}
"""

SUBMIT_SCRIPT = (
    _EMIT_CORE
    + """
-- KEYS: meta, history, active, gen, events, watch, idempotency ('' for none)
-- ARGV: channel, maxlen, session_ttl, gid, user message JSON ('' for none), now,
--       max_history, watch_ttl, queued event JSON, token digest ('' for no check)
-- Returns {'ok', queued id, history...} | {'missing'} | {'forbidden'} | {'duplicate', gid}
--         | {'busy', gid} | {'history_full'}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
-- The token is checked here, not in a separate round trip. Comparing digests (never the
-- token itself) leaks nothing useful through timing.
if ARGV[10] ~= '' and redis.call('HGET', KEYS[1], 'token') ~= ARGV[10] then
  return {'forbidden'}
end
if KEYS[7] ~= '' then
  local existing = redis.call('GET', KEYS[7])
  if existing then return {'duplicate', existing} end
end
local running = redis.call('GET', KEYS[3])
if running then return {'busy', running} end
if ARGV[5] ~= '' then
  if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[7]) then return {'history_full'} end
  redis.call('RPUSH', KEYS[2], ARGV[5])
end
local ttl = ARGV[3]
redis.call('SET', KEYS[3], ARGV[4], 'EX', ttl)
if KEYS[7] ~= '' then redis.call('SET', KEYS[7], ARGV[4], 'EX', ttl) end
redis.call('HSET', KEYS[4], 'state', 'queued', 'created', ARGV[6])
redis.call('EXPIRE', KEYS[4], ttl)
redis.call('SET', KEYS[6], '1', 'EX', ARGV[8])
local id = emit(KEYS[5], KEYS[4], ARGV[1], ARGV[2], ttl, 'queued', ARGV[4], ARGV[9])
for _, key in ipairs({KEYS[1], KEYS[2], KEYS[5]}) do redis.call('EXPIRE', key, ttl) end
local reply = {'ok', id}
for _, message in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do table.insert(reply, message) end
return reply
"""
)

CANCEL_SCRIPT = (
    _EMIT_CORE
    + """
-- KEYS: gen, events, active
-- ARGV: channel, maxlen, ttl, gid, reason, cancelled event JSON (for a queued generation)
-- Returns {'unknown'} | {'final', state, final JSON} | {'cancelled', id, JSON} | {'signal', worker}
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return {'unknown'} end
if redis.call('HEXISTS', KEYS[1], 'final_id') == 1 then
  return {'final', state, redis.call('HGET', KEYS[1], 'final')}
end
redis.call('HSET', KEYS[1], 'cancel', ARGV[5])
if state == 'queued' then
  -- Not running: end it here, so the worker that dequeues it skips it. One queued again
  -- after a takeover counts what it streamed before (the usage its takeover recorded).
  local data = ARGV[6]
  local usage = redis.call('HGET', KEYS[1], 'usage')
  if usage then
    local event = cjson.decode(data)
    event['usage'] = cjson.decode(usage)
    data = cjson.encode(event)
  end
  local id = emit(KEYS[2], KEYS[1], ARGV[1], ARGV[2], ARGV[3], 'cancelled', ARGV[4], data)
  finish(KEYS[1], KEYS[3], ARGV[4], 'cancelled', id, data, ARGV[3])
  return {'cancelled', id, data}
end
return {'signal', redis.call('HGET', KEYS[1], 'worker') or ''}
"""
)

END_QUEUED_SCRIPT = (
    _EMIT_CORE
    + """
-- KEYS: gen, events, active
-- ARGV: channel, maxlen, ttl, gid, final state, final event JSON
-- Ends a generation that no worker has started (the gateway's queue deadline), the way a
-- queued cancel does: a worker that dequeues it later finds it final and skips it.
-- Returns the entry id, or false when it started or ended meanwhile (or expired).
if redis.call('HGET', KEYS[1], 'state') ~= 'queued' then return false end
if redis.call('HEXISTS', KEYS[1], 'final_id') == 1 then return false end
local id = emit(KEYS[2], KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[5], ARGV[4], ARGV[6])
finish(KEYS[1], KEYS[3], ARGV[4], ARGV[5], id, ARGV[6], ARGV[3])
return id
"""
)
