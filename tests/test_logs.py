"""Structured logs of real gateway and engine processes: one key=value line per event,
the ids that tie a request to its generation, and never a message's or a reply's text."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.support.http import create_session, read_events, send
from tests.support.otlp import OtlpReceiver
from tests.support.stack import Stack, VllmStack
from wire.logs import KeyValueFormatter

LINE = re.compile(
    r"^ts=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z level=(debug|info|warning|error|critical) "
    r"service=(gateway|engine) logger=\S+ msg='[^']*'( [a-z_]+=\S+)*$"
)
SECRET = "periwinkle-octopus-4417 sings quietly"


def log_lines(folder: Path, prefix: str) -> list[str]:
    lines = [
        line
        for path in sorted(folder.glob(f"{prefix}-*.log"))
        for line in path.read_text().splitlines()
    ]
    assert lines, f"no {prefix} log in {folder}"
    return lines


def assert_structured(lines: list[str]) -> None:
    for line in lines:
        if line.startswith(("WARNING", "INFO")) or "vllm" in line.lower():
            continue  # vLLM's own loggers, in vLLM's format
        assert LINE.match(line), line


def fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=('[^']*'|\S+)", line))


@pytest.mark.timeout(120)
async def test_info_logs_carry_ids_one_line_per_event_and_never_the_text(stack: Stack) -> None:
    stack.synthetic(200)
    gateway = stack.gateway()
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, gateway.url)
        generation = await send(client, session, SECRET, max_tokens=12)
        reading = await read_events(client, session, until_final_of=generation)
        reply = reading.text(generation)
        assert SECRET in reply  # the synthetic engine echoes the message
        response = await client.get(f"{gateway.url}/health", headers={"X-Request-ID": "probe-1"})
        assert response.headers["x-request-id"] == "probe-1"
    stack.stop()  # flushes and closes every log

    gateway_lines = log_lines(stack.logs, "gateway")
    engine_lines = log_lines(stack.logs, "engine")
    for line in gateway_lines + engine_lines:
        for word in SECRET.split():
            assert word not in line, line
    assert_structured(gateway_lines + engine_lines)

    # One line per generation at INFO on each side, at its end: its queueing is DEBUG.
    assert not [line for line in gateway_lines if "msg='generation queued'" in line]
    ends = [fields(line) for line in gateway_lines if "msg='generation ended'" in line]
    assert ends == [{**ends[0], "session_id": session.session_id, "generation_id": generation}]
    assert ends[0]["state"] == "done" and ends[0]["completion_tokens"] == "12"
    requests = [fields(line) for line in gateway_lines if "msg='request'" in line]
    posted = [r for r in requests if r["route"] == "/v1/sessions/{session_id}/messages"]
    assert len(posted) == 1 and posted[0]["status"] == "202"
    assert posted[0]["session_id"] == session.session_id
    assert len({r["request_id"] for r in requests}) == len(requests)
    assert not [r for r in requests if r["route"] == "/health"]  # probes: DEBUG only

    ended = [fields(line) for line in engine_lines if "msg='generation ended'" in line]
    assert len(ended) == 1
    assert ended[0]["generation_id"] == generation and ended[0]["state"] == "done"
    assert ended[0]["completion_tokens"] == "12" and int(ended[0]["prompt_tokens"]) > 0
    # One line per generation at INFO, at its end: its start is a DEBUG line.
    assert not [line for line in engine_lines if "msg='generation started'" in line]


@pytest.mark.timeout(120)
async def test_json_lines_one_per_request_end_on_each_side_carry_the_trace_id(
    stack: Stack,
) -> None:
    """``TOKENSPOUT_LOG_FORMAT=json`` with tracing on: every line a JSON object; the
    caller's trace id on the gateway's lines about the request, the worker's and each
    side's one line at the generation's end (its ids, key, model, tokens, TTFT, duration
    and outcome)."""
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with OtlpReceiver() as receiver:
        env = {"TOKENSPOUT_LOG_FORMAT": "json"}
        stack.synthetic(200, **env, **receiver.env("tokenspout-engine"))
        gateway = stack.gateway(**env, **receiver.env("tokenspout-gateway"))
        async with httpx.AsyncClient(timeout=30) as client:
            body = {
                "model": "synthetic",
                "messages": [{"role": "user", "content": SECRET}],
                "max_tokens": 6,
            }
            headers = {"traceparent": traceparent}
            response = await client.post(
                f"{gateway.url}/v1/chat/completions", json=body, headers=headers
            )
            assert response.status_code == 200
    stack.stop()
    gateway_lines = [json.loads(line) for line in log_lines(stack.logs, "gateway")]
    engine_lines = [json.loads(line) for line in log_lines(stack.logs, "engine")]
    for line in gateway_lines + engine_lines:
        assert {"ts", "level", "service", "logger", "msg"} <= set(line), line
        assert "periwinkle" not in json.dumps(line), line
    trace_id = traceparent[3:35]
    (request,) = [line for line in gateway_lines if line["msg"] == "request"]
    assert request["route"] == "/v1/chat/completions" and request["trace_id"] == trace_id
    for side, lines in (("gateway", gateway_lines), ("engine", engine_lines)):
        (end,) = [line for line in lines if line["msg"] == "generation ended"]
        assert end["trace_id"] == trace_id, side
        assert end["model"] == "synthetic" and end["tenant"] == "anonymous", side
        assert end["completion_tokens"] == 6 and end["prompt_tokens"] > 0, side
        assert end["state"] == "done", side
        assert end["reason"] == "length", side
        assert 0 < end["ttft_ms"] <= end["duration_ms"], side


def test_the_formatter_quotes_values_with_spaces_and_drops_uvicorns_colour_copy() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello %s", ("there",), None)
    record.session_id = "s_abc"
    record.note = "two words"
    record.color_message = "\x1b[36mhello\x1b[0m"
    line = KeyValueFormatter("gateway").format(record)
    assert line.endswith("msg='hello there' session_id=s_abc note='two words'")
    assert "color_message" not in line


@pytest.mark.vllm
@pytest.mark.timeout(900)
async def test_with_vllm_the_logs_hold_neither_the_prompt_nor_the_models_reply(
    vllm_stack: VllmStack,
) -> None:
    gateway = vllm_stack.gateway
    async with httpx.AsyncClient(timeout=120) as client:
        session = await create_session(client, gateway.url)
        generation = await send(
            client, session, f"Repeat after me: {SECRET}", max_tokens=24, temperature=0
        )
        reading = await read_events(client, session, until_final_of=generation, timeout_s=300)
    assert reading.final(generation).event == "done"
    reply = reading.text(generation)
    words = {word for word in re.findall(r"[A-Za-z]{6,}", reply)}
    logs = vllm_stack.stack.logs
    # the engine logs the end right after it publishes the final event: wait for the line
    deadline = time.monotonic() + 30
    while not any(
        "msg='generation ended'" in line and generation in line
        for line in log_lines(logs, "engine")
    ):
        assert time.monotonic() < deadline, "the engine never logged the generation's end"
        await asyncio.sleep(0.1)
    lines = log_lines(logs, "gateway") + log_lines(logs, "engine")
    for line in lines:
        assert "periwinkle" not in line and "octopus" not in line, line
        if "tokenspout." in line:  # our loggers (vLLM's own log model and config, not text)
            for word in words:
                assert word not in line, (word, line)
    ended = [fields(line) for line in lines if "msg='generation ended'" in line]
    assert generation in {e["generation_id"] for e in ended}
