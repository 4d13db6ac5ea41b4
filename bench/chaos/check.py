"""The checker of a chaos run: every reply's whole history against what the synthetic
engine answers (its own script, engine/backends/synthetic.py), and against the session's
stream read again from its start once the faults have stopped.

What a fault may cost is the rule: a reply must come whole, unless Redis lost writes (a
fault of ``LOSES_WRITES``: a crash, a wipe, a failover) while its session or request
lived. Then, and only then, its client may be told so, in one of the ways its API
documents (``LOSSES``: ``events_lost``, ``session_lost``, a 404 with its code), within
``TOLD_WITHIN_S`` of Redis answering again (of its gateway reaching Redis again, and the
worker writing its reply being back, where a partition or a stop held them longer; of the
client's connection, if later). A reply that
ends any other way, is told of a loss no fault explains, or is told late, is an anomaly;
one that is never told hangs (the run's bound).

Each rule returns what it found wrong as sentences; an empty list is a clean reply."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

from bench.chaos.adapters import RESPONSE_FINALS
from bench.chaos.clients import ENGINE_ERROR, LOSSES, SESSION_FINALS, Context, Lost, Record
from bench.chaos.fleet import Loss
from bench.loadgen import sse_events
from engine.backends.synthetic import scripted_reply


def oracle(record: Record) -> str:
    return "".join(token.text for token in scripted_reply(record.content, record.max_tokens))


def stream_key(event_id: str) -> tuple[int, int]:
    milliseconds, _, sequence = event_id.partition("-")
    return int(milliseconds), int(sequence or 0)


TOLD_WITHIN_S = 2.0
"""A client connected when Redis answers again is told of a loss within this
(docs/reliability.md)."""
BEFORE_S = 1.5
"""A fault that loses writes may lose those of the second before it (AOF ``everysec``):
a session or request begun that long before it lived through it."""


def session_events(records: list[Record]) -> list[str]:
    """One session's events as its client read them, across turns and reconnects (after an
    ``events_lost``, from the stream's start again): ids strictly increasing, each
    generation's tokens counted 1, 2, 3... with no gap, exactly one final event per
    generation and nothing of it after that."""
    found: list[str] = []
    events = [event for record in records for event in record.events]
    ids = [stream_key(event_id) for event_id, _, _ in events]
    for before, after in itertools.pairwise(ids):
        if after <= before:
            found.append(f"event ids not increasing: {before} then {after}")
            break
    for record in records:
        if record.final == "lost" and record.lost:
            continue  # its session is gone: what it read before is not read again
        mine = [(e, d) for _, e, d in events if d.get("generation_id") == record.generation_id]
        counts = [d["count"] for e, d in mine if e == "token"]
        if counts != list(range(1, len(counts) + 1)):  # one token per event: no join-tokens
            found.append(f"{record.label}: token counts with a gap or repeat: {counts}")
        finals = [e for e, _ in mine if e in SESSION_FINALS]
        if len(finals) != 1 or (mine and mine[-1][0] not in SESSION_FINALS):
            found.append(
                f"{record.label}: finals {finals}, last event {mine[-1][0] if mine else None}"
            )
    return found


def reply_text(record: Record, expected_kinds: tuple[str, ...]) -> list[str]:
    """A reply that ended normally has the whole scripted text; one that ended otherwise
    has a prefix of it, and a final of a kind the run explains."""
    expected = oracle(record)
    if record.final in expected_kinds:
        if record.text != expected:
            return [f"{record.label}: text differs from the engine's script: {where(record)}"]
        return []
    if not expected.startswith(record.text):
        return [f"{record.label}: text is not a prefix of the script: {record.text[:80]!r}"]
    return [f"{record.label}: ended {record.final}: {json.dumps(record.final_data)[:300]}"]


def where(record: Record) -> str:
    """Where a reply's text first leaves the script, with the generation to look for."""
    text, expected = record.text, oracle(record)
    at = next((i for i, (a, b) in enumerate(zip(text, expected, strict=False)) if a != b), None)
    at = min(len(text), len(expected)) if at is None else at
    return (
        f"generation {record.generation_id}, {len(text)} chars against {len(expected)}, "
        f"first apart at {at}: {text[max(0, at - 30) : at + 50]!r} vs "
        f"{expected[max(0, at - 30) : at + 50]!r}"
    )


