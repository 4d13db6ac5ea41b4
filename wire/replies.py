"""Redis replies, read the same way on both sides: redis-py types them loosely.

Stream entry ids (``<ms>-<seq>``) are parsed here and nowhere else: ``entry_id_key`` sorts
them, ``entry_ms`` dates them, ``just_before`` steps one back.
"""

from __future__ import annotations

from typing import cast

StreamEntry = tuple[bytes, dict[bytes, bytes]]
MAX_SEQ = 18_446_744_073_709_551_615
"""The largest sequence number of a stream entry id (a 64-bit unsigned integer)."""


def text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def entry_id_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``<ms>-<seq>``) as a sortable pair; ValueError if it is none."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def entry_ms(entry_id: str) -> int:
    """When the entry was added (unix milliseconds: the id's first part)."""
    return entry_id_key(entry_id)[0]


def just_before(entry_id: str) -> str:
    """The stream id right before ``entry_id``: a read after it starts with that entry."""
    ms, seq = entry_id_key(entry_id)
    return f"{ms}-{seq - 1}" if seq > 0 else f"{ms - 1}-{MAX_SEQ}"


def entries_of(reply: object) -> list[StreamEntry]:
    """Entries of an XRANGE/XREVRANGE/XCLAIM reply."""
    return cast(list[StreamEntry], reply or [])


def read_entries(reply: object) -> list[StreamEntry]:
    """Entries of an XREAD/XREADGROUP reply, all streams together."""
    streams = cast(list[tuple[bytes, list[StreamEntry]]], reply or [])
    return [entry for _stream, entries in streams for entry in entries]
