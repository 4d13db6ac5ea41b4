"""The usage check of a chaos run: each key's counted tokens equal what its clients
received, exactly.

What a generation *delivered* is what its session's stream in Redis holds, read once the
run is over: the stream is what every reader of every API reads (and re-reads on resume),
so it is the truth of what reached a client, also for a reply whose final event its client
never saw (its connection cut, its gateway killed, a one-shot request sent again). For
each generation that ended, whatever way it ended:

- prompt tokens: its ``started`` event's ``prompt_tokens`` (none when it never started:
  cancelled or timed out in the queue, a worker lost before it claimed it); a request's
  other choices (``n`` > 1) bill no prompt, its first one bills it once;
- completion tokens: the tokens of its ``token`` events, across takeovers (each event's
  ``token_ids``; their running ``count`` must agree).

That is compared three ways:

1. per generation, with what the script that wrote its final event billed (the final
   event's usage, or the usage a takeover recorded when the final carries none: what
   wire/lua/usage_core.lua counts);
2. per key, with what Redis counted (``GET /v1/admin/usage``), summed over every
   generation of the key (found by a scan of the run's keys, so also those no client
   record names);
3. per client reply that saw its end, with the usage that reply reported (a session
   event's ``usage``, OpenAI's ``usage``, the Responses API's ``input_tokens`` and
   ``output_tokens``), and its generation must bill the client's key.

A generation that never ended bills nothing; it must have delivered nothing either. A
key with limits must have no generation left counting against its concurrent limit.

On a Redis Cluster a generation's usage is counted by its final event's writer right after
that event (wire/tenancy.py); the tenant's ``counted`` set names what was counted, so a
key's difference there is told apart: a generation ended and never counted."""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.chaos.check import BEFORE_S
from bench.chaos.clients import Record
from bench.chaos.fleet import Loss
from bench.chaos.tenants import ApiKey
from stack.rig import sync_client
from wire import Keys

FINALS = ("done", "cancelled", "error")
BATCH = 500
TALLY = ("prompt_tokens", "completion_tokens", "generations")


@dataclass
class Generation:
    """One generation as Redis holds it once the run is over."""

    session_id: str
    generation_id: str
    tenant: str = ""
    bill: str = "all"
    final: dict[str, Any] | None = None
    """Its final event as its hash keeps it (None: it never ended)."""
    recorded: dict[str, Any] | None = None
    """The usage a takeover recorded (the hash's ``usage``)."""
    prompt: int | None = None
    """``prompt_tokens`` of its ``started`` event (None: it never started)."""
    tokens: int = 0
    count: int = 0
    finals: list[str] = field(default_factory=list)
    """The final events its stream holds (one for a generation that ended)."""
    final_ms: int = 0
    """When its final event was written (its stream id, Redis's clock)."""
    where: str = ""
    """Where its hash says it stands (``STANDING`` fields): the story of one that never
    ended."""

    @property
    def ended(self) -> bool:
        return self.final is not None

    @property
    def billable(self) -> bool:
        """Counted to its key (usage_core.lua): it ended, and is no tokenizer task."""
        return self.ended and self.bill != "none"

    @property
    def end(self) -> str:
        if self.final is None:
            return "never ended"
        code = self.final.get("code") or self.final.get("reason") or ""
        return f"{self.final['type']}:{code}" if code else str(self.final["type"])

    def delivered(self) -> tuple[int, int]:
        """(prompt, completion) tokens its stream delivered, as billed: a request's other
        choices bill no prompt, a tokenizer task nothing."""
        if self.bill == "none":
            return 0, 0
        return (self.prompt or 0) if self.bill == "all" else 0, self.tokens

    def billed(self) -> tuple[int, int]:
        """What the script that wrote its final event counted (wire/lua/usage_core.lua)."""
        usage = (self.final or {}).get("usage")
        if not isinstance(usage, dict):
            usage = self.recorded or {}
        if self.bill == "none":
            return 0, 0
        prompt = int(usage.get("prompt_tokens", 0)) if self.bill == "all" else 0
        return prompt, int(usage.get("completion_tokens", 0))

    def describe(self) -> str:
        prompt, completion = self.delivered()
        billed = self.billed()
        where = f", its hash: {self.where}" if self.final is None else ""
        return (
            f"{self.generation_id} (session {self.session_id}, {self.end}): delivered "
            f"{prompt}+{completion}, its final billed {billed[0]}+{billed[1]}{where}"
        )


