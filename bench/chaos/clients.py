"""The clients of a chaos run, each one as a user of that API would write it, recording
everything it got into a ``Record`` for the checker (bench/chaos/check.py).

- ``SessionReader``: the session API over SSE; drops its stream at random points (and
  whenever the stream breaks) and resumes on another replica with ``Last-Event-ID``;
  some read slowly. Sends with ``Idempotency-Key`` so a send cut off mid-way is sent again
  safely.
- ``WsCanceller``: WebSocket ``generate`` then ``cancel`` after a random number of tokens;
  when its socket breaks it goes on over SSE, as the web chat does.
- ``OpenAIClient``: chat completions, streamed or whole. It cannot resume: a request cut
  off by its own gateway's death, or ended ``shutting_down`` by its gateway's SIGTERM, is
  counted as interrupted, nothing else.
- ``ResponsesReader``: a background Responses stream, resumed with ``starting_after``
  on another replica when it breaks or its gateway ends it ``shutting_down``.

A request refused before it started (a 429 or 503 with ``Retry-After``, a gateway that
is down) is sent again after the hint; any other 5xx is noted as a problem, and so is a
refusal by a key's limits for a key that has none.

Every client sends with one of the run's API keys (bench/chaos/tenants.py): a session is
made with it (its turns bill it), a one-shot request carries it as Bearer. A record keeps
the key and what the reply said it used, for the usage check (bench/chaos/usage.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import httpx
from websockets.asyncio.client import connect
from websockets.exceptions import WebSocketException

from bench.chaos.tenants import RATE_LIMITED, ApiKey
from bench.loadgen import sse_events

SETTLE_S = 5.0
"""How long a gateway fault can still reach a request begun after it: a SIGTERMed gateway
closes its connections (a request on one gets cut) through its 3 s grace and exit."""
READ_TIMEOUT_S = 20.0
"""Longer than any fault holds a process (a stopped gateway or worker, Redis away)."""
REFUSED_FOR_S = 30.0
"""A client refused (or cut off) this long since its first refusal gives up: an anomaly."""
WHOLE_TIMEOUT = httpx.Timeout(None, connect=3.0)
"""A whole answer comes at once, after the reply: its bound is the run's (90 s)."""
WORDS = [
    "tide",
    "river",
    "stone",
    "lamp",
    "quiet",
    "ember",
    "north",
    "orchard",
    "violet",
    "copper",
    "meadow",
    "harbor",
]
SESSION_FINALS = {"done", "cancelled", "error"}
FAILING_SHARE = 0.05
"""Of the session readers' turns, those the engine fails after some tokens."""
ENGINE_ERROR = "engine_error"
"""The code of the synthetic engine's failure on request (engine/backends/synthetic.py)."""
SHUTTING_DOWN = "shutting_down"
GENERATION_RUNNING = "generation_running"
UNAVAILABLE = "unavailable"
"""An open stream's end when its gateway could not read Redis: the reply runs on; resume it."""
"""The error a gateway stopped by SIGTERM ends a request with when it outlasts the grace."""
RESPONSE_FINALS = {"response.completed", "response.incomplete", "response.failed"}
BROKEN = (httpx.TransportError, WebSocketException, OSError, asyncio.TimeoutError)
"""How a connection to a gateway fails: refused, reset, cut, or silent past the timeout."""
LOSSES = frozenset(
    {"events_lost", "session_lost", "unknown_session", "unknown_generation", "response_not_found"}
)
"""What a client may be told when Redis lost what it was reading (docs/api.md, "Resume
never goes silent"): the only ends a reply may have besides its own, and only after a
fault that loses writes (docs/reliability.md)."""
RETRYABLE_CODES = frozenset(
    {"overloaded", UNAVAILABLE, "model_unavailable", "no_worker", "keys_not_loaded", RATE_LIMITED}
)
"""A WebSocket ``generate`` refused before it started, with ``retry_after_s``: sent again.
``no_worker`` is what a gateway says while no worker is registered, as after a wiped Redis
until the workers' next heartbeat; ``keys_not_loaded``: a gateway started while Redis was
down has not read the run-time keys yet (docs/api.md)."""
LOSS_WORDS = ("Redis lost", "was lost")
"""How the APIs with no error code (TGI, OIP, gRPC) say the same, in their message."""


