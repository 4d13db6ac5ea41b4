"""The Responses API as the tests read it: the ``openai`` SDK's client of a gateway, its
events as dicts, OpenAI's order of a text response's events, and a response's end."""

from __future__ import annotations

import asyncio
from typing import Any

import openai

ITEM_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]


def client_of(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def dumped(events: list[Any]) -> list[dict[str, Any]]:
    return [event.model_dump(exclude_unset=True) for event in events]


def check_order(events: list[dict[str, Any]], final: str, text: str) -> None:
    """OpenAI's order: the opening four, deltas, the three closing ones, one final event;
    ``sequence_number`` 0, 1, 2, ..."""
    kinds = [event["type"] for event in events]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert kinds[:4] == ITEM_EVENTS
    deltas = kinds[4:-4]
    assert deltas and set(deltas) == {"response.output_text.delta"}
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        final,
    ]
    assert "".join(event["delta"] for event in events[4:-4]) == text
    assert events[-4]["text"] == text
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == text


async def ended(client: openai.AsyncOpenAI, rid: str) -> Any:
    """The response once it has ended, polled without reading its stream (no reader)."""
    async with asyncio.timeout(60):
        while (response := await client.responses.retrieve(rid)).status in (
            "queued",
            "in_progress",
        ):
            await asyncio.sleep(0.2)
    return response
