"""Function calls out of what the model writes: a reply's content and ``tool_calls`` deltas.

What a ``ToolCallWriter`` emits is a function of the whole text the model wrote so far and
nothing else, so a worker that takes a reply over (``GenerationRequest.resume``) starts a
writer with the text already streamed and goes on exactly where the lost worker stopped:
no call repeated, no argument lost, the same call ids.

- ``named`` (``tool_choice`` names a function): the engine is constrained to the function's
  parameters schema (the gateway set it), so everything written is the arguments, streamed
  as they come.
- ``required``: the engine is constrained to a JSON array of ``{"name", "parameters"}``
  objects, one per call (the gateway set that schema too); each call goes out whole as soon
  as its object is complete.
- ``auto``: the model writes content and, in its own format, calls; the worker's tool
  parser (``--tool-call-parser``, one of vLLM's) finds them. Content streams until the
  parser's start marker (text that may be the start of one is held back); the calls go
  out when the reply ends, as vLLM's non-streaming parsers find them.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from engine.backends.base import AutoParser
from wire import ToolCallDelta, Tools

log = logging.getLogger("tokenspout.tools")


def call_id(generation_id: str, index: int) -> str:
    """The same id for the same call of a reply, whichever worker makes it."""
    return f"call_{generation_id.removeprefix('g_')[:16]}_{index}"


class ToolCallWriter:
    def __init__(
        self,
        tools: Tools,
        generation_id: str,
        parser: AutoParser | None,
        written: str = "",
    ) -> None:
        self.tools = tools
        self.generation_id = generation_id
        self.parser = parser
        self.written = written
        """What the model wrote so far (what was streamed before a takeover included)."""
        self.calls = 0
        """Calls sent so far."""
        if tools.choice == "required":
            self.calls = len(complete_items(written))
        elif tools.choice == "named":
            self.calls = 1 if written else 0

    def step(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta] | None]:
        """The content and call deltas of the model's next ``text``; ``final``: it is the
        reply's last."""
        before, self.written = self.written, self.written + text
        match self.tools.choice:
            case "named":
                return "", self._named(text)
            case "required":
                return "", self._required()
            case _:
                return self._auto(before, final)

    def made_calls(self) -> bool:
        return self.calls > 0

    def _named(self, text: str) -> list[ToolCallDelta] | None:
        if not text:
            return None
        if self.calls == 0:
            self.calls = 1
            return [ToolCallDelta(0, text, call_id(self.generation_id, 0), self.tools.name or "")]
        return [ToolCallDelta(0, text)]

    def _required(self) -> list[ToolCallDelta] | None:
        items = complete_items(self.written)
        deltas = []
        for index in range(self.calls, len(items)):
            item = items[index]
            arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
            deltas.append(
                ToolCallDelta(
                    index, arguments, call_id(self.generation_id, index), str(item.get("name"))
                )
            )
        self.calls = len(items)
        return deltas or None

    def _auto(self, before: str, final: bool) -> tuple[str, list[ToolCallDelta] | None]:
        marker = self.parser.start_marker if self.parser is not None else None
        sent = visible(before, marker)
        if not final:
            return visible(self.written, marker)[len(sent) :], None
        if self.parser is None:
            return self.written[len(sent) :], None
        content, calls = self.parser.parse(self.written)
        rest = content[len(sent) :] if content.startswith(sent) else ""
        deltas = [
            ToolCallDelta(index, call.arguments, call_id(self.generation_id, index), call.name)
            for index, call in enumerate(calls)
        ]
        self.calls = len(deltas)
        return rest, deltas or None


def visible(text: str, marker: str | None) -> str:
    """The part of ``text`` that is surely content: before the first ``marker``, less a
    tail that could be the beginning of one (all of it when the marker is unknown)."""
    if marker is None:
        return ""
    at = text.find(marker)
    if at >= 0:
        return text[:at]
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return text[: len(text) - size]
    return text


def complete_items(text: str) -> list[dict[str, Any]]:
    """The objects of a JSON array (``required``'s output) that are complete in ``text``,
    which may stop anywhere."""
    decoder = json.JSONDecoder()
    at = text.find("[")
    if at < 0:
        return []
    items: list[dict[str, Any]] = []
    at += 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return items
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return items  # not complete yet
        if isinstance(item, dict):
            items.append(item)