@dataclass
class Record:
    """What one client got for one reply."""

    kind: str
    label: str
    model: str
    content: str
    max_tokens: int
    started_s: float
    key: ApiKey
    """The API key it sends with (its session's, for the session API)."""
    events: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    """(id, event, data) in the order read, across every reconnect."""
    text: str = ""
    final: str | None = None
    final_data: dict[str, Any] = field(default_factory=dict)
    reconnects: int = 0
    interrupted: str | None = None
    """Why the client could not see the end, where that was not the product's fault."""
    problems: list[str] = field(default_factory=list)
    """What the client itself found wrong (an undocumented 5xx, a malformed frame)."""
    session: tuple[str, str] | None = None
    """(session id, token) for the session-stream check afterwards."""
    generation_id: str | None = None
    cancel_after: int | None = None
    cancel_sent: bool = False
    tokens_after_final: int = 0
    retries: int = 0
    rate_limited: int = 0
    """Refusals by its key's limits (429 ``rate_limit_exceeded``), each waited out."""
    choices: int = 1
    """``n``: the generations the request asked for (an OpenAI request's choices)."""
    fails_after: int | None = None
    """The engine fails the reply after this many tokens (``[[fail:N]]`` in its content:
    engine/backends/synthetic.py): its right end is that ``error``."""
    usage_told: dict[str, int] | None = None
    """The usage its reply reported (prompt_tokens, completion_tokens), if it saw one."""
    trail: list[str] = field(default_factory=list)
    """What the client did, with the run's second: the story of a reply that hangs."""
    lost: list[Lost] = field(default_factory=list)
    """What it was told Redis lost (``LOSSES``), each time it was told."""
    resent: int = 0
    """Times a one-shot request was sent again (cut by a fault, or lost by Redis)."""
    began_s: float = -1.0
    """When what it reads began: its session's first turn, or the record itself."""
    params: dict[str, Any] = field(default_factory=dict)
    """Sampling parameters its request sends besides ``max_tokens`` (``temperature``)."""

    def __post_init__(self) -> None:
        if self.began_s < 0:
            self.began_s = self.started_s

    def step(self, at_s: float, what: str) -> None:
        self.trail.append(f"{at_s:.1f} {what}")

    def told_lost(self, at_s: float, what: str, since_s: float, via: str) -> None:
        self.lost.append(Lost(round(at_s, 2), what, round(since_s, 2), via))
        self.step(at_s, f"told lost: {what} ({via})")

    def start_again(self) -> None:
        """Forget the answer so far: the request is sent again (a one-shot API's resume)."""
        self.events, self.text, self.final, self.final_data = [], "", None, {}
        self.usage_told, self.generation_id = None, None


@dataclass(frozen=True)
class Lost:
    """A client told that Redis lost what it was reading: ``what`` (a code of ``LOSSES``)
    at ``at_s``, on a connection or request it had since ``since_s``, by the gateway at
    ``via``."""

    at_s: float
    what: str
    since_s: float
    via: str


class Retry(Exception):
    """Refused before anything started (429/503 with a hint, or no gateway answered)."""

    def __init__(self, after_s: float) -> None:
        super().__init__(after_s)
        self.after_s = after_s


