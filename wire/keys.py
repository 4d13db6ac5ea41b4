"""Every Redis key, built from one prefix (tests use a fresh prefix per run).

Redis layout (every key with a TTL, every stream capped):

    {prefix}:requests:{model}         stream, consumer group "engines": generation requests
                                      for one model (its served name; the workers of that
                                      model read it), TTL SHARED_KEY_TTL_S, refreshed by
                                      submits and workers
    {{prefix}:requests:{model}}:submitting
                                      sorted set request JSON (its messages left out) ->
                                      unix seconds: session turns written but whose
                                      request has not reached the queue yet (same TTL);
                                      on the queue's slot (its hash tag is the queue's key)
    {{prefix}:requests:{model}}:fair    hash: ``waiting`` (requests in the tenants' lists
                                      below), ``floor`` (the counter of the tenant served
                                      last); the base of the names below, all on the
                                      queue's slot (wire/queue.py, docs/tenants.md)
    {{prefix}:requests:{model}}:fair:t:{tenant}
                                      list of requests a tenant has waiting, oldest first
    {{prefix}:requests:{model}}:fair:ready
                                      sorted set tenant -> its virtual token counter: the
                                      tenants with requests waiting
    {{prefix}:requests:{model}}:fair:vtc
                                      hash tenant -> its virtual token counter (tokens
                                      served / weight)
    {{prefix}:requests:{model}}:fair:recent
                                      hash tenant -> '<sum> <ms>': tokens served lately
                                      per unit of weight, each halving every 5 s
    {{prefix}:requests:{model}}:fair:weights
                                      hash tenant -> its weight
    {{prefix}:requests:{model}}:fair:bell
                                      list, at most one entry: rung when a request waits,
                                      an idle worker of the model waits on it
    {{prefix}:requests:{model}}:fair:bell:{worker}
                                      list, at most one entry: rung when a request whose
                                      prefix the worker holds waits (docs/affinity.md)
    {{prefix}:requests:{model}}:fair:h:{name}
                                      set, EX: the workers that hold the prompt prefix
                                      named (wire/prefixes.py) in their engine's cache
    {{prefix}:requests:{model}}:fair:free
                                      hash worker -> '<slots> <until, unix s> <offered>':
                                      its free slots at its last take (for 3 s), offered to
                                      new requests (1) or not (0: a preempting worker's)
    {prefix}:models                   hash served name (or alias) -> model (its queue's name),
                                      written by every worker heartbeat (same TTL): the names
                                      a gateway knows, live or not
    {prefix}:models:since             string: when the first heartbeat wrote the names
                                      (unix ms, set if absent; same TTL): a registry
                                      younger than its workers was lost and is refilling
    {prefix}:cancels                  stream read by every worker: cancel signals (same TTL)
    {prefix}:workers                  sorted set worker id -> last heartbeat (unix seconds)
                                      (same TTL, refreshed by every heartbeat)
    {prefix}:reaper-lock              string, PX: the gateway whose reaper runs now
    {prefix}:worker:{id}              hash, EX: a live worker's description (with the
                                      Redis client id of its lease connection)
    {prefix}:owner:{digest}           sorted set session id -> last update (unix seconds):
                                      the conversations of one owner (the web chat's
                                      cookie, by its digest), TTL the session TTL, renewed
    {prefix}:{<sid>}:meta             hash: token digest, created, kind (chat | stateless);
                                      a conversation's owner digest, title, updated, and
                                      settings (model, system, temperature, max_tokens)
    {prefix}:{<sid>}:history          list of ChatMessage JSON
    {prefix}:{<sid>}:replies          hash history index -> how the session turn's reply at
                                      that place ended (generation, model, final event,
                                      takeovers, its first and last event ids), written by
                                      the script that writes its final event; an index one
                                      past the history: a reply that left no message
    {prefix}:{<sid>}:versions         list of JSON: what a regenerate or an edit cut from the
                                      history (its messages and their replies, from index
                                      ``at``), oldest first, at most max-history of them
    {prefix}:{<sid>}:events           stream of session events (the SSE ``id:`` is its entry id)
    {prefix}:{<sid>}:gen:{gid}        hash: generation state, worker (its owner), final
                                      event, seq of the owner's last event (EMIT is
                                      idempotent per seq), takeovers (its epoch), usage,
                                      prompt (its started event's prompt tokens),
                                      a session turn's note and queue (its request without
                                      the conversation: queued again should Redis lose it),
                                      and its turn, queued event id and reply's index
                                      (``at``) in the history
    {prefix}:{<sid>}:active           string: the generation that is running now
    {prefix}:{<sid>}:idem:{key}       string: Idempotency-Key -> generation id
    {prefix}:{<sid>}:watch            string, EX grace: someone is reading the session
    {prefix}:{<sid>}:keep             string, EX session TTL: a background response, run on
                                      with no reader (workers count it as a reader)
    {{prefix}:tenants}:records        hash key id -> its record (JSON: name, the SHA-256
                                      digest of its secret, models, weight, limits, when
                                      made, changed, revoked); no TTL: keys live until
                                      revoked, and revoked ones stay for the books
    {{prefix}:tenants}:version        counter, bumped with every change of the records
                                      (gateways reload them when it moves)
    {prefix}:tenant:{<tid>}:requests  sorted set generation id -> unix ms: the tenant's
                                      requests admitted in the last minute (PX 61 s)
    {prefix}:tenant:{<tid>}:running   sorted set generation id -> unix ms it stops counting:
                                      the tenant's generations not ended (the final event's
                                      script removes it; PX the longest it may count)
    {prefix}:tenant:{<tid>}:sessions  hash generation id -> session id: the running ones
                                      ADMIT admitted before their SUBMIT (a round trip of
                                      its own), dropped with their running entry; the reaper
                                      gives back one whose generation never came (PX as
                                      running)
    {prefix}:tenant:{<tid>}:tpm       hash unix second -> tokens: its last minute's, kept
                                      for a key with a tokens-per-minute limit (EX 120 s)
    {prefix}:tenant:{<tid>}:usage:hour:<hour>, ...:usage:day:<day>
                                      hash prompt_tokens, completion_tokens, generations: its
                                      usage per UTC hour and day (hours and days since the
                                      epoch; EX 45 and 400 days); a tokens-per-day limit
                                      reads the day's
    {prefix}:tenant:{<tid>}:counted   sorted set generation id -> unix seconds: generations
                                      whose usage was counted on a Redis Cluster (one day)

The ``{<sid>}`` hash tag keeps a session's keys in one Redis Cluster slot, so every script
(wire/scripts.py) touches one slot only (the scripts that write a reply's record derive
``replies`` and ``versions`` from a sibling key's name, as ``active`` is derived from
``events``: same prefix, another suffix); ``{<tid>}`` does the same for a tenant's keys
(wire/tenancy.py), and the keys store is one slot of its own (gateway/tenants/keystore.py).
"""

