"""vLLM's tool parsers (``vllm serve --tool-call-parser``) as the worker's ``AutoParser``
(engine/backends/base.py): they find the calls in a reply to ``tool_choice: auto``."""

from __future__ import annotations

from typing import Any

from engine.backends import vllm_api
from wire import ToolCall, Tools


def openai_tools(tools: Tools) -> list[dict[str, Any]]:
    """The functions as OpenAI's ``tools`` spells them (vLLM's requests and chat templates
    take them so)."""
    return [
        {
            "type": "function",
            "function": {
                "name": spec.name,
                "description": spec.description,
                "parameters": spec.parameters,
            },
        }
        for spec in tools.specs
    ]


class VllmToolParser:
    """One of vLLM's tool parsers (``vllm serve --tool-call-parser``) as an ``AutoParser``."""

    def __init__(self, name: str, tokenizer: Any, tools: Tools) -> None:
        self.name = name
        self._parser = vllm_api.tool_parser(name, tokenizer)
        self._request = vllm_api.chat_request(
            model="tokenspout",
            messages=[{"role": "user", "content": ""}],
            tools=openai_tools(tools),
            tool_choice="auto",
        )
        self.start_marker: str | None = getattr(self._parser, "tool_call_start_token", None)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        found = self._parser.extract_tool_calls(text, self._request)
        if not found.tools_called:
            return found.content if found.content is not None else text, []
        calls = [
            ToolCall("", call.function.name, call.function.arguments) for call in found.tool_calls
        ]
        return found.content or "", calls


def check_parser(name: str) -> None:
    """Fail at start-up, not on the first request, for a parser vLLM does not have."""
    known = vllm_api.tool_parsers()
    if name not in known:
        raise SystemExit(f"--tool-call-parser {name!r} is not one of vLLM's: {', '.join(known)}")