class Context:
    """What every client shares: the run's clock, the gateways, one HTTP client."""

    def __init__(
        self,
        urls: list[str],
        clock: Callable[[], float],
        grpc: dict[str, str] | None = None,
        redis_away_s: Callable[[float, float], float] = lambda from_s, to_s: 0.0,
    ) -> None:
        self.urls = urls
        self.grpc = grpc or {}
        """A gateway's URL -> its gRPC server's ``host:port``."""
        self.clock = clock
        self.redis_away_s = redis_away_s
        """How long Redis took no writes between two times of ``clock`` (a fault's doing:
        refusals then are what the gateways should answer)."""
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(READ_TIMEOUT_S, connect=3.0),
            limits=httpx.Limits(max_connections=400, max_keepalive_connections=100),
            cookies=CookieJar(DefaultCookiePolicy(allowed_domains=[])),
        )
        """Keeps no cookie: the clients are many API programs sharing one HTTP client, no
        browser. The session API's owner cookie makes its holder one browser, whose
        conversations are bounded (``TOKENSPOUT_MAX_CONVERSATIONS``, 409 past them)."""
        self.open: dict[str, Record] = {}
        """Replies under way, by label: what a reply that hangs had got so far."""
        self.finished: list[tuple[str, str, str]] = []
        """(session id, token, generation id) of ended replies: the hostile bursts cancel
        them again."""

    def track(self, record: Record) -> Record:
        self.open[record.label] = record
        return record

    def other(self, rng: random.Random, not_this: str | None = None) -> str:
        choices = [u for u in self.urls if u != not_this] or self.urls
        return rng.choice(choices)

    async def close(self) -> None:
        await self.http.aclose()


def error_code(answer: dict[str, Any]) -> str | None:
    """The ``code`` of an OpenAI-format error object, if ``answer`` is one."""
    error = answer.get("error")
    return error.get("code") if isinstance(error, dict) else None


def _code_of(response: httpx.Response) -> str | None:
    try:
        answer = response.json()
    except ValueError:
        return None
    return error_code(answer) if isinstance(answer, dict) else None


def rate_limited(record: Record, what: str) -> None:
    """A refusal by the key's limits: expected of a key with limits, waited out."""
    record.rate_limited += 1
    if not record.key.limits:
        name = record.key.name
        record.problems.append(f"refused by the limits of {name}, which has none: {what}")


def usage_of(answer: Any) -> dict[str, int] | None:
    """``{"prompt_tokens", "completion_tokens"}`` of a usage object in any API's spelling
    (a session event's, OpenAI's, the Responses API's ``input_tokens``/``output_tokens``)."""
    if not isinstance(answer, dict):
        return None
    prompt = answer.get("prompt_tokens", answer.get("input_tokens"))
    completion = answer.get("completion_tokens", answer.get("output_tokens"))
    if prompt is None or completion is None:
        return None
    return {"prompt_tokens": int(prompt), "completion_tokens": int(completion)}


def refusal(response: httpx.Response, record: Record) -> None:
    """Raise ``Retry`` for a documented refusal, note anything else 5xx as a problem."""
    status = response.status_code
    if status in (429, 503):
        hint = response.headers.get("retry-after")
        if hint is None:
            record.problems.append(f"{status} without Retry-After: {response.text[:200]}")
        if status == 429 and _code_of(response) == RATE_LIMITED:
            rate_limited(record, response.text[:200])
        raise Retry(min(float(hint or 1), 2.0))
    if status >= 500:
        record.problems.append(f"{status}: {response.text[:200]}")


