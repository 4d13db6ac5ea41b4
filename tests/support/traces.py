"""What a test checks of one request's trace (spans from tests/support/otlp.py), and the
``curl`` a client of the traces runs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.support.otlp import ReceivedSpan

API_SPAN = "POST /v1/chat/completions"
GATEWAY, ENGINE = "tokenspout-gateway", "tokenspout-engine"
WORKER_SPANS = ("tokenspout.prepare", "tokenspout.prefill", "tokenspout.decode")
"""A run's spans under its generation span, whatever its engine."""


async def until(check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


@dataclass
class Curl:
    """``curl -N`` streaming a chat completion: its response's head and body in files."""

    process: subprocess.Popen[bytes]
    head: Path
    body: Path

    @classmethod
    def chat(
        cls,
        url: str,
        folder: Path,
        name: str,
        *,
        model: str,
        max_tokens: int,
        traceparent: str | None = None,
    ) -> Curl:
        request = {
            "model": model,
            "messages": [{"role": "user", "content": "Tell me about lighthouses."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        headers = ["-H", "content-type: application/json"]
        if traceparent is not None:
            headers += ["-H", f"traceparent: {traceparent}"]
        head, body = folder / f"{name}.head", folder / f"{name}.body"
        args = ["curl", "-sS", "-N", "-D", str(head), "-o", str(body), *headers]
        args += ["--data", json.dumps(request), f"{url}/v1/chat/completions"]
        return cls(subprocess.Popen(args), head, body)

    def chunks(self) -> int:
        """The SSE chunks arrived so far."""
        text = self.body.read_text() if self.body.exists() else ""
        return text.count("data: {")

    def finish(self, timeout_s: float) -> str:
        """Its body, once the stream has ended with ``[DONE]``."""
        assert self.process.wait(timeout_s) == 0
        body = self.body.read_text()
        assert body.rstrip().endswith("data: [DONE]"), body[-500:]
        return body

    def trace_id(self) -> str:
        """The trace the gateway served it in (its ``traceresponse`` header)."""
        for line in self.head.read_text().splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "traceresponse":
                return value.strip()[3:35]
        raise AssertionError(f"no traceresponse header in {self.head.read_text()}")


class Trace:
    """One trace's spans, looked up by name, with their parents."""

    def __init__(self, spans: list[ReceivedSpan]) -> None:
        self.spans = spans
        self.by_id = {span.span_id: span for span in spans}

    def named(self, name: str) -> list[ReceivedSpan]:
        return sorted((s for s in self.spans if s.name == name), key=lambda s: s.start_ns)

    def one(self, name: str, service: str | None = None) -> ReceivedSpan:
        found = [s for s in self.named(name) if service is None or s.service == service]
        assert len(found) == 1, (name, service, [(s.name, s.service) for s in self.spans])
        return found[0]

    def parent(self, span: ReceivedSpan) -> ReceivedSpan:
        assert span.parent_span_id in self.by_id, f"{span.name}'s parent is not in the trace"
        return self.by_id[span.parent_span_id]

    def children(self, span: ReceivedSpan) -> set[str]:
        return {s.name for s in self.spans if s.parent_span_id == span.span_id}


def has(*names: str) -> Callable[[list[ReceivedSpan]], bool]:
    """A ``wait_for_trace`` check: the trace holds spans of these names (repeated: as many)."""

    def complete(spans: list[ReceivedSpan]) -> bool:
        got = [span.name for span in spans]
        return all(got.count(name) >= names.count(name) for name in names)

    return complete