from __future__ import annotations

import re

from wire.messages import WIRE_VERSION

DEFAULT_PREFIX = f"ts{WIRE_VERSION}"
CONSUMER_GROUP = "engines"
SHARED_KEY_TTL_S = 7 * 86_400
"""Lifetime of the shared keys (``requests``, ``cancels``, ``workers``), refreshed on every
write: submits, cancels, worker heartbeats. They only expire once nothing has used them for
that long; a worker recreates a lost consumer group by itself."""


TENANT_ID = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
"""A tenant's id: it becomes the hash tag of its keys, so no braces and no spaces."""
MODEL_NAME = re.compile(r"[^\s{}]{1,128}")
"""A served model name: it becomes part of a key, so no hash-tag braces and no spaces."""


def check_model_name(name: str) -> str:
    if not MODEL_NAME.fullmatch(name):
        raise ValueError(f"model name {name!r}: 1 to 128 characters, no spaces or braces")
    return name


def lease_name(worker_id: str) -> str:
    """The client name of a worker's lease connection (CLIENT SETNAME)."""
    return f"tokenspout-lease:{worker_id}"


def relay_name(host: str, pid: int) -> str:
    """The client name of a gateway process's sharded pub/sub connections on a Redis
    Cluster (CLIENT SETNAME): ``CLIENT LIST`` tells whose each one is."""
    return f"tokenspout-relay:{host}:{pid}"


