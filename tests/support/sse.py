"""A strict Server-Sent Events parser for tests: it fails on anything malformed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any


@dataclass
class Event:
    event: str
    data: str
    id: str | None

    def json(self) -> Any:
        return json.loads(self.data)


class SSEParser:
    """Feed it lines; it returns events (comments and ``retry:`` are counted, not returned)."""

    def __init__(self) -> None:
        self.comments = 0
        self.retry: int | None = None
        self._event, self._data, self._id = "message", [], None  # type: ignore[var-annotated]

    def line(self, line: str) -> Event | None:
        if line == "":
            if not self._data:
                self._event, self._id = "message", None
                return None
            event = Event(self._event, "\n".join(self._data), self._id)
            self._event, self._data, self._id = "message", [], None
            return event
        if line.startswith(":"):
            self.comments += 1
            return None
        field, sep, value = line.partition(":")
        assert sep, f"not an SSE line: {line!r}"
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id":
            self._id = value
        elif field == "retry":
            self.retry = int(value)
        else:
            raise AssertionError(f"unknown SSE field {field!r}")
        return None


async def parse(lines: AsyncIterator[str], parser: SSEParser | None = None) -> AsyncIterator[Event]:
    parser = parser or SSEParser()
    async for line in lines:
        event = parser.line(line)
        if event is not None:
            yield event