async def with_retries(
    ctx: Context, rng: random.Random, record: Record, attempt: Callable[[str], Any]
) -> Any:
    """``attempt(base_url)`` on a random replica until it is not refused, for 30 s at most
    from the first refusal, not counting the time Redis took no writes (a failover with no
    primary yet, a restart, a pause: refused then as it should be) nor the waits after a
    refusal by the key's own limits (its other clients hold its slots: the product's
    promise is the limit, not which of them gets the next slot); the time an attempt was
    answered in does not count either: a reply slowed by faults is the run's 90 s bound's
    to judge."""
    first_refused_s: float | None = None
    limited_s = 0.0
    url = ctx.other(rng)
    while True:
        limited_before, sent_s = record.rate_limited, ctx.clock()
        try:
            return await attempt(url)
        except Retry as retry:
            wait = retry.after_s
            record.step(ctx.clock(), f"{url} refused, retry after {wait} s")
        except httpx.TransportError as exc:
            wait = 0.2
            record.step(ctx.clock(), f"{url} {type(exc).__name__}")
        now_s = ctx.clock()
        limited = record.rate_limited > limited_before
        if limited:  # the whole attempt: a limit's answer may come late under faults
            limited_s += now_s - sent_s
        first_refused_s = now_s if first_refused_s is None else first_refused_s
        refused_s = now_s - first_refused_s - limited_s
        if refused_s - ctx.redis_away_s(first_refused_s, now_s) > REFUSED_FOR_S:
            raise TimeoutError(f"refused for {REFUSED_FOR_S:.0f} s while Redis took writes")
        record.retries += 1
        pause = wait * rng.uniform(0.5, 1.0)
        if limited:
            limited_s += pause
        await asyncio.sleep(pause)
        url = ctx.other(rng, url)


def words(rng: random.Random, label: str) -> str:
    return " ".join([label, *rng.sample(WORDS, rng.randint(1, 5))])


# --- the session API over SSE ------------------------------------------------------------


async def create_session(ctx: Context, rng: random.Random, record: Record) -> tuple[str, str]:
    async def attempt(url: str) -> tuple[str, str]:
        response = await ctx.http.post(
            f"{url}/v1/sessions", json={"model": record.model}, headers=record.key.bearer
        )
        refusal(response, record)
        if response.status_code != 201:
            raise RuntimeError(f"create session: {response.status_code} {response.text[:300]}")
        body = response.json()
        return body["session_id"], body["token"]

    created: tuple[str, str] = await with_retries(ctx, rng, record, attempt)
    return created


class SessionGone(Exception):
    """404 ``unknown_session``: Redis lost the session (a Redis back without its data)."""


def lost_code(response: httpx.Response) -> str | None:
    """The code of a 404 or 410 that says Redis lost what was asked for (``LOSSES``)."""
    if response.status_code not in (404, 410):
        return None
    code = _code_of(response)
    return code if code in LOSSES else None


async def send_message(
    ctx: Context, rng: random.Random, record: Record, session: tuple[str, str]
) -> str:
    """Send the record's turn; ``SessionGone`` when Redis lost the session (told)."""
    sid, token = session
    headers = {"X-Session-Token": token, "Idempotency-Key": secrets.token_hex(8)}
    body = {"content": record.content, "max_tokens": record.max_tokens, **record.params}

    async def attempt(url: str) -> str:
        since = ctx.clock()
        response = await ctx.http.post(
            f"{url}/v1/sessions/{sid}/messages", json=body, headers=headers
        )
        refusal(response, record)
        if code := lost_code(response):
            record.told_lost(ctx.clock(), code, since, url)
            record.final = "lost"
            raise SessionGone(code)
        if response.status_code == 409 and _code_of(response) == GENERATION_RUNNING:
            # The turn before ended for this client but Redis lost its end (a crash): the
            # worker writes it again once Redis is back (docs/reliability.md). Told of a
            # loss, so the checker asks for one before it; sent again after Retry-After.
            record.told_lost(ctx.clock(), GENERATION_RUNNING, since, url)
            raise Retry(min(float(response.headers.get("retry-after") or 1), 2.0))
        if response.status_code != 202:
            raise RuntimeError(f"send: {response.status_code} {response.text[:200]}")
        return str(response.json()["generation_id"])

    gid: str = await with_retries(ctx, rng, record, attempt)
    return gid


