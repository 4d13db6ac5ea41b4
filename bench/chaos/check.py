"""The checker of a chaos run: every reply's whole history against what the synthetic
engine answers (its own script, engine/backends/synthetic.py), and against the session's
stream read again from its start once the faults have stopped.

Each rule returns what it found wrong as sentences; an empty list is a clean reply."""

from __future__ import annotations

import itertools
import json
from typing import Any

from bench.chaos.clients import ENGINE_ERROR, RESPONSE_FINALS, SESSION_FINALS, Context, Record
from bench.loadgen import sse_events
from engine.backends.synthetic import scripted_reply


def oracle(record: Record) -> str:
    return "".join(token.text for token in scripted_reply(record.content, record.max_tokens))


def stream_key(event_id: str) -> tuple[int, int]:
    milliseconds, _, sequence = event_id.partition("-")
    return int(milliseconds), int(sequence or 0)


def session_events(records: list[Record]) -> list[str]:
    """One session's events as its client read them, across turns and reconnects: ids
    strictly increasing, each generation's tokens counted 1, 2, 3... with no gap, exactly
    one final event per generation and nothing of it after that."""
    found: list[str] = []
    events = [event for record in records for event in record.events]
    ids = [stream_key(event_id) for event_id, _, _ in events]
    for before, after in itertools.pairwise(ids):
        if after <= before:
            found.append(f"event ids not increasing: {before} then {after}")
            break
    for record in records:
        mine = [
            (e, d) for _, e, d in record.events if d.get("generation_id") == record.generation_id
        ]
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
            return [
                f"{record.label}: text differs from the engine's script: "
                f"{record.text[:80]!r}... vs {expected[:80]!r}..."
            ]
        return []
    if not expected.startswith(record.text):
        return [f"{record.label}: text is not a prefix of the script: {record.text[:80]!r}"]
    return [f"{record.label}: ended {record.final}: {json.dumps(record.final_data)[:300]}"]


def check_session_reply(record: Record) -> list[str]:
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
    if record.final == "cancelled":
        if not record.cancel_sent:
            found.append(f"{record.label}: cancelled, but no cancel was sent")
        if not oracle(record).startswith(record.text):
            found.append(f"{record.label}: cancelled text is not a prefix of the script")
        return found
    return found + reply_text(record, ("done",))


def check_openai(record: Record) -> list[str]:
    if record.interrupted:
        return []
    found = reply_text(record, ("length",))
    if record.kind == "openai_stream" and record.final is not None and record.events:
        done = [e for _, e, _ in record.events if e == "[DONE]"]
        if len(done) != 1 or record.events[-1][1] != "[DONE]":
            found.append(f"{record.label}: {len(done)} [DONE] markers, last {record.events[-1][1]}")
    return found


def check_responses(record: Record) -> list[str]:
    if record.interrupted:
        return []
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


CHECKS = {
    "sse": check_session_reply,
    "sse_slow": check_session_reply,
    "ws_cancel": check_ws_cancel,
    "openai_stream": check_openai,
    "openai_whole": check_openai,
    "responses": check_responses,
}


def check(record: Record) -> list[str]:
    found = [f"{record.label}: {problem}" for problem in record.problems]
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
