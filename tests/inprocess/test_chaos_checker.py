"""The chaos run's checker (bench/chaos/check.py) finds each kind of broken history: a
clean reply passes, and each way a reply can go wrong is named. Without this, a chaos run
with no anomaly would prove nothing."""

from __future__ import annotations

from typing import Any

from bench.chaos.adapters import response_error_code
from bench.chaos.check import check, oracle, session_events
from bench.chaos.clients import Lost, Record
from bench.chaos.fleet import Fault, Loss, redis_away_s
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


CRASH = Loss(at_s=10.0, back_s=11.0, kind="redis_crash")


def lost_record(what: str, at_s: float, since_s: float = 5.0, **changes: Any) -> Record:
    """A session reply whose client was told at ``at_s`` that Redis lost it (a session
    begun at 5 s)."""
    record = session_record(started_s=5.0, began_s=5.0, **changes)
    record.lost = [Lost(at_s, what, since_s, "http://127.0.0.1:1")]
    return record


def test_a_loss_told_after_a_fault_that_loses_writes_and_in_time_passes() -> None:
    for final, data in (("lost", {"code": "unknown_session"}), ("error", {"code": "events_lost"})):
        record = lost_record(str(data["code"]), 12.5, final=final, final_data=data)
        assert check(record, [CRASH]) == []


def test_a_loss_told_with_no_fault_that_loses_writes_is_named() -> None:
    record = lost_record("session_lost", 12.5, final="lost", final_data={"code": "session_lost"})
    assert any("no loss before" in problem for problem in check(record, []))
    begun_after = lost_record("session_lost", 30.0, final="lost")
    begun_after.began_s = 20.0  # its session began after the crash: not lost in it
    assert any("no loss before" in problem for problem in check(begun_after, [CRASH]))


def test_a_loss_told_late_is_named_unless_its_gateway_was_held_meanwhile() -> None:
    record = lost_record("session_lost", 14.0, final="lost")
    assert any("3.0 s after Redis answered" in p for p in check(record, [CRASH]))
    held = check(record, [CRASH], lambda url, start, end: 13.0)  # its gateway cut until 13 s
    assert held == []


def test_a_loss_is_no_excuse_for_a_reply_never_told_of_it() -> None:
    """A reply that ended otherwise than its script is named, loss or not."""
    record = session_record(final="error", final_data={"code": "worker_lost"})
    assert any("ended error" in problem for problem in check(record, [CRASH]))


def test_a_stream_read_again_after_events_lost_is_checked_from_its_new_start() -> None:
    """After ``events_lost`` the client forgets what it read and reads the session from
    its first kept event: what follows must be whole and numbered from 1 again."""
    record = session_record()
    record.lost = [Lost(12.0, "events_lost", 11.5, "")]
    assert session_events([record]) == [] and check(record, [CRASH]) == []


def test_the_streams_of_tgi_oip_and_grpc_must_be_whole() -> None:
    for kind, final in (("tgi", "length"), ("oip", "length"), ("grpc", "end")):
        whole = session_record(kind=kind, final=final)
        assert check(whole) == []
        cut = session_record(kind=kind, final=final, text=whole.text[:-3])
        assert any("differs from the engine's script" in p for p in check(cut)), kind


def test_a_failed_response_says_redis_lost_it_in_its_message() -> None:
    """A Responses stream Redis lost ends ``response.failed``, ``server_error``, the engine's
    code first in its message (docs/api.md): the client knows it as that loss (the
    ten-minute soak, seed 1, took one for a failure no fault explained); another engine
    failure stays a server error."""

    def failed(message: str) -> dict[str, Any]:
        error = {"code": "server_error", "message": message}
        return {"type": "response.failed", "response": {"status": "failed", "error": error}}

    assert response_error_code(failed("events_lost: Redis lost events")) == "events_lost"
    assert response_error_code(failed("engine_error: it broke")) == "server_error"
    assert response_error_code({"type": "error", "code": "events_lost"}) == "events_lost"


def test_the_time_redis_took_no_writes_counts_each_fault_once_and_only_redis_faults() -> None:
    """What a client's refusals are not held against (bench/chaos/clients.py
    ``with_retries``): a failover from its kill until Redis answered again (or until now
    while it has not), a pause or a full Redis for their length, overlaps once; a
    gateway's or a worker's fault never (the other gateway answers meanwhile)."""
    faults = [
        Fault(10.0, "sentinel_failover", "redis:1", back_s=16.0),
        Fault(14.0, "redis_pause", "redis", held_s=4.0),  # 14-18: overlaps the failover
        Fault(20.0, "gateway_stop", "gateway:1", held_s=5.0),
        Fault(30.0, "redis_full", "redis", held_s=1.5),
        Fault(40.0, "primary_kill", "redis:2"),  # not answered again yet
    ]
    assert redis_away_s(faults, 0.0, 35.0) == 6.0 + 2.0 + 1.5
    assert redis_away_s(faults, 12.0, 15.0) == 3.0
    assert redis_away_s(faults, 35.0, 43.0) == 3.0
    assert redis_away_s(faults, 20.0, 29.0) == 0.0