class SessionStream:
    """One session's SSE stream as a client follows one generation on it: what it read,
    where to resume, and what it was told Redis lost. After ``events_lost`` the stream
    starts over from the session's first event kept, so what the client had read of the
    session (``view``: the session's records, every turn) is forgotten and read again."""

    def __init__(
        self,
        ctx: Context,
        record: Record,
        view: list[Record],
        on_token: Callable[[int], Any] | None,
    ) -> None:
        self.ctx, self.record, self.view, self.on_token = ctx, record, view, on_token
        self.tokens = 0
        self.since = ctx.clock()
        self.url = ""
        """The gateway the stream is read from now."""

    async def take(self, event: str, payload: dict[str, Any]) -> bool:
        """One event read; True when the record's generation has ended."""
        record = self.record
        if event == "events_lost":
            record.told_lost(self.ctx.clock(), event, self.since, self.url)
            for turn in self.view:
                turn.events.clear()
            record.text, self.tokens = "", 0
            return False
        gid = payload.get("generation_id")
        if gid is None and event == "error":  # the stream's own: session_lost
            self.ended("lost", payload.get("error") or payload)
            return True
        if gid != record.generation_id:
            return False
        if event == "token":
            record.text += payload["text"]
            self.tokens += 1
            if self.on_token is not None:
                await self.on_token(self.tokens)
        elif event in SESSION_FINALS:
            self.ended(event, payload)
            record.usage_told = usage_of(payload.get("usage"))
            return True
        return False

    def ended(self, final: str, payload: dict[str, Any]) -> None:
        self.record.final, self.record.final_data = final, payload
        if payload.get("code") in LOSSES:
            self.record.told_lost(self.ctx.clock(), str(payload["code"]), self.since, self.url)


async def follow_session(
    ctx: Context,
    rng: random.Random,
    record: Record,
    after: str | None,
    *,
    drop_every: int | None,
    slow: bool,
    on_token: Callable[[int], Any] | None = None,
    view: list[Record] | None = None,
) -> None:
    """Read the session's stream from ``after`` until ``record.generation_id`` ends,
    dropping the stream every ``drop_every`` events (about) and whenever it breaks, each
    time resuming with ``Last-Event-ID`` on a replica picked at random. A session Redis
    lost ends the record ``lost``."""
    assert record.session is not None and record.generation_id is not None
    sid, token = record.session
    stream = SessionStream(ctx, record, view or [record], on_token)
    url: str | None = None
    while record.final is None:
        url = ctx.other(rng, url)
        headers = {"X-Session-Token": token}
        if after:
            headers["Last-Event-ID"] = after
        read, stream.since, stream.url = 0, ctx.clock(), url
        budget = rng.randint(1, 2 * drop_every) if drop_every else None
        try:
            async with ctx.http.stream(
                "GET", f"{url}/v1/sessions/{sid}/events", headers=headers
            ) as response:
                if response.status_code != 200:
                    body = await response.aread()  # before ``refusal`` reads its text
                    refusal(response, record)
                    if code := lost_code(response):
                        stream.ended("lost", {"code": code})
                        return
                    raise RuntimeError(f"events: {response.status_code} {body!r}")
                async for event_id, event, data in sse_events(response):
                    payload = json.loads(data)
                    if event != "events_lost":
                        record.events.append((event_id, event, payload))
                    after = event_id if event == "events_lost" else event_id or after
                    read += 1
                    if await stream.take(event, payload):
                        return
                    if slow:
                        await asyncio.sleep(rng.uniform(0.01, 0.08))
                    if budget is not None and read >= budget:
                        break
        except Retry as retry:
            record.step(ctx.clock(), f"events {url} refused")
            await asyncio.sleep(retry.after_s)
        except BROKEN as exc:
            record.step(ctx.clock(), f"events {url} {type(exc).__name__}")
            await asyncio.sleep(rng.uniform(0.05, 0.3))
        record.reconnects += 1


