"""Hostile input at the API adapters (OpenAI chat, completions and Responses, TGI, OIP):
schema-driven fuzzing over a real gateway and a fast synthetic engine; no input gets a 5xx."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.stack import Stack

pytestmark = pytest.mark.timeout(400)


def fuzz(url: str, examples: int, report: Path) -> dict[str, object]:
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{url}/schema/openapi.json",
        "-n", str(examples), "--seed", "1", "--checks", "not_a_server_error",
        "--include-path-regex", "completions|responses|generate|models|info|^/$",
        "--report", "json", "--report-json-path", str(report),
    ]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=360)
    assert finished.returncode == 0, finished.stdout[-3000:]
    result: dict[str, object] = json.loads(report.read_text())
    return result


async def test_fuzzed_adapter_requests_get_no_server_error(stack: Stack, tmp_path: Path) -> None:
    stack.synthetic(0)  # no pacing: valid fuzzed requests finish at once
    gateway = stack.gateway(TOKENSPOUT_MAX_BODY_BYTES="8192", TOKENSPOUT_MAX_TOKENS_LIMIT="64")
    report = await asyncio.to_thread(fuzz, gateway.url, 40, tmp_path / "st.json")
    cases = report["test_cases"]
    assert isinstance(cases, dict)
    print(f"\nadapter fuzzing: {cases['generated']} schema-driven requests, 0 server errors")
    assert cases["generated"] >= 200 and cases["with_failures"] == 0
    assert gateway.process.poll() is None