def told_lost(record: Record) -> bool:
    """It ended the way a client is told Redis lost its reply (``check_losses`` judges
    whether a loss explains it)."""
    return bool(record.lost) and (record.final == "lost" or record.final_data.get("code") in LOSSES)


def causes_of(record: Record, lost: Lost, losses: list[Loss]) -> list[Loss]:
    """The faults that lost writes while ``record``'s session (or request) lived, before
    it was told ``lost``."""
    return [loss for loss in losses if record.began_s - BEFORE_S <= loss.at_s <= lost.at_s]


HeldUntil = Callable[[str, float, float], float]
"""``held_until(url, from_s, to_s)``: when the last fault that held the gateway at
``url`` from Redis (or from its clients) in that time ended (bench/chaos/fleet.py)."""


def told_after_s(lost: Lost, cause: Loss, held_until: HeldUntil) -> float:
    """How long after Redis answered again the client was told: answered its gateway (a
    partition or a stop of that gateway may end later), on a connection the client had
    by then (or later)."""
    back = max(cause.back_s, held_until(lost.via, cause.at_s, lost.at_s))
    return lost.at_s - max(back, lost.since_s)


def check_losses(record: Record, losses: list[Loss], held_until: HeldUntil) -> list[str]:
    """Each time the client was told Redis lost its reply: a fault that loses writes came
    while its session (or request) lived, and the telling came in time."""
    found = []
    for lost in record.lost:
        causes = causes_of(record, lost, losses)
        if not causes:
            found.append(f"{record.label}: told {lost.what} at {lost.at_s} s, no loss before")
            continue
        late = told_after_s(lost, causes[-1], held_until)
        if late > TOLD_WITHIN_S:
            found.append(
                f"{record.label}: told {lost.what} {late:.1f} s after Redis answered again "
                f"({causes[-1].kind} at {causes[-1].at_s} s, back {causes[-1].back_s} s)"
            )
    return found


def check_session_reply(record: Record) -> list[str]:
    if told_lost(record):
        return []
    if record.fails_after is None:
        return reply_text(record, ("done",))
    # Asked to fail after some tokens: an engine error there, its text the script's first
    # tokens (whatever takeover came between).
    expected = "".join(t.text for t in scripted_reply(record.content, record.fails_after))
    code = record.final_data.get("code")
    if record.final == "error" and code == ENGINE_ERROR and record.text == expected:
        return []
    return [
        f"{record.label}: asked to fail after {record.fails_after} tokens, ended "
        f"{record.final} ({code}) with {record.text[:80]!r}"
    ]


def check_ws_cancel(record: Record) -> list[str]:
    found = (
        [f"{record.label}: {record.tokens_after_final} token frames after its final one"]
        if record.tokens_after_final
        else []
    )
    if told_lost(record):
        return found
    if record.final == "cancelled":
        if not record.cancel_sent:
            found.append(f"{record.label}: cancelled, but no cancel was sent")
        if not oracle(record).startswith(record.text):
            found.append(f"{record.label}: cancelled text is not a prefix of the script")
        return found
    return found + reply_text(record, ("done",))


def check_openai(record: Record) -> list[str]:
    found = reply_text(record, ("length",))
    if record.kind == "openai_stream" and record.final is not None and record.events:
        done = [e for _, e, _ in record.events if e == "[DONE]"]
        if len(done) != 1 or record.events[-1][1] != "[DONE]":
            found.append(f"{record.label}: {len(done)} [DONE] markers, last {record.events[-1][1]}")
    return found


