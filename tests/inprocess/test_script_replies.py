"""wire/scripts.py decodes each Lua script's reply once into wire/outcomes.py's types: the
lists Redis answers (bytes and integers, as redis-py hands them over) and what they become.
The scripts themselves run against Redis in tests/test_engine_writes.py, test_sessions.py."""

from __future__ import annotations

import pytest

import wire
from wire import Cancelled, ChatMessage, Done, Usage
from wire import outcomes as script
from wire.scripts import cancel_reply, submit_reply, takeover_reply


@pytest.mark.parametrize(
    ("reply", "outcome"),
    [
        ([b"takeover", 2, b"w1"], script.TakenOver(takeovers=2, from_worker="w1")),
        ([b"queued", 0, b""], script.NotStarted(takeovers=0, from_worker="")),
        ([b"cancel", b"abandoned"], script.CancelAsked(reason="abandoned")),
        ([b"exhausted"], script.Exhausted()),
        ([b"final"], script.AlreadyFinal()),
        ([b"moved"], script.Moved()),
    ],
)
def test_takeover_replies(reply: list[object], outcome: script.TakeoverReply) -> None:
    assert takeover_reply(reply) == outcome


def test_submit_replies() -> None:
    history = [ChatMessage("user", "hi"), ChatMessage("assistant", "hello")]
    accepted = [b"ok", b"5-0", *(wire.encode(message) for message in history)]
    assert submit_reply(accepted) == script.Accepted("5-0", history)
    assert submit_reply([b"ok", b"5-0"]) == script.Accepted("5-0", [])
    assert submit_reply([b"missing"]) == script.SessionMissing()
    assert submit_reply([b"forbidden"]) == script.BadToken()
    assert submit_reply([b"duplicate", b"g_1"]) == script.Duplicate("g_1")
    assert submit_reply([b"busy", b"g_2"]) == script.Busy("g_2")
    assert submit_reply([b"history_full"]) == script.HistoryFull()


def test_cancel_replies() -> None:
    done = Done("g", "stop", Usage(3, 2))
    cancelled = Cancelled("g", "user", Usage(0, 0))
    assert cancel_reply([b"unknown"]) == script.UnknownGeneration()
    assert cancel_reply([b"final", b"done", wire.encode(done)]) == script.EndedBefore(done)
    queued_end = [b"cancelled", b"7-0", wire.encode(cancelled)]
    assert cancel_reply(queued_end) == script.CancelledQueued("7-0", cancelled)
    assert cancel_reply([b"signal", b"w1"]) == script.SignalWorker("w1")


@pytest.mark.parametrize("decode", [takeover_reply, submit_reply, cancel_reply])
def test_a_reply_no_decoder_knows_is_an_error_not_an_outcome(decode: object) -> None:
    assert callable(decode)
    with pytest.raises(script.ScriptReplyError):
        decode([b"something new", b"x"])