class Keys:
    """Builds every Redis key from one prefix (tests use a fresh prefix per run)."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = prefix
        self.models = f"{prefix}:models"
        self.models_since = f"{prefix}:models:since"
        self.cancels = f"{prefix}:cancels"
        self.workers = f"{prefix}:workers"
        self.reaper_lock = f"{prefix}:reaper-lock"

    def requests(self, model: str) -> str:
        """The queue of one model (a model's workers read only their own)."""
        return f"{self.prefix}:requests:{model}"

    def submitting(self, model: str) -> str:
        """The session turns on their way to ``model``'s queue (wire/queue.py): on the
        queue's Redis Cluster slot, so one pipeline queues a request and crosses it off."""
        return f"{{{self.requests(model)}}}:submitting"

    def fair(self, model: str) -> str:
        """The base of the names of ``model``'s tenants' waiting lists (``FairNames``)."""
        return f"{{{self.requests(model)}}}:fair"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def owner(self, digest: str) -> str:
        """The conversations of the owner whose secret has this digest (newest last)."""
        return f"{self.prefix}:owner:{digest}"

    def _session(self, session_id: str) -> str:
        return f"{self.prefix}:{{{session_id}}}"

    def meta(self, session_id: str) -> str:
        return f"{self._session(session_id)}:meta"

    def history(self, session_id: str) -> str:
        return f"{self._session(session_id)}:history"

    def events(self, session_id: str) -> str:
        return f"{self._session(session_id)}:events"

    def replies(self, session_id: str) -> str:
        return f"{self._session(session_id)}:replies"

    def versions(self, session_id: str) -> str:
        return f"{self._session(session_id)}:versions"

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

    def keep(self, session_id: str) -> str:
        return f"{self._session(session_id)}:keep"

    def tenant(self, tenant_id: str, name: str) -> str:
        """One of a tenant's keys (``requests``, ``running``, ``tpm``, ``usage:hour:<hour>``,
        ...), in its own hash slot. wire/lua/usage_core.lua builds
        the same names from a generation's key and its tenant."""
        return f"{self.prefix}:tenant:{{{tenant_id}}}:{name}"

    @property
    def tenant_records(self) -> str:
        return f"{{{self.prefix}:tenants}}:records"

    @property
    def tenant_version(self) -> str:
        return f"{{{self.prefix}:tenants}}:version"

    def session_id_of_channel(self, channel: str) -> str:
        start = channel.index("{") + 1
        return channel[start : channel.index("}", start)]


ANONYMOUS = "-"
"""The tenant of a request made with no key (``GenerationRequest.tenant`` "")."""


def tenant_slot(tenant: str) -> str:
    """A tenant's name in its model's fair-queue keys (``FairNames.waiting``)."""
    return tenant or ANONYMOUS


class FairNames:
    """The names of one model's fair-queue keys, from its base (``Keys.fair``): the Lua
    scripts derive the same ones from the base by the same suffixes (wire/lua/fair_core.lua)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.ready = f"{base}:ready"
        self.vtc = f"{base}:vtc"
        self.recent = f"{base}:recent"
        """What each tenant was served lately, per unit of weight (wire/lua/fair_core.lua,
        ``fair_recent``)."""
        self.weights = f"{base}:weights"
        self.bell = f"{base}:bell"
        self.newcomer = f"{base}:newcomer"
        """Rung when a tenant that had nothing waiting queues a request (a full worker
        that preempts waits on it: engine/policies.py)."""
        self.free = f"{base}:free"
        """Each worker's free slots as its last take left them, and until when that holds
        (wire/lua/fair_core.lua ``fair_free``)."""

    def own_bell(self, worker: str) -> str:
        """Rung for ``worker`` alone: a request whose prefix it holds was queued (fair_core.lua
        ``fair_stamped``)."""
        return f"{self.bell}:{worker}"

    def waiting(self, tenant: str) -> str:
        return f"{self.base}:t:{tenant_slot(tenant)}"