def check_responses(record: Record) -> list[str]:
    # The synthetic engine never stops by itself: its replies run to max_output_tokens,
    # which the Responses API reports as incomplete for that reason.
    details = record.final_data.get("response", {}).get("incomplete_details") or {}
    whole = record.final == "response.incomplete" and details.get("reason") == "max_output_tokens"
    found = reply_text(record, ("response.incomplete",) if whole else ("response.completed",))
    numbers = [int(d["sequence_number"]) for _, _, d in record.events if "sequence_number" in d]
    if numbers and numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        found.append(f"{record.label}: sequence numbers with a gap or repeat: {numbers}")
    finals = [e for _, e, _ in record.events if e in RESPONSE_FINALS]
    if len(finals) != 1:
        found.append(f"{record.label}: {len(finals)} final events")
    return found


def check_stream(record: Record) -> list[str]:
    """TGI, OIP and gRPC: sent again until whole, so whole (``length``: the synthetic
    engine runs to ``max_tokens``; gRPC's final response carries no reason here)."""
    return reply_text(record, ("length", "end"))


CHECKS = {
    "sse": check_session_reply,
    "sse_slow": check_session_reply,
    "ws_cancel": check_ws_cancel,
    "openai_stream": check_openai,
    "openai_whole": check_openai,
    "responses": check_responses,
    "tgi": check_stream,
    "oip": check_stream,
    "grpc": check_stream,
}


def check(
    record: Record, losses: list[Loss] | None = None, held_until: HeldUntil | None = None
) -> list[str]:
    found = [f"{record.label}: {problem}" for problem in record.problems]
    found += check_losses(record, losses or [], held_until or (lambda *_: 0.0))
    return [f"[{record.kind}] {what}" for what in found + CHECKS[record.kind](record)]


async def reread_session(
    ctx: Context, session: tuple[str, str], last_gid: str
) -> list[tuple[str, str, dict[str, Any]]]:
    """The session's whole stream, from its first event to ``last_gid``'s final one."""
    sid, token = session
    events: list[tuple[str, str, dict[str, Any]]] = []
    async with ctx.http.stream(
        "GET", f"{ctx.urls[0]}/v1/sessions/{sid}/events", headers={"X-Session-Token": token}
    ) as response:
        response.raise_for_status()
        async for event_id, event, data in sse_events(response):
            payload = json.loads(data)
            events.append((event_id, event, payload))
            if event in SESSION_FINALS and payload.get("generation_id") == last_gid:
                return events
    raise RuntimeError("the session stream ended before its last reply's final event")


async def check_against_redis(ctx: Context, records: list[Record]) -> list[str]:
    """What the client read across reconnects equals the stream read once from its start:
    nothing lost, nothing repeated, nothing changed (SSE clients, which read it all)."""
    complete = [r for r in records if r.kind in ("sse", "sse_slow")]
    if not complete or complete[-1].generation_id is None or complete[-1].session is None:
        return []
    if any(record.lost for record in complete):
        return session_events(complete)  # Redis no longer holds what the client read
    seen = [(event_id, event, data) for r in complete for event_id, event, data in r.events]
    whole = await reread_session(ctx, complete[-1].session, complete[-1].generation_id)
    if seen != whole:
        first = next(
            (i for i, (a, b) in enumerate(zip(seen, whole, strict=False)) if a != b),
            min(len(seen), len(whole)),
        )
        return [
            f"{complete[-1].label}: read {len(seen)} events, Redis holds {len(whole)}; "
            f"first difference at {first}: {seen[first : first + 1]} vs {whole[first : first + 1]}"
        ]
    return session_events(complete)


async def check_ws_against_redis(ctx: Context, record: Record) -> list[str]:
    """A WebSocket reply's text is the generation's tokens as Redis holds them."""
    if record.session is None or record.generation_id is None or record.final is None:
        return []
    if record.lost:
        return []  # Redis no longer holds what the client read
    whole = await reread_session(ctx, record.session, record.generation_id)
    text = "".join(
        d["text"]
        for _, e, d in whole
        if e == "token" and d["generation_id"] == record.generation_id
    )
    if text != record.text:
        return [
            f"{record.label}: the socket gave {record.text[:60]!r}..., Redis holds {text[:60]!r}..."
        ]
    return []