STANDING = ("state", "worker", "takeovers", "from", "cancel", "seq", "queue", "queued_id")
"""Fields of a generation's hash that say where it stands (wire/lua/submit.lua, emit_event.lua,
takeover.lua)."""


def read_generations(redis_url: str, keys: Keys) -> dict[str, Generation]:
    """Every generation of the run's prefix, with its session's stream: by generation id."""
    found: dict[str, Generation] = {}
    with sync_client(redis_url) as client:
        names = [
            name.decode()
            for name in client.scan_iter(match=f"{keys.prefix}:{{*}}:gen:*", count=1000)
        ]
        for chunk in _batches(names):
            with client.pipeline(transaction=False) as pipe:
                for name in chunk:
                    pipe.hmget(name, ["tenant", "bill", "final", "usage", *STANDING])
                _read_hashes(chunk, pipe.execute(), found)
        for chunk in _batches(sorted({g.session_id for g in found.values()})):
            with client.pipeline(transaction=False) as pipe:
                for session_id in chunk:
                    pipe.xrange(keys.events(session_id))
                for entries in pipe.execute():
                    _read_stream(entries, found)
    return found


def _batches(items: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(items), BATCH):
        yield items[start : start + BATCH]


def _read_hashes(names: list[str], replies: list[Any], into: dict[str, Generation]) -> None:
    for name, (tenant, bill, final, recorded, *standing) in zip(names, replies, strict=True):
        session_id = name[name.index("{") + 1 : name.index("}")]
        generation = Generation(session_id, name.rsplit(":gen:", 1)[1])
        generation.tenant = tenant.decode() if tenant else ""
        generation.bill = bill.decode() if bill else "all"
        generation.final = json.loads(final) if final else None
        generation.recorded = json.loads(recorded) if recorded else None
        generation.where = " ".join(
            f"{field}={value.decode()}"
            for field, value in zip(STANDING, standing, strict=True)
            if value is not None
        )
        into[generation.generation_id] = generation


def _read_stream(entries: list[Any], into: dict[str, Generation]) -> None:
    for entry_id, fields in entries:
        generation = into.get(fields[b"g"].decode())
        if generation is None:
            continue  # no hash: Redis holds no generation to bill (a finding if it had tokens)
        kind, data = fields[b"t"].decode(), json.loads(fields[b"d"])
        if kind == "started" and generation.prompt is None:
            generation.prompt = int(data["prompt_tokens"])
        elif kind == "token":
            generation.tokens += len(data.get("token_ids") or [])
            generation.count = int(data["count"])
        elif kind in FINALS:
            generation.finals.append(kind)
            generation.final_ms = int(entry_id.decode().partition("-")[0])


def read_tenant_sets(redis_url: str, keys: Keys, api_keys: list[ApiKey]) -> dict[str, TenantSets]:
    """Per key id: the generations a Redis Cluster's writers marked counted, and those
    still counting against its concurrent limit."""

    def members(client: Any, key: str) -> list[str]:
        return [member.decode() for member in client.zrange(key, 0, -1)]

    with sync_client(redis_url) as client:
        return {
            key.id: TenantSets(
                set(members(client, keys.tenant(key.id, "counted"))),
                members(client, keys.tenant(key.id, "running")),
            )
            for key in api_keys
        }


@dataclass(frozen=True)
class TenantSets:
    counted: set[str]
    running: list[str]


