"""The Lua scripts that keep a session's event stream consistent (the files in wire/lua/).

A live message on ``Keys.live_channel`` is "<entry id> <type> <generation id> <json>", the
same event the stream holds, so a live reader needs no second round trip.
"""

from __future__ import annotations

from importlib.resources import files

_LUA = files("wire") / "lua"


def _source(name: str) -> str:
    return (_LUA / f"{name}.lua").read_text(encoding="utf-8")


EMIT_CORE = _source("emit_core")
"""Lua functions `emit` (append an event and publish it) and `finish` (end a generation)."""

EMIT_SCRIPT = EMIT_CORE + _source("emit")
TAKEOVER_SCRIPT = _source("takeover")
SUBMIT_SCRIPT = EMIT_CORE + _source("submit")
CANCEL_SCRIPT = EMIT_CORE + _source("cancel")
END_QUEUED_SCRIPT = EMIT_CORE + _source("end_queued")
