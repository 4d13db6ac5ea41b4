"""The chaos run's checker (bench/chaos/check.py) finds each kind of broken history: a
clean reply passes, and each way a reply can go wrong is named. Without this, a chaos run
with no anomaly would prove nothing."""

from __future__ import annotations

from typing import Any

from bench.chaos.check import check, oracle, session_events
from bench.chaos.clients import Record
from bench.chaos.tenants import ApiKey
from engine.backends.synthetic import scripted_reply

CONTENT, MAX_TOKENS = "c1.0 tide lamp", 6
KEY = ApiKey("chaos-w1", "k_0123456789abcdef", "tsk_secret", 1.0)


def session_record(**changes: Any) -> Record:
    """A clean session reply as an SSE client reads it: queued, started, tokens, done."""
    record = Record("sse", "c1.0", "alpha", CONTENT, MAX_TOKENS, 0.0, KEY, generation_id="g1")
    tokens = scripted_reply(CONTENT, MAX_TOKENS)
    events = [
        ("1-0", "queued", {"generation_id": "g1"}),
        ("2-0", "started", {"generation_id": "g1"}),
    ]
    events += [
        (f"{3 + i}-0", "token", {"generation_id": "g1", "text": t.text, "count": i + 1})
        for i, t in enumerate(tokens)
    ]
    events.append((f"{3 + len(tokens)}-0", "done", {"generation_id": "g1"}))
    record.events = events
    record.text = "".join(t.text for t in tokens)
    record.final = "done"
    for name, value in changes.items():
        setattr(record, name, value)
    return record


def test_a_clean_session_reply_passes() -> None:
    record = session_record()
    assert check(record) == [] and session_events([record]) == []


def test_a_lost_token_is_named() -> None:
    record = session_record()
    del record.events[4]
    assert any("gap or repeat" in problem for problem in session_events([record]))


def test_a_repeated_event_is_named() -> None:
    record = session_record()
    record.events.insert(4, record.events[3])
    found = session_events([record])
    assert any("not increasing" in p for p in found) and any("gap or repeat" in p for p in found)


def test_changed_text_is_named() -> None:
    record = session_record(text=oracle(session_record()).replace("You", "Yuo"))
    assert any("differs from the engine's script" in problem for problem in check(record))


def test_an_event_after_the_final_one_is_named() -> None:
    record = session_record()
    record.events.append(("99-0", "token", {"generation_id": "g1", "text": " x", "count": 7}))
    assert any("last event token" in problem for problem in session_events([record]))


def test_a_reply_ending_in_error_is_named() -> None:
    record = session_record(final="error", final_data={"code": "worker_lost"})
    assert any("ended error" in problem for problem in check(record))


def test_a_token_after_cancelled_or_a_cancel_nobody_sent_is_named() -> None:
    record = session_record(kind="ws_cancel", final="cancelled", text="You", cancel_sent=True)
    assert check(record) == []
    record.tokens_after_final = 1
    assert any("after its final one" in problem for problem in check(record))
    record = session_record(kind="ws_cancel", final="cancelled", text="You", cancel_sent=False)
    assert any("no cancel was sent" in problem for problem in check(record))


def test_an_openai_stream_with_two_done_markers_is_named() -> None:
    clean = session_record(kind="openai_stream", final="length")
    clean.events = [("", "chunk", {}), ("", "[DONE]", {})]
    assert check(clean) == []
    clean.events.append(("", "[DONE]", {}))
    assert any("[DONE] markers" in problem for problem in check(clean))


def test_an_openai_stream_refused_before_its_first_event_is_named_without_a_crash() -> None:
    """A refusal other than 429/503 (a 4xx) leaves the stream with no event: the checker
    names its end (it raised IndexError on the events' last, and the run wrote no report)."""
    refused = session_record(kind="openai_stream", final="error", text="")
    refused.events, refused.final_data = [], {"error": {"code": "invalid_api_key"}}
    assert [p for p in check(refused) if "ended error" in p and "invalid_api_key" in p]


def test_a_responses_stream_with_a_sequence_gap_is_named() -> None:
    record = session_record(kind="responses", final="response.completed")
    record.events = [
        ("", "response.created", {"sequence_number": 0}),
        ("", "response.output_text.delta", {"sequence_number": 1}),
        ("", "response.completed", {"sequence_number": 2}),
    ]
    assert check(record) == []
    del record.events[1]
    assert any("sequence numbers" in problem for problem in check(record))


def test_what_a_client_noted_is_an_anomaly() -> None:
    record = session_record(problems=["500: internal error"])
    assert check(record) == ["[sse] c1.0: 500: internal error"]


def test_a_reply_asked_to_fail_must_end_in_that_error_after_its_tokens() -> None:
    """``[[fail:N]]``: an ``engine_error`` after exactly the script's first N tokens."""
    content = f"{CONTENT} [[fail:2]]"
    failed = session_record(content=content, fails_after=2, final="error")
    failed.final_data = {"code": "engine_error", "usage": {}}
    failed.text = "".join(t.text for t in scripted_reply(content, 2))
    assert check(failed) == []
    failed.text += "x"
    assert any("asked to fail after 2 tokens" in problem for problem in check(failed))
    whole = session_record(content=content, fails_after=2)  # ended done: wrong
    assert any("asked to fail after 2 tokens, ended done" in problem for problem in check(whole))