async def counted_usage(
    http: httpx.AsyncClient, url: str, admin: str, key: ApiKey
) -> dict[str, int]:
    """The key's usage as Redis counted it (``GET /v1/admin/usage``, the last 30 days)."""
    answer = await http.get(
        f"{url}/v1/admin/usage",
        params={"key": key.id, "granularity": "day"},
        headers={"Authorization": f"Bearer {admin}"},
    )
    answer.raise_for_status()
    total = answer.json()["total"]
    return {name: int(total[name]) for name in TALLY}


@dataclass
class Finding:
    """An anomaly of the usage check: when (the run's second), whose, what."""

    at_s: float
    label: str
    what: str


@dataclass
class UsageCheck:
    """The check over one run's generations (``read_generations``), keys and records."""

    api_keys: list[ApiKey]
    generations: dict[str, Generation]
    records: list[Record]
    started_ms: int
    """The run's start on Redis's clock (unix ms): a finding's second."""
    cluster: bool
    failovers: list[float] = field(default_factory=list)
    """When (the run's second) a cluster primary was killed: a write its replica had not
    received yet is lost with it (replication is asynchronous)."""
    losses: list[Loss] = field(default_factory=list)
    """The faults that lost writes: a reply that lived through one may be missing from
    Redis, or lack its end there (bench/chaos/check.py says what its client must see)."""
    findings: list[Finding] = field(default_factory=list)

    def lived_through_a_loss(self, record: Record) -> bool:
        """Redis lost writes since its session (or request) began: it may be gone since."""
        return any(record.began_s - BEFORE_S <= loss.at_s for loss in self.losses)

    def flag(self, at_s: float, label: str, what: str) -> None:
        self.findings.append(Finding(round(at_s, 2), label, what))

    def at_s(self, generation: Generation) -> float:
        if not generation.final_ms:
            return 0.0
        return max(0.0, (generation.final_ms - self.started_ms) / 1000)

    def check_generations(self) -> None:
        """Each generation bills a key of the run, is numbered right, has one end and
        billed what it delivered; one that never ended delivered nothing."""
        known = {key.id for key in self.api_keys}
        for generation in self.generations.values():
            at, label = self.at_s(generation), f"usage {generation.generation_id}"
            if generation.tenant not in known:
                self.flag(at, label, f"bills {generation.tenant or 'nobody'}, no key of the run")
            if generation.tokens != generation.count:
                what = f"{generation.tokens} tokens delivered, numbered {generation.count}"
                self.flag(at, label, what)
            if generation.final is None:
                if generation.prompt is not None or generation.tokens:
                    self.flag(at, label, f"never ended: {generation.describe()}")
                continue
            if generation.finals != [generation.final["type"]]:
                self.flag(at, label, f"its stream holds the finals {generation.finals}")
            if generation.billed() != generation.delivered():
                self.flag(at, label, f"billed differs from delivered: {generation.describe()}")

    def check_records(self) -> set[str]:
        """Each reply bills its client's key, and the usage it reported is what its
        generation delivered; returns the generations whose end a client saw."""
        seen: set[str] = set()
        for record in self.records:
            if record.generation_id is None:
                continue  # refused, or cut before it had one: the scan finds what it left
            mine = self.generations.get(record.generation_id)
            if self.lived_through_a_loss(record):
                continue  # what Redis holds of it may lack what its client read
            if mine is None:
                what = f"generation {record.generation_id} not in Redis"
                self.flag(record.started_s, record.label, what)
                continue
            if mine.tenant != record.key.id:
                what = f"{mine.generation_id} bills {mine.tenant}; its client sent with "
                what += f"{record.key.name} ({record.key.id})"
                self.flag(record.started_s, record.label, what)
            if record.final is not None and not record.interrupted:
                seen.add(mine.generation_id)
                self._check_told(record, mine)
        return seen

    def _check_told(self, record: Record, mine: Generation) -> None:
        """A request's other choices (``n`` > 1) are sessions of their own that nothing
        names: each is checked on its own (the scan finds it); they run the same script
        for the same ``max_tokens`` (the client compared their texts), so the request
        reports its first choice's prompt once and ``n`` times its completion."""
        if record.usage_told is None:
            return
        told = (record.usage_told["prompt_tokens"], record.usage_told["completion_tokens"])
        prompt, completion = mine.delivered()
        if told != (prompt, completion * record.choices):
            what = (
                f"its reply reported {told[0]}+{told[1]} tokens for {record.choices} "
                f"choices; the first delivered {prompt}+{completion}: {mine.describe()}"
            )
            self.flag(record.started_s, record.label, what)

    def check_key(
        self, key: ApiKey, counted: dict[str, int], sets: TenantSets, seen: set[str], end_s: float
    ) -> dict[str, Any]:
        """The key's counted usage against what its generations delivered; its figures."""
        mine = [g for g in self.generations.values() if g.tenant == key.id and g.billable]
        prompt, completion = _sum(g.delivered() for g in mine)
        delivered = dict(zip(TALLY, (prompt, completion, len(mine)), strict=True))
        label = f"usage of key {key.name}"
        if counted != delivered:
            self.flag(end_s, label, f"counted {counted}, delivered {delivered}")
            for generation in mine:
                if self.cluster and generation.generation_id not in sets.counted:
                    self.flag(self.at_s(generation), label, self._uncounted(generation))
        if key.limits and sets.running:
            what = f"{len(sets.running)} generations still count against its limits: "
            self.flag(end_s, label, what + ", ".join(map(self._running, sets.running[:10])))
        return {
            "name": key.name,
            "id": key.id,
            "weight": key.weight,
            "limits": key.limits,
            "counted": counted,
            "delivered": delivered,
            "ends": dict(sorted(collections.Counter(g.end for g in mine).items())),
            "other_choices": sum(g.bill == "completion" for g in mine),
            "ended_unseen_by_clients": sum(
                g.generation_id not in seen and g.bill == "all" for g in mine
            ),
            "refused_by_limits": sum(r.rate_limited for r in self.records if r.key.id == key.id),
        }

    def _running(self, generation_id: str) -> str:
        """A generation left counting against its key's limits, and what became of it."""
        generation = self.generations.get(generation_id)
        if generation is None:
            return f"{generation_id} (admitted, never submitted: no such generation)"
        return f"{generation_id} ({generation.end})"

    def _uncounted(self, generation: Generation) -> str:
        """A generation a cluster never counted, and the failover that may have lost its
        count (else its writer was lost before it counted)."""
        at = self.at_s(generation)
        near = [f"{kill - at:+.1f} s" for kill in self.failovers if abs(kill - at) <= 2]
        why = f"a primary killed {', '.join(near)} from its end" if near else "no failover near"
        return f"ended, never counted on the cluster ({why}): {generation.describe()}"


def _sum(pairs: Iterable[tuple[int, int]]) -> tuple[int, int]:
    prompt = completion = 0
    for first, second in pairs:
        prompt, completion = prompt + first, completion + second
    return prompt, completion


async def check_usage(
    http: httpx.AsyncClient,
    *,
    gateway: str,
    admin: str,
    redis_url: str,
    keys: Keys,
    api_keys: list[ApiKey],
    records: list[Record],
    started_ms: int,
    cluster: bool,
    failovers: list[float],
    losses: list[Loss],
    end_s: float,
) -> tuple[list[dict[str, Any]], list[Finding]]:
    """The whole check, once the run is over and the engine idle: each key's figures, and
    what differs. ``failovers``: when a cluster's primaries were killed."""
    generations = await asyncio.to_thread(read_generations, redis_url, keys)
    sets = await asyncio.to_thread(read_tenant_sets, redis_url, keys, api_keys)
    check = UsageCheck(api_keys, generations, records, started_ms, cluster, failovers, losses)
    check.check_generations()
    seen = check.check_records()
    figures = []
    for key in api_keys:
        counted = await counted_usage(http, gateway, admin, key)
        figures.append(check.check_key(key, counted, sets[key.id], seen, end_s))
    return figures, check.findings