async def session_reader(
    ctx: Context, rng: random.Random, label: str, model: str, key: ApiKey, slow: bool
) -> list[Record]:
    """One session, 1 to 3 turns, each read with drops and resumes across replicas; one turn
    in 20 asks the engine to fail after some of its tokens (an error that bills them)."""
    records: list[Record] = []
    session: tuple[str, str] | None = None
    after: str | None = None
    for turn in range(rng.randint(1, 3)):
        kind = "sse_slow" if slow else "sse"
        record = Record(
            kind, f"{label}.{turn}", model, words(rng, label), rng.randint(10, 60), ctx.clock(), key
        )
        if rng.random() < FAILING_SHARE:
            record.fails_after = rng.randint(1, record.max_tokens - 1)
            record.content += f" [[fail:{record.fails_after}]]"
        record.began_s = records[0].started_s if records else record.started_s
        records.append(ctx.track(record))
        session = session or await create_session(ctx, rng, record)
        record.session = session
        try:
            record.generation_id = await send_message(ctx, rng, record, session)
        except SessionGone:
            break
        await follow_session(
            ctx,
            rng,
            record,
            after,
            drop_every=rng.choice([None, 4, 15]),
            slow=slow,
            view=records,
        )
        after = record.events[-1][0] if record.events else after
        ctx.finished.append((*session, record.generation_id))
        if record.final != "done":
            break
    return records


# --- WebSocket: generate, then cancel ----------------------------------------------------


async def ws_canceller(
    ctx: Context, rng: random.Random, label: str, model: str, key: ApiKey
) -> Record:
    """``generate`` on a socket, ``cancel`` after a random count of tokens (sometimes past
    the end: then ``done`` is the right answer); a broken socket goes on over SSE."""
    max_tokens = rng.randint(10, 60)
    record = ctx.track(
        Record("ws_cancel", label, model, words(rng, label), max_tokens, ctx.clock(), key)
    )
    record.cancel_after = rng.randint(1, max_tokens + 10)
    record.session = await create_session(ctx, rng, record)
    sid, token = record.session
    url = ctx.other(rng)
    record.step(ctx.clock(), f"socket {url}")
    since = ctx.clock()
    try:
        async with connect(url.replace("http://", "ws://") + "/v1/ws", open_timeout=5) as ws:
            await ws.send(
                json.dumps(
                    {
                        "type": "generate",
                        "id": "g",
                        "content": record.content,
                        "max_tokens": max_tokens,
                        "session_id": sid,
                        "token": token,
                    }
                )
            )
            tokens = 0
            while True:
                frame = json.loads(await asyncio.wait_for(ws.recv(), READ_TIMEOUT_S))
                kind = frame["type"]
                if kind == "error" and "event_id" not in frame:
                    code = frame.get("code")
                    if code in RETRYABLE_CODES:
                        if "retry_after_s" not in frame:
                            record.problems.append(f"refused without retry_after_s: {frame}")
                        if code == RATE_LIMITED:
                            rate_limited(record, str(frame)[:200])
                        raise Retry(float(frame.get("retry_after_s") or 1))
                    if code in LOSSES:  # the session Redis lost
                        record.told_lost(ctx.clock(), str(code), since, url)
                        record.final, record.final_data = "lost", frame
                        return record
                    record.problems.append(f"refused: {frame}")
                    return record
                if kind == "ack" and frame["op"] == "generate":
                    record.generation_id = frame["generation_id"]
                if kind == "events_lost":  # the generation's frames start over (docs/api.md)
                    record.told_lost(ctx.clock(), kind, since, url)
                    record.text = ""
                if kind == "token":
                    record.text += frame["text"]
                    tokens = frame["count"]
                    if not record.cancel_sent and tokens >= record.cancel_after:
                        record.cancel_sent = True
                        await ws.send(json.dumps({"type": "cancel", "id": "g"}))
                elif kind in SESSION_FINALS and "event_id" in frame:
                    record.final, record.final_data = kind, frame
                    record.usage_told = usage_of(frame.get("usage"))
                    if frame.get("code") in LOSSES:
                        record.told_lost(ctx.clock(), str(frame["code"]), since, url)
                    # A short look for frames of this generation after its final one.
                    await ws.send(json.dumps({"type": "ping", "id": "after"}))
                    while (pong := json.loads(await asyncio.wait_for(ws.recv(), 10)))[
                        "type"
                    ] != "pong":
                        if pong.get("id") == "g" and pong["type"] == "token":
                            record.tokens_after_final += 1
                    break
    except (Retry, *BROKEN) as exc:
        record.step(ctx.clock(), f"socket {url} {type(exc).__name__}")
        record.reconnects += 1
    if record.final is None:
        await _finish_over_sse(ctx, rng, record)
    return record


async def _finish_over_sse(ctx: Context, rng: random.Random, record: Record) -> None:
    """The socket broke: find the generation on the session stream (a socket that broke
    before its ``ack`` may or may not have queued it), cancel it over HTTP when due, and
    read it to its end."""
    assert record.session is not None
    try:
        if record.generation_id is None:
            record.generation_id = await _queued_generation(ctx, rng, record)
        if record.generation_id is None:  # never queued: send it over HTTP instead
            record.generation_id = await send_message(ctx, rng, record, record.session)
    except SessionGone:
        return

    async def cancel_when_due(tokens: int) -> None:
        if (
            not record.cancel_sent
            and record.cancel_after is not None
            and tokens >= record.cancel_after
        ):
            record.cancel_sent = True
            await cancel_over_http(ctx, rng, record)

    record.text = ""  # the session's stream from its start: this generation whole
    record.events.clear()
    await follow_session(
        ctx, rng, record, None, drop_every=None, slow=False, on_token=cancel_when_due
    )


async def _queued_generation(ctx: Context, rng: random.Random, record: Record) -> str | None:
    """The generation the session's stream shows, if any (its ``queued`` event is written
    with the request, so a stream with none has none)."""
    assert record.session is not None
    sid, token = record.session
    deadline = time.monotonic() + 30  # both gateways may be down a while, or Redis away
    while time.monotonic() < deadline:
        url = ctx.other(rng)
        record.step(ctx.clock(), f"looking for the generation at {url}")
        since = ctx.clock()
        try:
            async with ctx.http.stream(
                "GET", f"{url}/v1/sessions/{sid}/events", headers={"X-Session-Token": token}
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                if code := lost_code(response):
                    record.told_lost(ctx.clock(), code, since, url)
                    record.final = "lost"
                    raise SessionGone(code)
                if response.status_code != 200:
                    record.step(ctx.clock(), f"{response.status_code}")
                    await asyncio.sleep(0.5)
                    continue
                async with asyncio.timeout(2):
                    async for _id, event, data in sse_events(response):
                        payload = json.loads(data)
                        if "generation_id" not in payload:  # the stream's own: a loss
                            code = str(error_code(payload) or event)  # session_lost ...
                            record.told_lost(ctx.clock(), code, since, url)
                            record.final = "lost"
                            raise SessionGone(code)
                        return str(payload["generation_id"])
        except TimeoutError:
            record.step(ctx.clock(), "no generation on the stream")
            return None
        except BROKEN as exc:
            record.step(ctx.clock(), f"{type(exc).__name__}")
            await asyncio.sleep(0.3)
    raise RuntimeError("the session stream did not answer for 30 s")


async def cancel_over_http(ctx: Context, rng: random.Random, record: Record) -> None:
    assert record.session is not None and record.generation_id is not None
    sid, token = record.session

    async def attempt(url: str) -> None:
        since = ctx.clock()
        response = await ctx.http.post(
            f"{url}/v1/sessions/{sid}/generations/{record.generation_id}/cancel",
            headers={"X-Session-Token": token},
        )
        refusal(response, record)
        if code := lost_code(response):  # Redis lost the session: told, as its stream will
            record.told_lost(ctx.clock(), code, since, url)
        elif response.status_code != 200:
            record.problems.append(f"cancel: {response.status_code} {response.text[:200]}")

    await with_retries(ctx, rng, record, attempt)
